"""From a run plan and this rank's parallel layout to this rank's model: `GPTModel` (PP = 1) or a
DeepSpeed `PipelineModule` (`engine.pipeline`, built from the same stages). Which of the two is the
backend's choice."""

from __future__ import annotations

from torch import nn

from megatron_lev.engine.pipeline import build_pipeline
from megatron_lev.errors import ConfigError
from megatron_lev.model.gpt import GPTModel
from megatron_lev.parallel.layout import ParallelLayout
from megatron_lev.plan import RunPlan


def build_model(plan: RunPlan, layout: ParallelLayout, topology=None) -> nn.Module:
    """Build the model for this rank from a `RunPlan` with its vocabulary (`plan.with_vocab`) and the
    `layout` of the process groups (`parallel.state.initialize_model_parallel`; with TP = PP = 1 a
    sizes-only `ParallelLayout.single()` will do).

    The plan was validated and its vocabulary padded by `plan` (tests and tools call
    `plan.validate_run(cfg, world, cuda=False)`): nothing is checked or derived again, but the
    layout must be the plan's. The padding rows are left out of the loss (see `parallel.cross_entropy`).
    """
    if plan.padded_vocab is None:
        raise ValueError("the plan has no vocabulary yet: call plan.with_vocab(tokenizer_vocab) first")
    cfg = plan.cfg
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if (layout.tp, layout.pp) != (tp, pp):
        raise ConfigError(
            f"the layout has TP={layout.tp}, PP={layout.pp} but the config asks for "
            f"parallel.tensor_model_parallel_size={tp}, parallel.pipeline_model_parallel_size={pp}"
            + (
                ""
                if layout.has_groups
                else ": call megatron_lev.parallel.state.initialize_model_parallel(tp, pp)"
            )
        )
    if pp == 1:
        return GPTModel(
            cfg.model, plan.padded_vocab, seed=cfg.train.seed, true_vocab_size=plan.true_vocab, layout=layout
        )
    return build_pipeline(cfg, plan.padded_vocab, layout, topology, true_vocab_size=plan.true_vocab)
