"""Run a function on N local CPU processes joined by a gloo process group (offline tools: `reshard`).

    results = run_workers(fn, world_size=4, args=(x,))

`fn(*args, **kwargs)` runs on every rank after `torch.distributed` is initialised (gloo, a free
port on 127.0.0.1, every collective bounded by `timeout`); its return values come back as a list
indexed by rank. A rank that raises or dies, or a group that hangs past `timeout` seconds, stops
every rank and raises `WorkerError`: a `UserError` whose message is one line naming the rank that
failed first and its error's first line, or, for a rank that died without a word, its exit
status or signal ("rank 1 of 2 was killed by SIGKILL ..."). The rank's traceback travels as the
error's cause (`--debug` shows it) and as `.traceback`.

Each rank's stdout and stderr go to a log file of its own, which this process copies to its
stderr as it grows; when a rank dies or hangs, the last lines of its log are printed again under
a header naming it, just before the error. Every rank leaves through `parallel.session.shutdown`.

Ranks are forked when that is safe (`default_start_method`), else spawned; `fn` must be
importable (module level) for the spawned case.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_lev.errors import UserError
from megatron_lev.parallel.session import collective_failure, torch_error_text

CPU_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}


class WorkerError(UserError, RuntimeError):
    """A rank raised, died, or the group timed out; `str()` is one line.

    `rank` is the rank that failed first (None for a timeout or ranks that died without a word),
    `traceback` its traceback (empty unless it raised), `others` the ranks that failed after it.
    """

    def __init__(
        self, message: str, rank: int | None = None, traceback: str = "", others: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        self.rank, self.traceback, self.others = rank, traceback, others


class _RemoteTraceback(Exception):
    def __str__(self) -> str:
        return self.args[0]


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the system picks it): the rendezvous port of local ranks
    (`run_workers`, and `training.rendezvous` when no launcher set MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return s.getsockname()[1]


def default_start_method() -> str:
    """ "fork" when it is safe here, else "spawn".

    A forked rank starts in milliseconds with everything the parent imported (torch, DeepSpeed); a
    spawned one re-imports them (seconds). Fork is safe on Linux while the parent has no other
    threads and has not touched CUDA.
    """
    torch = sys.modules.get("torch")
    cuda_used = torch is not None and torch.cuda.is_initialized()
    safe = sys.platform == "linux" and threading.active_count() == 1 and not cuda_used
    return "fork" if safe else "spawn"


def _summary(exc: BaseException) -> str:
    """The error's first line; a user error's message alone, anything else with its type."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if isinstance(exc, UserError) and line:
        return line
    if line and collective_failure(exc) is not None:
        line = torch_error_text(exc)  # without gloo's source location and advice
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    env: dict,
    queue,
    log_path: str | None = None,
    timeout: float = 300.0,
) -> None:
    if log_path is not None:  # the parent relays it to its stderr and quotes its end if this rank dies
        _redirect_output(log_path)
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch

    from megatron_lev.parallel import session

    torch.set_num_threads(1)
    try:
        # every collective bounded by the group's own deadline; the parent watches the ranks
        session.join("gloo", rank, world_size, "127.0.0.1", port, timeout_s=max(timeout, 1.0))
        result = fn(*args, **kwargs)
        # plain pickle sends tensors by value; the multiprocessing queue would pass shared-memory
        # handles that die with this process before the parent reads them
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as exc:  # report everything, including assertion errors, to the parent
        code = exc.exit_code if isinstance(exc, UserError) else 1
        queue.put((rank, False, (_summary(exc), traceback.format_exc(), code)))
    finally:
        session.shutdown(announce=False)  # no barrier: a peer may already be gone


def _redirect_output(path: str) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to `path`."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class _Relay(threading.Thread):
    """Copies the ranks' log files to this process's stderr as they grow, whole lines at a time,
    and keeps them for `tail`."""

    def __init__(self, paths: list[Path]) -> None:
        super().__init__(name="megatron-lev-worker-logs", daemon=True)
        self.paths, self.offsets = paths, [0] * len(paths)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.05):
            self._drain(final=False)

    def _drain(self, final: bool) -> None:
        for i, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[i])
                    data = f.read()
            except OSError:
                continue
            if not final:
                data = data[: data.rfind(b"\n") + 1]  # whole lines, so ranks do not interleave mid-line
            if data:
                _write_all(2, data)
                self.offsets[i] += len(data)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
        self._drain(final=True)

    def tail(self, rank: int, lines: int = 10) -> list[str]:
        try:
            text = self.paths[rank].read_bytes()[-64 * 1024 :].decode(errors="replace")
        except OSError:
            return []
        return [line for line in text.splitlines() if line.strip()][-lines:]


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]


