"""Where this process stands in `torch.distributed`, and two collectives every layer needs.

The one home of the rank helpers: before the process group exists (or without one) a
process is rank 0 of 1, except that `launcher_rank` reads the launcher's variables so a
log line written before `init_process_group` still names its rank.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from megatron_lev.errors import CheckpointDataError
from megatron_lev.utils.io import DiskFullError


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    """The number of processes in the default group (1 without one)."""
    return dist.get_world_size() if initialized() else 1


def launcher_rank() -> int:
    """The global rank, or before the process group exists the launcher's (`RANK`, `SLURM_PROCID`)."""
    if initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def barrier() -> None:
    if initialized():
        dist.barrier()


def gather_lists(items: list) -> list:
    """Collective: every rank's list concatenated in rank order."""
    if world_size() == 1:
        return items
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def raise_on_every_rank(exc: BaseException | None) -> None:
    """Collective: raise on every rank when any rank failed (`exc` is this rank's failure, or None).

    The rank that failed re-raises its own exception; the others raise one of the same kind
    (DiskFullError, CheckpointDataError, else RuntimeError) naming the failing rank, so no rank
    waits in a later collective for one that already gave up."""
    if world_size() == 1:
        if exc is not None:
            raise exc
        return
    mine = None
    if exc is not None:
        kind = (
            "disk"
            if isinstance(exc, DiskFullError)
            else "data"
            if isinstance(exc, CheckpointDataError)
            else "other"
        )
        mine = (kind, f"{type(exc).__name__}: {exc}" if kind == "other" else str(exc))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if exc is not None:
        raise exc
    failed = [(r, part) for r, part in enumerate(parts) if part is not None]
    if failed:
        r, (kind, msg) = failed[0]
        cls = {"disk": DiskFullError, "data": CheckpointDataError}.get(kind, RuntimeError)
        raise cls(f"{msg} (on rank {r})")
