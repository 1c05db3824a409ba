"""The slice of a plan that building a model reads: `ModelSpec`.

    spec = plan.model_spec                      # a run's (`RunPlan`): what setup resolved
    spec = model_spec(cfg, tokenizer_vocab)     # a model that is not trained (converters, tests, benchmarks)
    model = build_model(spec, layout)           # engine.build

A spec holds the model section as the run builds it (with `model.lev.id_order_counts` filled in), the
padded and the true vocabulary, the initialisation seed, the pipeline's document tensors and its
partition rule, and the TP x PP it is laid out for. Nothing in it names data or a tokenizer file, so
code that only builds a model never fakes a run to get one.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lev.config import ModelConfig
from megatron_lev.model.stages import DOCUMENT_TENSORS


def document_inputs(data_cfg) -> tuple[str, ...]:
    """Names of the document tensors that follow `input_ids` in a pipeline batch, in order."""
    on = {"position_ids": data_cfg.reset_position_ids, "document_ids": data_cfg.reset_attention_mask}
    return tuple(name for name in DOCUMENT_TENSORS if on[name])


@dataclass(frozen=True)
class ModelSpec:
    """What building this model needs, resolved (`plan.model_spec`, `plan.model_spec(...)`)."""

    model: ModelConfig
    padded_vocab: int  # the table's rows: true_vocab rounded up to make_vocab_size_divisible_by x TP
    true_vocab: int  # the rows the loss keeps (the tokenizer's vocabulary)
    seed: int = 1234  # the initialisation's (train.seed)
    documents: tuple[str, ...] = ()  # the document tensors a pipeline batch carries (document_inputs)
    partition_method: str = "parameters"  # parallel.partition_method: blocks over pipeline stages
    tp: int = 1
    pp: int = 1

    @classmethod
    def of(cls, cfg, padded_vocab: int, true_vocab: int) -> ModelSpec:
        """The spec of a validated run config's model (`RunConfig`) at these vocabulary sizes: the seed,
        the document tensors, the partition rule and TP x PP from their sections."""
        p = cfg.parallel
        return cls(
            cfg.model,
            padded_vocab,
            true_vocab,
            seed=cfg.train.seed,
            documents=document_inputs(cfg.data),
            partition_method=p.partition_method,
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
        )
