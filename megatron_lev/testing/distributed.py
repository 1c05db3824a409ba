"""Run a function in N CPU processes joined by a gloo process group, for tests.

    results = run_distributed(fn, world_size=2, args=(x,))

`parallel.local_workers.run_workers` with a test's report: a failing rank's whole traceback comes back
in `DistributedTestError`, and `MEGATRON_LEV_TEST_START_METHOD` may choose how ranks start.
`fn(*args)` runs on every rank after `torch.distributed` is initialised (gloo, a free port on
127.0.0.1) and its return values come back as a list indexed by rank; a hung group is killed
after `timeout` seconds. Ranks are forked when that is safe (`start_method`), else spawned; `fn`
must be importable (module level) for the spawned case.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from megatron_lev.parallel.local_workers import WorkerError, default_start_method, find_free_port, run_workers


class DistributedTestError(RuntimeError):
    """A rank raised, died, or the group timed out."""


START_METHOD_ENV = "MEGATRON_LEV_TEST_START_METHOD"  # "fork" or "spawn"; default: fork when safe


def start_method() -> str:
    """ "fork" when it is safe here, else "spawn" (`parallel.local_workers.default_start_method`);
    `MEGATRON_LEV_TEST_START_METHOD` overrides."""
    chosen = os.environ.get(START_METHOD_ENV, "").strip()
    if chosen in ("fork", "spawn"):
        return chosen
    import torch  # noqa: F401 - the choice looks at torch's CUDA state

    return default_start_method()


def run_distributed(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results.

    The rendezvous port is one the system called free a moment before the ranks bind it, and another
    process of the test session can take it in between: rank 0 then fails to bind it (EADDRINUSE),
    and a peer may fail to join the group (once in a full suite: gloo's mesh "closed by peer"; the
    port race is the likely cause, not a proven one). Either failure comes before `fn` runs, so the
    ranks are started once more on a new port; a second failure is reported."""
    import torch.multiprocessing  # noqa: F401 - before the start method is chosen, as run_workers does

    for attempt in range(2):
        try:
            return run_workers(
                fn, world_size, args, kwargs, timeout=timeout, env=env, start_method=start_method()
            )
        except WorkerError as exc:
            if attempt == 0 and _port_race(f"{exc} {exc.traceback or ''}"):
                continue
            _raise(exc, world_size)
    raise AssertionError("unreachable")


def _port_race(text: str) -> bool:
    """The first failure was the rendezvous: binding its port, or joining the group on it."""
    return "EADDRINUSE" in text or "could not join the process group" in text


def _raise(exc: WorkerError, world_size: int) -> None:
    """The one-paragraph failure of a distributed test from the launcher's error."""
    if not exc.traceback:  # died without a word, or timed out
        raise DistributedTestError(str(exc)) from None
    also = f" (then rank(s) {list(exc.others)} failed too)" if exc.others else ""
    raise DistributedTestError(
        f"rank {exc.rank} of {world_size} failed first{also}:\n{exc.traceback}"
    ) from None


__all__ = ["DistributedTestError", "find_free_port", "run_distributed", "start_method"]
