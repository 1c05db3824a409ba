"""Preemption: on SIGTERM / SIGUSR1 finish the step, save, and exit with status 75.

Slurm sends SIGTERM (or the `--signal` of the job) before it kills a job; the
sbatch script requeues a job that exits with `PREEMPTED_EXIT_CODE` (EX_TEMPFAIL).
A signal may reach only some ranks, so every step the ranks all-reduce the flag:
they stop at the same iteration and none waits forever in a collective.

Two phases. `install_startup_handler()` runs first, before torch and DeepSpeed are
imported: there is nothing to save yet, so a signal exits 75 at once. `pretrain()`
then installs a `PreemptionWatcher`, which only records the signal; the trainer
checks it between steps. This module imports nothing heavy so the first phase can
start within milliseconds.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
from pathlib import Path
from types import FrameType

PREEMPTED_EXIT_CODE = 75
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
EXIT_DIR_ENV = "MEGATRON_LEV_EXIT_DIR"  # launchers read each rank's exit status here (torchrun hides 75)


def _log():
    from megatron_lev.log import get_logger

    return get_logger(__name__)


# What a rank's report says of its exit, for a launcher deciding whether to start the run again:
# "done" (0), "preempted" (75: requeue), "fatal" (the same command would fail the same way: a config,
# data or checkpoint error, or a run stopped by its own health checks) or "crash" (anything a restart
# from the last checkpoint can cure: a peer that died, a collective that timed out, an uncaught
# exception such as a CUDA or NCCL error). A rank killed outright writes nothing.


def exit_kind(code: int, exc: BaseException | None = None) -> str:
    """The kind of exit (done, preempted, fatal or crash: above) of a rank that ends with status
    `code`, raised by `exc` if any."""
    from megatron_lev.errors import DistributedError, UserError

    if code == 0:
        return "done"
    if code == PREEMPTED_EXIT_CODE:
        return "preempted"
    if exc is None or isinstance(exc, SystemExit):
        # a status returned by the trainer (3: its health checks stopped it) or an argument error (2)
        return "fatal"
    if isinstance(exc, DistributedError):
        return "crash"  # another rank stopped answering: the cause is there, and a restart may cure it
    if isinstance(exc, (UserError, KeyboardInterrupt)):
        return "fatal"
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        return "fatal"  # a path the user gave
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return "fatal"  # a full or read-only disk stays so until someone acts
    return "crash"


def report_exit_code(code: int, kind: str | None = None) -> None:
    """Write this rank's exit status and its kind (`exit_kind`; by default that of a status alone) to
    `$MEGATRON_LEV_EXIT_DIR/rank<R>` ("1 crash") if a launcher asked for it."""
    directory = os.environ.get(EXIT_DIR_ENV)
    if not directory:
        return
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
    kind = kind or exit_kind(int(code))
    try:
        Path(directory, f"rank{rank}").write_text(f"{int(code)} {kind}\n")
    except OSError:
        pass  # best effort: the launcher then keeps torchrun's own status


def _exit_at_startup(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    msg = (
        f"megatron-lev train: preempted ({name}) during start-up, before the first step; nothing to save, "
        f"exiting with status {PREEMPTED_EXIT_CODE} so the job is requeued\n"
    )
    with contextlib.suppress(OSError):
        os.write(2, msg.encode())
    report_exit_code(PREEMPTED_EXIT_CODE)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a stream may be mid-write; exiting matters more
            stream.flush()
    os._exit(PREEMPTED_EXIT_CODE)  # mid-import: unwinding could run half-initialised code


def install_startup_handler(signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
    """Exit 75 at once on a preemption signal; call before the heavy imports of a training run."""
    for sig in signals:
        signal.signal(sig, _exit_at_startup)


def _note_during_shutdown(signum: int, frame: FrameType | None) -> None:
    """After the run: the process is already leaving (with its own exit status); a launcher's
    SIGTERM (torchrun stops the other ranks when one fails) must not turn an error into 75."""
    msg = f"received {signal.Signals(signum).name} while shutting down: finishing the shutdown\n"
    with contextlib.suppress(OSError):
        os.write(2, msg.encode())


class PreemptionWatcher:
    """Records preemption signals; `should_stop()` (collective) says whether any rank got one."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._group = None  # the host-side group of the flag's all-reduce, made at the first check

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            _log().warning(
                "received %s: will save a checkpoint after this step and exit with status %d",
                signal.Signals(signum).name,
                PREEMPTED_EXIT_CODE,
            )
        self.received = signum

    def install(self) -> PreemptionWatcher:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers; the start-up one (exit 75 at once) is over by now, so
        a signal from here on only finishes the shutdown (the run's exit status stands)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, _note_during_shutdown if handler is _exit_at_startup else handler)
        self._previous.clear()

    def __enter__(self) -> PreemptionWatcher:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def should_stop(self, device=None) -> bool:
        """True on every rank if any rank was signalled (an all-reduce MAX when distributed).

        The flag travels in host memory (over a gloo group when the default backend is not
        gloo), so the check never waits for the accelerator to finish the queued step.
        """
        import torch
        import torch.distributed as dist

        here = self.received is not None
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return here
        if self._group is None:  # every rank reaches its first check at the same step: a safe collective
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        flag = torch.tensor([1.0 if here else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.numpy()[0] > 0)
