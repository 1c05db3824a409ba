"""Join and leave the default process group: a bounded wait everywhere, one way out.

    join("gloo", rank, world_size, addr, port, timeout_s=600, heartbeat_s=300)
    with leaving_cleanly():      # a command's body: every exit path ends in shutdown()
        ...

`join` initialises torch.distributed with `timeout_s` on the rendezvous and on every
collective (the default group and every group created after it, DeepSpeed's included: gloo
raises when a collective waits longer, NCCL's watchdog aborts it), and starts the heartbeat
watchdog (`parallel.watchdog`) when `heartbeat_s > 0` and there is more than one rank.

`shutdown` is the one exit: stop the watchdog (marking this rank done), destroy every process
group without a barrier (a barrier at exit waits forever for a peer that died), then flush the
logs. Leaving the groups to the interpreter's exit lets their C++ threads be destroyed while
still joinable ("terminate called without an active exception", an abort with status 134,
reproduced after a gloo timeout). It leaves alone a group this module did not create (a test
harness's, or `run_workers`'s when a command runs inside a worker).

A process that left a group of several ranks ends through `end_process(code)` (`cli.entry`, the
process's entry point, calls it): non-daemon threads joined and `atexit` handlers run as at a normal exit,
the streams flushed, then `os._exit(code)` without the interpreter's finalization. Groups that
DeepSpeed and the parallel layout still reference outlive `destroy_process_group` with their gloo
worker threads (a 2-rank gloo job holding one subgroup keeps 4 of its 7 threads after it); their
C++ destructors would run during finalization, where a worker thread that takes the GIL is made
to exit and the process aborts ("terminate called without an active exception", status 134): seen
once on rank 1 of a 2-rank CPU run after a clean save and a clean leave on both ranks.

`leaving_cleanly()` wraps a command's body: a collective that timed out or lost its peer becomes
a `DistributedError`, one line naming this rank and, when the watchdog can tell, the rank to
blame; a rank that fails otherwise leaves its one-line error for the others to quote; and
`shutdown()` runs in a `finally`, so normal ends, errors and preemption exits (status 75) all
leave the same way with their exit status unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

from megatron_lev.errors import DistributedError, UserError
from megatron_lev.log import get_logger
from megatron_lev.parallel.watchdog import Heartbeat

log = get_logger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0  # Megatron-LM's default; NCCL's first iteration and big saves fit
DEFAULT_HEARTBEAT_TIMEOUT_S = 300.0


@dataclass
class Session:
    """What `join` set up, for `shutdown` to take down."""

    rank: int
    world_size: int
    timeout_s: float
    heartbeat: Heartbeat | None
    saved_timeouts: dict[str, object]

    def set_phase(self, phase: str) -> None:
        """What this rank is doing now, for a peer's diagnosis of a timeout (`Heartbeat.set_phase`); a
        no-op without a heartbeat."""
        if self.heartbeat is not None:
            self.heartbeat.set_phase(phase)


_SESSION: Session | None = None
_LEFT_GROUP = False  # `shutdown` left a group of several ranks: `end_process` skips finalization


def no_phase(phase: str) -> None:
    """A phase reporter for code that runs without a session (tests, tools): says nothing."""


def phase_reporter() -> Callable[[str], None]:
    """The joined session's `set_phase` (no_phase without one): the composition root takes it once and
    passes it to what reports its phase (the trainer, the engine's save, `ckpt.io.save_checkpoint`)."""
    return _SESSION.set_phase if _SESSION is not None else no_phase


def current() -> Session | None:
    """The group this process joined with `join` (None before, after `shutdown`, or if another
    component created the group)."""
    return _SESSION


def _set_default_timeouts(timeout: timedelta) -> dict[str, object]:
    """Make `timeout` the default of every group created from now on (`new_group` without a
    timeout takes torch's module default: 30 min for gloo, 10 for NCCL). Returns the old values."""
    from torch.distributed import distributed_c10d as c10d

    saved = {}
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if isinstance(getattr(c10d, name, None), timedelta):
            saved[name] = getattr(c10d, name)
            setattr(c10d, name, timeout)
    return saved


def _restore_default_timeouts(saved: dict[str, object]) -> None:
    from torch.distributed import distributed_c10d as c10d

    for name, value in saved.items():
        setattr(c10d, name, value)


def join(
    backend: str,
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    *,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    heartbeat_s: float = 0.0,
    store_owner: str = "rank 0",
    on_abort: Callable[[str], None] | None = None,
) -> Session:
    """Initialise the default process group (tcp:// rendezvous at `addr:port`) with `timeout_s`
    on the rendezvous and every collective; start the heartbeat when `heartbeat_s > 0`.

    A rendezvous that fails (a rank that never came, a port in use, an unreachable address)
    raises `DistributedError` naming what to check."""
    import torch.distributed as dist

    global _SESSION
    timeout = timedelta(seconds=timeout_s)
    saved = _set_default_timeouts(timeout)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://{addr}:{port}",
            timeout=timeout,
        )
    except Exception as exc:
        _restore_default_timeouts(saved)
        error = _rendezvous_error(exc, rank, world_size, addr, port, timeout_s)
        if error is exc:
            raise
        raise error from exc
    heartbeat = None
    try:
        if heartbeat_s > 0 and world_size > 1:
            heartbeat = Heartbeat(
                addr, port, rank, world_size, heartbeat_s, store_owner=store_owner, on_abort=on_abort
            ).start()
    except BaseException:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        _restore_default_timeouts(saved)
        raise
    _SESSION = Session(rank, world_size, timeout_s, heartbeat, saved)
    return _SESSION


