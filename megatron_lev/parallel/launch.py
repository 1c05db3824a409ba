"""Run a function on N local CPU processes joined by a gloo process group (offline tools: `reshard`).

    results = run_workers(fn, world_size=4, args=(x,))

`fn(*args, **kwargs)` runs on every rank after `torch.distributed` is initialised (gloo, a free
port on 127.0.0.1); its return values come back as a list indexed by rank. A rank that raises
or dies, or a group that hangs past `timeout` seconds, stops every rank and raises `WorkerError`:
a `UserError` whose message is one line naming the rank that failed first and its error's first
line. The rank's traceback travels as the error's cause (`--debug` shows it) and as `.traceback`.

Ranks are forked when that is safe (`default_start_method`), else spawned; `fn` must be
importable (module level) for the spawned case.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from megatron_lev.errors import UserError

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
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict, env: dict, queue
) -> None:
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
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}"
        )
        result = fn(*args, **kwargs)
        # plain pickle sends tensors by value; the multiprocessing queue would pass shared-memory
        # handles that die with this process before the parent reads them
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as exc:  # report everything, including assertion errors, to the parent
        code = exc.exit_code if isinstance(exc, UserError) else 1
        queue.put((rank, False, (_summary(exc), traceback.format_exc(), code)))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer may already be gone
                dist.destroy_process_group()


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
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, kwargs or {}, rank_env, queue), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
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
            dead = [
                i
                for i, p in enumerate(procs)
                if not p.is_alive() and p.exitcode not in (0, None) and i not in results
            ]
            if dead and queue.empty():
                time.sleep(0.2)
                if queue.empty():
                    raise WorkerError(
                        f"rank(s) {dead} of {world_size} died with exit code(s) "
                        f"{[procs[i].exitcode for i in dead]} without reporting (killed, out of memory, "
                        "or a crash in C++)"
                    )
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                raise WorkerError(
                    f"timed out after {timeout:.0f}s waiting for rank(s) {missing} of {world_size}"
                )
            time.sleep(0.02)
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        rank = next(iter(failures))
        summary, trace, code = failures[rank]
        others = tuple(r for r in failures if r != rank)
        also = f" (then rank(s) {list(others)} failed too)" if others else ""
        error = WorkerError(f"rank {rank} of {world_size} failed{also}: {summary}", rank, trace, others)
        error.exit_code = code
        raise error from _RemoteTraceback(trace)
    return [pickle.loads(results[r]) for r in range(world_size)]


__all__ = ["CPU_ENV", "WorkerError", "default_start_method", "find_free_port", "run_workers"]
