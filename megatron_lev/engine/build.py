"""From a run config to this rank's model: `GPTModel` (PP = 1) or a DeepSpeed `PipelineModule`
(`engine.pipeline`, built from the same stages). Which of the two is the backend's choice."""

from __future__ import annotations

from torch import nn

from megatron_lev.config import RunConfig
from megatron_lev.engine.pipeline import build_pipeline
from megatron_lev.engine.plan import RunPlan, validate_config
from megatron_lev.errors import ConfigError
from megatron_lev.model.gpt import GPTModel
from megatron_lev.model.vocab import padded_vocab_size
from megatron_lev.parallel import state


def build_model(run: RunPlan | RunConfig, vocab_size: int | None = None, topology=None) -> nn.Module:
    """Build the model for this rank from a `RunPlan` (the trainer's path), or from a bare `RunConfig`
    and the tokenizer's `vocab_size` (tests and tools).

    A plan was validated and its vocabulary padded by `engine.plan`: nothing is checked or derived
    again. A bare config is validated here (`validate_config`) and `vocab_size` padded, before
    anything touches a process group, so a bad layout (heads not divisible by TP, ZeRO-2/3 with
    PP, ...) fails with a message naming the key. The padding rows are left out of the loss (see
    `parallel.cross_entropy`). Needs `parallel.state.initialize_model_parallel(tp, pp)` when TP or
    PP > 1.
    """
    if isinstance(run, RunPlan):
        if run.padded_vocab is None:
            raise ValueError("the plan has no vocabulary yet: call plan.with_vocab(tokenizer_vocab) first")
        if vocab_size is not None and vocab_size != run.true_vocab:
            raise ValueError(f"vocab_size={vocab_size} differs from the plan's {run.true_vocab}")
        cfg, vocab_size, padded = run.cfg, run.true_vocab, run.padded_vocab
    else:
        if vocab_size is None:
            raise TypeError("build_model(cfg, vocab_size): give the tokenizer's vocabulary size")
        cfg = validate_config(run)
        padded = padded_vocab_size(vocab_size, cfg.model, cfg.parallel.tensor_model_parallel_size)
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if (tp > 1 or pp > 1) and not state.is_initialized():
        raise RuntimeError(
            f"parallel.tensor_model_parallel_size={tp}, parallel.pipeline_model_parallel_size={pp}: "
            "call megatron_lev.parallel.state.initialize_model_parallel(tp, pp) first"
        )
    if state.is_initialized() and (
        state.get_tensor_model_parallel_world_size(),
        state.get_pipeline_model_parallel_world_size(),
    ) != (tp, pp):
        raise ConfigError(
            f"the process groups have TP={state.get_tensor_model_parallel_world_size()}, "
            f"PP={state.get_pipeline_model_parallel_world_size()} but the config asks for "
            f"parallel.tensor_model_parallel_size={tp}, parallel.pipeline_model_parallel_size={pp}"
        )
    if pp == 1:
        return GPTModel(cfg.model, padded, seed=cfg.train.seed, true_vocab_size=vocab_size)
    return build_pipeline(cfg, padded, topology, true_vocab_size=vocab_size)