def shutdown(announce: bool = True) -> None:
    """Leave what `join` set up: stop the watchdog, destroy every process group (no barrier; the
    model-parallel groups of any `ParallelLayout` with them), flush the logs. Idempotent; always
    flushes. `announce` logs one INFO line saying so (else DEBUG)."""
    global _SESSION, _LEFT_GROUP
    session, _SESSION = _SESSION, None
    try:
        if session is not None:
            _LEFT_GROUP = _LEFT_GROUP or session.world_size > 1
            if session.heartbeat is not None:
                session.heartbeat.stop()
            import torch.distributed as dist

            destroyed = False
            if dist.is_available() and dist.is_initialized():
                with contextlib.suppress(Exception):  # a peer may be gone: nothing to wait for
                    dist.destroy_process_group()
                    destroyed = True
            _restore_default_timeouts(session.saved_timeouts)
            quiet = not announce or session.world_size == 1  # one process: nothing to tell apart
            log.log(
                logging.DEBUG if quiet else logging.INFO,
                "rank %d of %d left the process group (%s)",
                session.rank,
                session.world_size,
                "groups destroyed" if destroyed else "destroying the groups failed",
            )
    finally:
        flush_logs()


def end_process(code: int | None) -> None:
    """End this process with `code` if it left a group of several ranks; else return (the caller
    exits as usual).

    What a normal exit does for Python code still happens first: every non-daemon thread is
    joined, the `atexit` handlers run (logging, multiprocessing children, TensorBoard), the
    streams are flushed. Only the interpreter's finalization is skipped, in which the C++
    destructors of process groups still referenced elsewhere would run with their worker threads
    alive (module docstring)."""
    if not _LEFT_GROUP:
        return
    import atexit
    import os
    import threading

    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon and thread is not threading.current_thread():
            thread.join()
    atexit._run_exitfuncs()
    flush_logs()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def flush_logs() -> None:
    """Flush every logging handler and the standard streams (best effort)."""
    loggers = [logging.getLogger(), logging.getLogger("megatron_lev")]
    for logger in loggers:
        for handler in logger.handlers:
            with contextlib.suppress(Exception):
                handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# ---------------------------------------------------------------------- one line per failure

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
# gloo's "Application timeout caused pair closure": a collective of this rank reached the group's
# timeout (seen in a save's last barrier while a peer was still writing)
_TIMED_OUT = ("Timed out", "timed out", "Watchdog caught collective operation timeout", "Application timeout")


