"""Gradient, weight and update norms of one optimizer step, of the full tensors, in any layout.

    probe = StepProbe(ds_engine, groups, names, device, fp16, layout=layout)  # at the first measured step
    probe.arm(("embedding.",))                                  # before a step to measure
    ... train_batch ...                                         # DeepSpeed's model step runs inside
    probe.result                                                # a `StepMeasurement`

The probe wraps DeepSpeed's `_take_model_step`, the one place every layout passes through once per
optimizer step (plain engine and pipeline, ZeRO 0-3): there the gradients are reduced over the
data-parallel ranks (and between the stages that hold a tied table) and not yet clipped, and the
optimizer has not stepped. Unarmed, the wrapper only calls through.

What a rank holds of a parameter at that moment, and how it is counted:

- ZeRO-0 with torch's AdamW stepping the model's own weights: `param.grad` and `param.data`, equal
  on every data-parallel rank: counted on data-parallel rank 0 only.
- ZeRO-1/2, and DeepSpeed's bf16 optimizer: this rank's fragment of the fp32 master weight and of
  the reduced gradient (`param._hp_mapping`, what `deepspeed.utils.safe_get_full_grad` assembles),
  disjoint across data-parallel ranks: summed.
- ZeRO-3: this rank's partition of both (`safe_get_local_grad` / `safe_get_local_fp32_param`):
  summed.
- Under tensor parallelism a sharded parameter (`tensor_model_parallel`) is summed over the TP
  ranks and a replicated one counted on TP rank 0; under pipeline parallelism every stage counts
  its own parameters, and the copy of a tied table DeepSpeed marks `ds_pipe_replicated` is not
  counted again.

Each rank adds up squared norms per group and per measured tensor; one all-reduce (sum) over all
ranks makes the full tensors' norms, the same on every rank. Weights are snapshotted (this rank's
part of every parameter the optimizer updates) before the step and compared after it: the memory
of one more copy of this rank's master weights, during measured steps only. An fp16 gradient is
divided by the loss scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_lev.engine.base import GROUP_PREFIX, StepMeasurement
from megatron_lev.parallel.layout import ParallelLayout

FULL, FRAGMENT, PARTITION = "full", "fragment", "partition"


def holding(param: nn.Parameter) -> str:
    """How this rank holds `param` at the optimizer step (see the module doc)."""
    if hasattr(param, "ds_id"):
        return PARTITION
    if hasattr(param, "_hp_mapping"):
        return FRAGMENT
    return FULL


def local_grad(param: nn.Parameter, kind: str) -> torch.Tensor | None:
    """This rank's part of `param`'s reduced gradient (None: it holds none)."""
    if kind == PARTITION:
        return param._z3_optimizer.get_local_fp32_grad_for_param(param)
    if kind == FRAGMENT:
        mapping = param._hp_mapping
        if mapping is None:
            return None
        grad = mapping.get_lp_grad_fragment(param._index_in_param_group).flatten()
        address = mapping.lp_fragment_address
        if grad.shape == param.view(-1).shape:  # bf16: a full buffer on every rank, this rank owns a slice
            grad = grad.narrow(0, address.start, address.numel)
        return grad
    return param.grad


def local_weight(param: nn.Parameter, kind: str) -> torch.Tensor | None:
    """This rank's part of the weight the optimizer updates (the fp32 master where there is one)."""
    if kind == PARTITION:
        return param._z3_optimizer.get_local_fp32_param(param)
    if kind == FRAGMENT:
        mapping = param._hp_mapping
        return None if mapping is None else mapping.get_hp_fragment()
    return param.data


def counted(param: nn.Parameter, kind: str, tp_rank: int, dp_rank: int) -> bool:
    """Whether this rank's part of `param` enters the sums (each part of a full tensor once)."""
    if getattr(param, "ds_pipe_replicated", False):
        return False  # a pipeline's second copy of a tied table
    if tp_rank > 0 and not getattr(param, "tensor_model_parallel", False):
        return False  # replicated over TP: TP rank 0 counts it
    return kind != FULL or dp_rank == 0  # a full copy on every DP rank: DP rank 0 counts it


