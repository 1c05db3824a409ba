"""`torch.compile` of the decoder blocks, applied to a built model from outside (torchtitan's
`apply_compile`): `model.compile: true`.

Each `TransformerBlock` is compiled in place (`nn.Module.compile`), so parameter names, state dicts
and checkpoints are those of the eager model, and every block of a model shares one compiled graph
(the blocks run the same code; their weights are the graph's inputs). The input embedding (LEV's own
kernels), the final norm and the fused head + loss stay eager. Works the same inside activation
checkpointing and on a pipeline's stages. The first steps pay the compilation (minutes on CPU).
"""

from __future__ import annotations

from torch import nn

from megatron_lev.config import ModelConfig
from megatron_lev.model.block import TransformerBlock


def apply_compile(model: nn.Module, model_cfg: ModelConfig) -> nn.Module:
    """Compile every `TransformerBlock` of `model` (a `GPTModel` or a pipeline's stages) when
    `model_cfg.compile` is on; returns `model`."""
    if not model_cfg.compile:
        return model
    for module in model.modules():
        if isinstance(module, TransformerBlock) and not getattr(module, "_compiled_call_impl", None):
            module.compile(dynamic=False)
    return model