def torch_error_text(exc: BaseException) -> str:
    """The first line of a torch.distributed error without its C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(". ")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = 0
    while exc is not None and seen < 8:
        yield exc
        exc = exc.__cause__ or exc.__context__
        seen += 1


def collective_failure(exc: BaseException) -> BaseException | None:
    """The torch.distributed error in `exc`'s chain if it is one (a collective that timed out or
    lost a peer, gloo or NCCL), else None."""
    import torch.distributed as dist

    for e in _chain(exc):
        if isinstance(e, UserError):
            return None  # already one line
        if isinstance(e, getattr(dist, "DistError", ())):
            return e
        if isinstance(e, RuntimeError):
            text = str(e)
            if (
                "gloo" in text
                or "NCCL" in text
                or any(p in text for p in (*_PEER_GONE, "Application timeout"))
            ):
                return e
    return None


def as_distributed_error(exc: BaseException) -> DistributedError | None:
    """`exc` as one line if it is a collective failure in a group `join` set up, else None.

    The line names this rank, what happened (a timeout of `parallel.collective_timeout_s`, a
    peer that closed its connection) and, when the watchdog can tell within a few beats, the
    rank to blame: one that published its error, or the one whose heartbeat stopped."""
    session = _SESSION
    if session is None or session.world_size < 2:
        return None
    cause = collective_failure(exc)
    if cause is None:
        return None
    text = torch_error_text(cause)
    if any(p in text for p in _TIMED_OUT):
        what = f"a collective waited longer than parallel.collective_timeout_s={session.timeout_s:g} s"
    elif any(p in text for p in _PEER_GONE):
        what = "a collective lost its connection to another rank"
    else:
        what = "a collective failed"
    blame = session.heartbeat.diagnose() if session.heartbeat is not None else None
    if blame is None:
        blame = "the launcher's message and the other ranks' logs say which rank failed first"
    return DistributedError(f"rank {session.rank} of {session.world_size}: {what} ({text}); {blame}")


def _rendezvous_error(
    exc: BaseException, rank: int, world_size: int, addr: str, port: int, timeout_s: float
) -> BaseException:
    text = torch_error_text(exc)
    where = f"{addr}:{port}"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return exc  # the launcher (training/rendezvous.py) names the port with advice for how it was started
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:
        return DistributedError(
            f"the process group did not form within parallel.collective_timeout_s={timeout_s:g} s: "
            f"{joined.group(1)} of {world_size} ranks joined at {where}; start every rank "
            f"0..{world_size - 1} with the same MASTER_ADDR and MASTER_PORT (or check that none died "
            "while starting)"
        )
    if isinstance(exc, RuntimeError) and ("timed out" in text.lower() or "Timed out" in text):
        return DistributedError(
            f"rank {rank} of {world_size} could not join the process group at {where} within "
            f"parallel.collective_timeout_s={timeout_s:g} s ({text}): start rank 0 there, check "
            "MASTER_ADDR and MASTER_PORT, and that every rank was started"
        )
    if collective_failure(exc) is not None:
        return DistributedError(
            f"rank {rank} of {world_size} could not join the process group at {where} ({text}): "
            "check MASTER_ADDR, MASTER_PORT and that rank 0 is running"
        )
    return exc


@contextlib.contextmanager
def leaving_cleanly() -> Iterator[None]:
    """Run a command's body; turn a collective failure into one line and always `shutdown()` the
    group joined inside it (one joined before, e.g. by `run_workers`, is its owner's to leave)."""
    outer = _SESSION
    try:
        yield
    except BaseException as exc:
        joined_here = _SESSION is not None and _SESSION is not outer
        error = as_distributed_error(exc) if isinstance(exc, Exception) and joined_here else None
        if error is not None:
            raise error from exc
        session = _SESSION if joined_here else None
        if isinstance(exc, Exception) and session is not None and session.heartbeat is not None:
            # so that a peer whose collective broke because this rank left can say why
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            line = first if isinstance(exc, UserError) else f"{type(exc).__name__}: {first}"
            session.heartbeat.report_error(line, wait=min(2.0, session.heartbeat.interval))
        raise
    finally:
        if _SESSION is not None and _SESSION is not outer:
            shutdown()
        else:
            flush_logs()


__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "Session",
    "as_distributed_error",
    "collective_failure",
    "current",
    "end_process",
    "flush_logs",
    "join",
    "leaving_cleanly",
    "shutdown",
    "torch_error_text",
]
