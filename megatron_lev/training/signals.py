"""Preemption: on SIGTERM / SIGUSR1 finish the step, save, and exit with status 75.

Slurm sends SIGTERM (or the `--signal` of the job) before it kills a job; the
sbatch script requeues a job that exits with `PREEMPTED_EXIT_CODE` (EX_TEMPFAIL).
A signal may reach only some ranks, so every step the ranks all-reduce the flag:
they stop at the same iteration and none waits forever in a collective.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from megatron_lev.logging import get_logger

PREEMPTED_EXIT_CODE = 75
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

log = get_logger(__name__)


class PreemptionWatcher:
    """Records preemption signals; `should_stop()` (collective) says whether any rank got one."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            log.warning("received %s: will save a checkpoint after this step and exit with status %d",
                        signal.Signals(signum).name, PREEMPTED_EXIT_CODE)
        self.received = signum

    def install(self) -> PreemptionWatcher:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> PreemptionWatcher:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def should_stop(self, device: torch.device | None = None) -> bool:
        """True on every rank if any rank was signalled (an all-reduce MAX when distributed)."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)
