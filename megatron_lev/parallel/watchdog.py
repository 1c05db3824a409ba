"""The heartbeat watchdog: a rank that stops answering ends the job with one line naming it.

A collective waits for every rank of its group; a rank that is stopped (SIGSTOP, a frozen
cgroup), hung, or whose host left the network leaves its peers waiting until the collective's
timeout, and that timeout names no rank. The watchdog watches from outside the collectives:

- every rank adds 1 to its counter `megatron_lev/heartbeat/<restart>/hb/<rank>` in the
  rendezvous store every `interval` seconds (a thread of its own, with its own store client);
- every rank reads the counter of its successor `(rank + 1) % world` (a ring: each rank is
  watched by exactly one other, so the store sees O(world) requests per interval);
- a counter unchanged for `timeout` seconds (measured on the watcher's monotonic clock, so
  the hosts' clocks need not agree) means that rank is silent: the watcher writes one line
  naming it under the `abort` key and ends its own process; every other rank reads `abort`
  at its next beat and ends too, printing the same line;
- a store that does not answer for `timeout` seconds (its host, rank 0 without torchrun, is
  itself stopped) ends every rank with a line naming the store's host. The store's requests
  have no timeout of their own, so a second thread (the judge) decides; the beating thread
  may stay blocked in the request, which does not matter once the process ends.

Each rank also says what it is doing (`set_phase`: "training step 120", "saving checkpoint
iter_0000100"): the beating thread writes a changed phase to `phase/<rank>` with the beat count at
which it began, so a peer can tell how long a rank has been in it in beats, whatever the hosts'
clocks. When a collective times out and no rank failed or went silent, `diagnose()` names the ranks
that are alive but still in another phase: a slow rank, not a dead one.

A rank that leaves cleanly (`stop()`) marks `done/<rank>` first, so its watcher does not take
its end for silence. A rank that fails leaves its one-line error under `first_error` unless
another rank was first (`report_error`), so a peer whose collective broke can say which rank
failed first; `diagnose()` also finds a rank whose counter stopped (a dead peer) within about
1.5 intervals.

The longest a frozen rank can keep the others waiting is `timeout + 1.5 * interval` (the last
beat, the judge's tick, the abort key read at the next beat); `interval` is a tenth of the
timeout, between 0.2 and 5 seconds. The thread beats while the main thread computes, waits
in a collective or writes a checkpoint: only a process that cannot run Python at all (stopped,
or a C call that holds the GIL for minutes) goes silent.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

PREFIX = "megatron_lev/heartbeat"


def beat_interval(timeout: float) -> float:
    """Seconds between beats for a watchdog of `timeout` seconds."""
    return min(5.0, max(0.2, timeout / 10.0))


class Heartbeat:
    """The watchdog of one rank (see the module docstring); `start()` it after joining the group.

    `on_abort(message)` is called once, from a watchdog thread, with the one-line reason; the
    default writes it to stderr and ends the process at once (`os._exit(1)`): the main thread
    is blocked in a collective and cannot be unwound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        store_owner: str = "rank 0",
        on_abort: Callable[[str], None] | None = None,
        namespace: str | None = None,
    ) -> None:
        if world_size < 2:
            raise ValueError("a heartbeat needs at least two ranks")
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.timeout, self.interval = float(timeout), beat_interval(float(timeout))
        self.peer = (rank + 1) % world_size
        self.store_owner = store_owner
        self.on_abort = on_abort or _default_abort
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"{PREFIX}/{namespace or restart}"
        self._store = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        now = time.monotonic()
        self._last_ok = now  # the last request the store answered
        self._peer_count = -1
        self._peer_seen = now  # when the successor's counter last changed
        self._peer_done = False
        self._store_abort: str | None = None  # a line another rank published
        self._publish: str | None = None  # a line this rank wants published
        self._published = threading.Event()
        self._aborted = False
        self._phase: str | None = None  # what the main thread is doing (set_phase)
        self._phase_sent: str | None = None
        self._count = 0  # this rank's own beat count, as the store returned it

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Heartbeat:
        import torch.distributed as dist

        # a client of its own: the process group's store object is busy with the group's requests
        self._store = dist.TCPStore(
            self.host,
            self.port,
            is_master=False,
            timeout=timedelta(seconds=max(self.timeout, 1.0)),
            wait_for_workers=False,
        )
        self._store.add(self._key("hb", self.rank), 1)
        for name, target in (("beat", self._beat_loop), ("judge", self._judge_loop)):
            t = threading.Thread(target=target, name=f"megatron-lev-heartbeat-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop both threads and mark this rank done, so its watcher does not take the end of
        its beats for silence. Returns within about two intervals even if the store is stuck."""
        if self._store is None:
            return
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2 * self.interval + 1.0)
        self._threads = [t for t in self._threads if t.is_alive()]
        if not self._threads:  # the client is free (a beat stuck in a request keeps it busy)
            with contextlib.suppress(Exception):  # the store may be gone: rank 0 finished first
                self._store.set(self._key("done", self.rank), "1")
            self._store = None

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------------ the two threads

    def _beat_loop(self) -> None:
        store = self._store
        while not self._stop.wait(self.interval):
            try:
                self._count = store.add(self._key("hb", self.rank), 1)
                phase = self._phase
                if phase is not None and phase != self._phase_sent:
                    store.set(self._key("phase", self.rank), f"{self._count}|{phase}")
                    self._phase_sent = phase
                count = store.add(self._key("hb", self.peer), 0)
                done = store.check([self._key("done", self.peer)])
                abort = None
                if store.check([self._key("abort")]):
                    abort = store.get(self._key("abort")).decode(errors="replace")
                publish = self._publish
                if publish is not None and abort is None:
                    store.set(self._key("abort"), publish)
            except Exception:  # noqa: BLE001 - unreachable store: the judge decides after `timeout`
                continue
            now = time.monotonic()
            with self._lock:
                self._last_ok = now
                if count != self._peer_count:
                    self._peer_count, self._peer_seen = count, now
                self._peer_done = self._peer_done or done
                if abort is not None and self._store_abort is None:
                    self._store_abort = abort
            if publish is not None:
                self._published.set()
            if abort is not None and publish is None:
                self._abort(abort)

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval / 2):
            now = time.monotonic()
            with self._lock:
                store_quiet = now - self._last_ok
                peer_quiet = 0.0 if self._peer_done else now - self._peer_seen
            if store_quiet > self.timeout:
                where = f"{self.host}:{self.port}"
                self._abort(
                    f"the rendezvous store at {where} ({self.store_owner}) did not answer for "
                    f"{store_quiet:.0f} s: {self.store_owner} is stopped, hung, or its host is unreachable "
                    f"(seen by rank {self.rank}; parallel.heartbeat_timeout_s={self.timeout:g})"
                )
            elif peer_quiet > self.timeout:
                line = (
                    f"rank {self.peer} did not answer for {peer_quiet:.0f} s: no heartbeat, so the process "
                    f"is stopped, hung, or its host is unreachable (seen by rank {self.rank}; "
                    f"parallel.heartbeat_timeout_s={self.timeout:g})"
                )
                self._publish = line  # the beat thread tells the other ranks
                self._published.wait(2 * self.interval + 1.0)
                self._abort(line)

    def _abort(self, line: str) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
        self._stop.set()
        self.on_abort(line)

    # ------------------------------------------------------------------ asked by the main thread

    def set_phase(self, phase: str) -> None:
        """What this rank is doing now (one short phrase); published at the next beat. Costs the main
        thread one assignment."""
        self._phase = phase

    def phases(self, client=None) -> dict[int, tuple[str, float]]:
        """rank -> (its phase, seconds it has been in it, from beat counts) for the ranks that
        published one (a failure path: one request for every rank)."""
        client = client or self._client()
        counts = self._counts(client)
        keys = [self._key("phase", r) for r in range(self.world_size)]
        try:
            values = client.multi_get(keys) if all(client.check([k]) for k in keys) else None
        except Exception:  # noqa: BLE001 - an older store
            values = None
        out = {}
        for r, key in enumerate(keys):
            raw = values[r] if values is not None else (client.get(key) if client.check([key]) else None)
            if raw is None:
                continue
            start, _, phase = raw.decode(errors="replace").partition("|")
            beats = counts[r] - int(start) if start.isdigit() else 0
            out[r] = (phase, max(beats, 0) * self.interval)
        return out

    def slow_ranks(self, client=None) -> str | None:
        """The ranks alive but in another phase than this one (a phrase), or None."""
        phases = self.phases(client)
        mine = phases.get(self.rank, (self._phase or "", 0.0))[0]
        other = [(r, p, t) for r, (p, t) in sorted(phases.items()) if r != self.rank and p != mine]
        if not other:
            return None
        r, phase, took = other[0]
        more = (
            f" (and rank(s) {[o[0] for o in other[1:4]]}{', ...' if len(other) > 4 else ''})"
            if len(other) > 1
            else ""
        )
        return (
            f"rank {r}{more} is alive (it beats) but still in '{phase}' for about {took:.0f} s, while rank "
            f"{self.rank} is in '{mine}': a slow rank, not a dead one; see what slows it (its file system, "
            "its data), or raise parallel.collective_timeout_s if that much is expected"
        )

    def report_error(self, line: str, wait: float | None = None) -> None:
        """Leave this rank's one-line error for the others (best effort, bounded by `wait`): the
        first rank to report is the one every peer names."""
        if self._store is None:
            return
        done = threading.Event()
        first = f"rank {self.rank} failed first: {line[:2000]}"

        def put() -> None:
            with contextlib.suppress(Exception):
                self._client().compare_set(self._key("first_error"), "", first)
            done.set()

        threading.Thread(target=put, daemon=True, name="megatron-lev-heartbeat-report").start()
        done.wait(self.interval if wait is None else wait)

    def diagnose(self, wait: float | None = None) -> str | None:
        """After a collective failed here: which rank is to blame, as a phrase, or None.

        Looks for up to `wait` seconds (default three intervals): a rank's reported error (the
        first one), a published abort, or a rank whose counter stood still for 1.5 intervals
        while this rank watched all of them (a live rank beats every interval, also while its
        main thread fails). When every rank beat through those 1.5 intervals, a rank alive in
        another phase is named at once: as it is then, or as it was when this diagnosis began (a
        slow rank that caught up just after the timeout is still the one that made it)."""
        if self._store is None:
            return None
        wait = 3 * self.interval if wait is None else wait
        result: list[str] = []

        def look() -> None:
            deadline = time.monotonic() + wait
            with contextlib.suppress(Exception):
                client = self._client()
                base, start = self._counts(client), time.monotonic()
                slow_at_start = self.slow_ranks(client)  # the phases when the collective failed
                while True:
                    for key in (self._key("first_error"), self._key("abort")):
                        if client.check([key]):
                            result.append(client.get(key).decode(errors="replace"))
                            return
                    quiet = time.monotonic() - start
                    if quiet > 1.5 * self.interval:
                        now = self._counts(client)
                        silent = [
                            r
                            for r in range(self.world_size)
                            if r != self.rank
                            and now[r] == base[r]
                            and not client.check([self._key("done", r)])
                        ]
                        if silent:
                            more = f" (and rank(s) {silent[1:]})" if len(silent) > 1 else ""
                            result.append(
                                f"rank {silent[0]}{more} stopped answering (no heartbeat for {quiet:.0f} s): "
                                "it died, was killed or is stopped"
                            )
                            return
                        slow = self.slow_ranks(client) or slow_at_start
                        if slow:  # every rank beats, one is elsewhere: no need to wait longer
                            result.append(slow)
                            return
                        base, start = now, time.monotonic()
                    if time.monotonic() > deadline:
                        slow = self.slow_ranks(client) or slow_at_start
                        if slow:
                            result.append(slow)
                        return
                    time.sleep(min(0.2, self.interval / 2))

        t = threading.Thread(target=look, daemon=True, name="megatron-lev-heartbeat-diagnose")
        t.start()
        t.join(wait + self.interval + 1.0)
        return result[0] if result else None

    def _counts(self, client) -> list[int]:
        """Every rank's counter, in one request when the store allows it."""
        keys = [self._key("hb", r) for r in range(self.world_size)]
        try:
            return [int(v) for v in client.multi_get(keys)]
        except Exception:  # noqa: BLE001 - an older store, or a rank that never beat: one by one
            return [client.add(k, 0) for k in keys]

    def _client(self):
        """A fresh client: the beat thread's may be blocked in a request."""
        import torch.distributed as dist

        return dist.TCPStore(
            self.host,
            self.port,
            is_master=False,
            timeout=timedelta(seconds=max(self.interval, 1.0)),
            wait_for_workers=False,
        )


def _default_abort(line: str) -> None:
    import sys

    with contextlib.suppress(Exception):
        os.write(2, f"megatron-lev: error: {line}\n".encode())
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


__all__ = ["PREFIX", "Heartbeat", "beat_interval"]
