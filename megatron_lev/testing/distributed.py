"""Run a function in N CPU processes joined by a gloo process group.

    results = run_distributed(fn, world_size=2, args=(x,))

`fn(*args)` runs on every rank after `torch.distributed` is initialised (gloo,
a free port on 127.0.0.1) and its return values come back as a list indexed by
rank. A failing rank's traceback is re-raised in the parent; a hung group is
killed after `timeout` seconds. Ranks are forked when that is safe (`start_method`), else
spawned; `fn` must be importable (module level) for the spawned case.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any


class DistributedTestError(RuntimeError):
    """A rank raised, died, or the group timed out."""


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return s.getsockname()[1]


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
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a peer may already be gone
                dist.destroy_process_group()


START_METHOD_ENV = "MEGATRON_LEV_TEST_START_METHOD"  # "fork" or "spawn"; default: fork when safe


def start_method() -> str:
    """ "fork" when it is safe here, else "spawn".

    A forked rank starts in milliseconds with everything the parent imported (torch, DeepSpeed, the
    test module); a spawned one re-imports them (seconds). Fork is safe on Linux while the parent
    has no other threads and has not touched CUDA; `MEGATRON_LEV_TEST_START_METHOD` overrides.
    """
    import sys
    import threading

    import torch

    chosen = os.environ.get(START_METHOD_ENV, "").strip()
    if chosen in ("fork", "spawn"):
        return chosen
    safe = sys.platform == "linux" and threading.active_count() == 1 and not torch.cuda.is_initialized()
    return "fork" if safe else "spawn"


def run_distributed(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method())
    queue = ctx.SimpleQueue()
    port = find_free_port()
    base_env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    base_env.update(env or {})
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, kwargs or {}, base_env, queue), daemon=False
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}  # insertion order = order of arrival: the first is the root cause
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
                    raise DistributedTestError(
                        f"rank(s) {dead} died with exit code(s) {[procs[i].exitcode for i in dead]} "
                        "without reporting (killed, out of memory, or a crash in C++)"
                    )
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(results) - set(failures))
                raise DistributedTestError(f"timed out after {timeout:.0f}s waiting for rank(s) {missing}")
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
        others = [r for r in failures if r != rank]
        also = f" (then rank(s) {others} failed too)" if others else ""
        raise DistributedTestError(f"rank {rank} of {world_size} failed first{also}:\n{failures[rank]}")
    return [pickle.loads(results[r]) for r in range(world_size)]
