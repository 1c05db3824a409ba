"""Layout-independent parameter names, shapes and shard rules (for checkpoint conversion and tests).

The canonical name of a parameter is its name in `GPTModel` (`embedding.*`, `layers.{i}.*`,
`final_norm.weight`, `output_head.weight`), whatever the TP/PP layout it was trained in; a
pipeline stage's own names are already canonical (`model.stages`). For each parameter the spec
gives the full (TP = 1) shape, the dimension it is split along across TP ranks (None:
replicated) and, for fused column-parallel weights, the full sizes of the fused parts:
TP rank r holds its slice of *each* part, concatenated in order (QKV: `[q_r; k_r; v_r]`,
gate/up: `[gate_r; up_r]`), so a merge must not simply concatenate rank shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lev.config import ModelConfig
from megatron_lev.parallel.layout import SINGLE, ParallelLayout


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]  # full shape (TP = 1)
    partition_dim: int | None  # None: replicated on every TP rank
    parts: tuple[int, ...] | None = None  # fused parts' full sizes along `partition_dim`
    buffer: bool = False  # a persistent buffer (no gradient, no optimizer state), e.g. LEV's `id_rank`


def canonical_state_dict_spec(
    model_cfg: ModelConfig,
    vocab_size: int,
    layout: ParallelLayout = SINGLE,
    true_vocab_size: int | None = None,
) -> dict[str, ParamSpec]:
    """Every tensor of the model's state dict for `model_cfg` and the padded `vocab_size`, by canonical
    name: the parameters, then (`buffer=True`, replicated on every TP rank) the persistent buffers,
    such as the token-id order of LEV's codebooks (`embedding.codebooks.id_rank`).

    The answer depends on the arguments alone: `layout` (sizes suffice, no process group) is the TP
    layout whose shards the spec is built through, which checks the model splits over it; the full
    shapes are the same for every layout. `true_vocab_size` (the tokenizer's; default: every row
    real) sets the one-process vocabulary a replicated embedding's shapes derive from (LEV's
    codebooks and token order), as in `GPTModel`."""
    from megatron_lev.model.gpt import GPTModel

    tp = layout.tp
    with torch.device("meta"):  # shapes and metadata only: no memory, no random draws kept
        model = GPTModel(model_cfg, vocab_size, true_vocab_size=true_vocab_size, layout=layout)
    specs = {}
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            shape = list(param.shape)
            if dim is not None:
                shape[dim] *= tp
            parts = getattr(module, "part_sizes", None) if dim is not None else None
            specs[name] = ParamSpec(
                name, tuple(shape), dim, tuple(parts) if parts and len(parts) > 1 else None
            )
    for module_name, module in model.named_modules():
        for bname, buf in module.named_buffers(recurse=False):
            if buf is None or bname in module._non_persistent_buffers_set:
                continue
            name = f"{module_name}.{bname}" if module_name else bname
            specs[name] = ParamSpec(name, tuple(buf.shape), None, buffer=True)
    return specs


def parameter_specs(specs: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
    """The parameters of `specs` (what has gradients and optimizer state): buffers left out."""
    return {name: spec for name, spec in specs.items() if not spec.buffer}


def merge_tp_shards(spec: ParamSpec, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from the TP ranks' shards (in TP-rank order)."""
    if spec.partition_dim is None:
        return shards[0]
    dim, tp = spec.partition_dim, len(shards)
    if not spec.parts:
        return torch.cat(shards, dim=dim)
    local = [p // tp for p in spec.parts]
    pieces = [s.split(local, dim=dim) for s in shards]  # [rank][part]
    return torch.cat(
        [torch.cat([pieces[r][i] for r in range(tp)], dim=dim) for i in range(len(local))], dim=dim
    )


def split_tp_shard(spec: ParamSpec, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s shard of the full tensor (the inverse of `merge_tp_shards`)."""
    if spec.partition_dim is None:
        return full
    dim = spec.partition_dim
    if not spec.parts:
        return full.chunk(tp, dim=dim)[rank]
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in full.split(list(spec.parts), dim=dim)], dim=dim)