def describe_exit(exitcode: int | None) -> str:
    """ "was killed by SIGKILL", "exited with status 3" (multiprocessing's exit code: -N is signal N)."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with status {exitcode}"


def _silent_deaths(procs, results: dict, failures: dict) -> list[int]:
    """Ranks that ended with a non-zero status without reporting (killed, a crash in C++)."""
    return [
        i
        for i, p in enumerate(procs)
        if i not in results and i not in failures and not p.is_alive() and p.exitcode not in (0, None)
    ]


def _raise_death(procs, dead: list[int], relay: _Relay, world_size: int, failures: dict) -> None:
    first, rest = dead[0], dead[1:]
    also = "".join(f"; rank {r} {describe_exit(procs[r].exitcode)}" for r in rest)
    if failures:
        then = ", ".join(f"rank {r}: {summary}" for r, (summary, _, _) in failures.items())
        also += f"; then {then}"
    relay.stop()
    _show_tails(relay, dead, world_size)
    raise WorkerError(
        f"rank {first} of {world_size} {describe_exit(procs[first].exitcode)} without reporting "
        f"(the out-of-memory killer, a kill, or a crash in C++){also}; its last lines are above",
        first,
    )


def _show_tails(relay: _Relay, ranks: list[int], world_size: int) -> None:
    """Print the last lines of each rank's log to stderr, under a header naming it."""
    for r in ranks:
        lines = relay.tail(r)
        body = "".join(f"[rank {r}] {line}\n" for line in lines) if lines else f"[rank {r}] (no output)\n"
        _write_all(2, f"---- the last lines of rank {r} of {world_size} ----\n{body}".encode())


def run_workers(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks on this machine's CPUs; return the
    per-rank results. `env` is added to each rank's environment (after `CPU_ENV`)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method or default_start_method())
    queue = ctx.SimpleQueue()
    port = find_free_port()
    rank_env = {**CPU_ENV, **(env or {})}
    log_dir = Path(tempfile.mkdtemp(prefix="megatron-lev-ranks-"))
    logs = [log_dir / f"rank{r}.log" for r in range(world_size)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, kwargs or {}, rank_env, queue, str(logs[r]), timeout),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for stream in (sys.stdout, sys.stderr):  # a forked rank would print what the buffers hold again
        with contextlib.suppress(Exception):
            stream.flush()
    for p in procs:
        p.start()
    relay = _Relay(logs)
    relay.start()  # after the forks: a forked rank gets no copy of this thread
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    # rank -> (summary, traceback, exit code), in order of arrival: the first is the cause
    failures: dict[int, tuple[str, str, int]] = {}
    try:
        while len(results) + len(failures) < world_size:
            if not queue.empty():
                rank, ok, payload = queue.get()
                (results if ok else failures)[rank] = payload
                if failures:
                    # give the other ranks a moment to report, then stop
                    time.sleep(0.5)
                    while not queue.empty():
                        rank, ok, payload = queue.get()
                        (results if ok else failures)[rank] = payload
                    break
                continue
            dead = _silent_deaths(procs, results, failures)
            if dead and queue.empty():
                time.sleep(0.2)
                if queue.empty():
                    _raise_death(procs, dead, relay, world_size, failures)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                relay.stop()
                _show_tails(relay, missing, world_size)
                raise WorkerError(
                    f"timed out after {timeout:.0f}s waiting for rank(s) {missing} of {world_size} "
                    "(their last lines are above)"
                )
            time.sleep(0.02)
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        relay.stop()
        if not failures:
            shutil.rmtree(log_dir, ignore_errors=True)
    try:
        if failures:
            # a rank that died without a word is the cause of its peers' broken collectives
            dead = _silent_deaths(procs, results, failures)
            if dead:
                _raise_death(procs, dead, relay, world_size, failures)
            rank = next(iter(failures))
            summary, trace, code = failures[rank]
            others = tuple(r for r in failures if r != rank)
            also = f" (then rank(s) {list(others)} failed too)" if others else ""
            error = WorkerError(f"rank {rank} of {world_size} failed{also}: {summary}", rank, trace, others)
            error.exit_code = code
            raise error from _RemoteTraceback(trace)
        return [pickle.loads(results[r]) for r in range(world_size)]
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


__all__ = ["CPU_ENV", "WorkerError", "default_start_method", "describe_exit", "find_free_port", "run_workers"]