def squared_norms(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`(len(tensors),)` float64 on `device`: the squared 2-norm of each (foreach kernels per device
    and dtype, as `optim.all_finite`).

    Accumulated in float64 on the CPU and in fp32 on an accelerator. The CPU kernels add up an fp32
    tensor's squares one after another: over the 3.2M entries of a 50k x 64 table whose gradient is a
    few large rows and many tiny ones, that lost 5e-4 of the norm (the tiny squares vanish against
    the running sum), enough to clip the same step differently in two layouts. GPU kernels reduce in
    a tree (error about log2(n) ulps); bf16/fp16 are widened to fp32 there.
    """
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    by_kind: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault((t.device, t.dtype), []).append(i)
    for (where, dtype), indices in by_kind.items():
        wide = torch.float64 if where.type == "cpu" or dtype == torch.float64 else torch.float32
        norms = torch._foreach_norm([tensors[i].detach() for i in indices], 2, dtype=wide)
        values = torch.stack(norms).to(device=device, dtype=torch.float64)
        out.index_copy_(0, torch.tensor(indices, device=device), values.square())
    return out


class StepProbe:
    """Measures the optimizer steps it is armed for (see the module doc)."""

    def __init__(
        self,
        ds_engine: Any,
        groups: Sequence[tuple[str, Sequence[nn.Parameter]]],
        names: dict[int, str],
        device: torch.device,
        fp16: bool = False,
        *,
        layout: ParallelLayout,
    ) -> None:
        """`groups`: the optimizer's parameter groups `(name, parameters)`; `names`: canonical name by
        `id(parameter)`; `device`: where the all-reduced sums live; `layout`: this rank's parallel
        layout (its TP and DP ranks decide which copy of a tensor it counts)."""
        if not hasattr(ds_engine, "_take_model_step"):
            raise RuntimeError(
                "this DeepSpeed version has no DeepSpeedEngine._take_model_step: the step probe cannot "
                "measure its optimizer steps"
            )
        self.ds_engine, self.groups, self.names = ds_engine, list(groups), names
        self.device, self.fp16, self.layout = device, fp16, layout
        self.result: StepMeasurement | None = None
        self._prefixes: tuple[str, ...] | None = None
        self._layouts: dict[tuple[str, ...], _Layout] = {}
        self._snapshot: tuple | None = None  # (layout, entries with a weight, their copies, sums)
        step = ds_engine._take_model_step

        def take_model_step(*args, **kwargs):
            if self._prefixes is None:
                return step(*args, **kwargs)
            self._before()
            out = step(*args, **kwargs)
            self._after()
            return out

        ds_engine._take_model_step = take_model_step

    def arm(self, prefixes: Sequence[str]) -> None:
        """Measure the next optimizer step (groups, and tensors whose name starts with a prefix)."""
        self._prefixes, self.result = tuple(prefixes), None

    # ------------------------------------------------------------------ inside the step

    def _layout(self) -> _Layout:
        prefixes = self._prefixes
        if prefixes not in self._layouts:
            self._layouts[prefixes] = _Layout.build(self.groups, self.names, prefixes, self.layout)
        return self._layouts[prefixes]

    def _before(self) -> None:
        layout = self._layout()
        grads, weights = [], []
        for param, kind in layout.entries:
            grads.append(local_grad(param, kind))
            weights.append(local_weight(param, kind))
        sums = torch.zeros(3, len(layout.names), dtype=torch.float64, device=self.device)
        has_grad = [i for i, g in enumerate(grads) if g is not None]
        grad_sq = squared_norms([grads[i] for i in has_grad], self.device)
        if self.fp16:
            scale = self.ds_engine._get_optimizer_loss_scale() or 1.0
            grad_sq = grad_sq / float(scale) ** 2
        layout.add(sums[0], has_grad, grad_sq)
        has_weight = [i for i, w in enumerate(weights) if w is not None]
        layout.add(sums[1], has_weight, squared_norms([weights[i] for i in has_weight], self.device))
        snapshot = [weights[i].detach().clone() for i in has_weight]
        self._snapshot = (layout, has_weight, snapshot, sums)

    def _after(self) -> None:
        layout, has_weight, snapshot, sums = self._snapshot
        self._snapshot = None
        diffs = []
        for i, before in zip(has_weight, snapshot):
            param, kind = layout.entries[i]
            diffs.append(local_weight(param, kind).detach().float() - before.float())
        layout.add(sums[2], has_weight, squared_norms(diffs, self.device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        norms = sums.sqrt()
        self.result = StepMeasurement(layout.names, norms[0], norms[1], norms[2])
        self._prefixes = None


class _Layout:
    """The measured names (the same list on every rank) and this rank's counted parameters, each with
    the rows of the sums it adds to: its group's and, for a measured tensor, its own."""

    def __init__(self, names: tuple[str, ...], entries: list, group_rows: list[int], tensor_rows: list[int]):
        self.names, self.entries = names, entries
        self.group_rows, self.tensor_rows = group_rows, tensor_rows  # per entry; tensor row -1: none

    @classmethod
    def build(
        cls,
        groups: Sequence[tuple[str, Sequence[nn.Parameter]]],
        names: dict[int, str],
        prefixes,
        parallel: ParallelLayout,
    ) -> _Layout:
        tp_rank, dp_rank = parallel.tp_rank, parallel.dp_rank
        local_groups = list(dict.fromkeys(name for name, _ in groups))
        local_tensors = [
            names[id(p)]
            for _, params in groups
            for p in params
            if id(p) in names and names[id(p)].startswith(prefixes)
        ]
        all_groups, all_tensors = local_groups, sorted(set(local_tensors))
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank must sum the same rows
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (local_groups, local_tensors))
            all_groups = list(dict.fromkeys(g for gs, _ in gathered for g in gs))
            all_tensors = sorted({t for _, ts in gathered for t in ts})
        row_names = tuple(GROUP_PREFIX + g for g in all_groups) + tuple(all_tensors)
        row = {n: i for i, n in enumerate(row_names)}
        entries, group_rows, tensor_rows = [], [], []
        seen: set[int] = set()
        for group, params in groups:
            for p in params:
                kind = holding(p)
                if id(p) in seen or not p.requires_grad or not counted(p, kind, tp_rank, dp_rank):
                    continue
                seen.add(id(p))
                entries.append((p, kind))
                group_rows.append(row[GROUP_PREFIX + group])
                name = names.get(id(p))
                tensor_rows.append(row[name] if name is not None and name in row else -1)
        return cls(row_names, entries, group_rows, tensor_rows)

    def add(self, into: torch.Tensor, which: list[int], values: torch.Tensor) -> None:
        """Add `values[k]` (entry `which[k]`) into its group's row and its tensor's row of `into`."""
        if not which:
            return
        device = into.device
        into.index_add_(0, torch.tensor([self.group_rows[i] for i in which], device=device), values)
        tensor = [(k, self.tensor_rows[i]) for k, i in enumerate(which) if self.tensor_rows[i] >= 0]
        if tensor:
            ks, rows = zip(*tensor)
            into.index_add_(0, torch.tensor(rows, device=device), values[torch.tensor(ks, device=device)])


__all__ = ["StepProbe", "counted", "holding", "local_grad", "local_weight", "squared_norms"]
