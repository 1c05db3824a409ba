"""From a run config to this rank's model: `GPTModel` (PP = 1) or a DeepSpeed `PipelineModule`
(`engine.pipeline`, built from the same stages). Which of the two is the backend's choice."""

from __future__ import annotations

from torch import nn

from megatron_lev.config import RunConfig
from megatron_lev.engine.pipeline import build_pipeline
from megatron_lev.errors import ConfigError
from megatron_lev.model.gpt import GPTModel
from megatron_lev.model.vocab import padded_vocab_size
from megatron_lev.parallel import state


def build_model(cfg: RunConfig, vocab_size: int, topology=None) -> nn.Module:
    """Validate `cfg`, pad `vocab_size` (the tokenizer's), and build the model for this rank.

    The padding rows are left out of the loss (see `parallel.cross_entropy`).

    The config is checked before anything touches a process group, so a bad layout
    (heads not divisible by TP, ZeRO-2/3 with PP, ...) fails here with a message naming the key.
    Needs `parallel.state.initialize_model_parallel(tp, pp)` when TP or PP > 1.
    """
    cfg.validate()
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
    padded = padded_vocab_size(vocab_size, cfg.model, tp)
    if pp == 1:
        return GPTModel(cfg.model, padded, seed=cfg.train.seed, true_vocab_size=vocab_size)
    return build_pipeline(cfg, padded, topology, true_vocab_size=vocab_size)
