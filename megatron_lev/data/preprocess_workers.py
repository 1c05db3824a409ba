"""Preprocessing's worker processes: each takes one chunk at a time over its own pipe, tokenises it
(`preprocess_chunk.tokenize_chunk`) and sends the result back; the pool hands results to the writer
in input order. Workers ignore Ctrl-C and die with the main process (PR_SET_PDEATHSIG on Linux, and
a thread watching the parent pid everywhere)."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

from megatron_lev.data.preprocess_chunk import PreprocessError, PreprocessOptions, tokenize_chunk
from megatron_lev.data.tokenizers import build_tokenizer


def _die_with_parent(parent_pid: int) -> None:
    """End this worker when the main process ends, however it ends (SIGKILL included)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# A test aid, None in production: `hook(chunk_id)` runs in every worker before it tokenises a
# chunk (the reliability tests make a worker raise, exit or stall there). The workers are spawned,
# so it must pickle: a module-level function, or an instance of a module-level class.
_chunk_hook: Callable[[int], None] | None = None


def set_chunk_hook(hook: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """Give the workers of later runs `hook` (None: none); returns the previous hook."""
    global _chunk_hook
    previous, _chunk_hook = _chunk_hook, hook
    return previous


def _worker_main(
    conn, opts: PreprocessOptions, parent_pid: int, chunk_hook: Callable[[int], None] | None = None
) -> None:
    """Take chunks from `conn` one at a time and send back ("ok", result) or ("error", ...)."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core per worker; the pool gives parallelism
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tok = build_tokenizer(opts.tokenizer_type, opts.tokenizer_path)
        while (chunk := conn.recv()) is not None:
            if chunk_hook is not None:
                chunk_hook(chunk.chunk_id)
            conn.send(("ok", tokenize_chunk(chunk, opts, tok)))
    except (EOFError, BrokenPipeError):
        return
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class _RemoteTraceback(Exception):
    def __str__(self) -> str:
        return self.args[0]


class WorkerPool:
    """Worker processes that take one chunk at a time over their own pipe and die with the parent."""

    def __init__(self, opts: PreprocessOptions):
        ctx = mp.get_context("spawn")
        self.workers = []  # [process, connection, (chunk_id, file, first_line) or None]
        # An ignored SIGINT stays ignored across exec: the workers start with Ctrl-C ignored, so one
        # that lands while they still import (before `_worker_main` runs) is the main process's alone
        # and prints no worker traceback.
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            for _ in range(opts.workers):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, args=(theirs, opts, os.getpid(), _chunk_hook), daemon=True
                )
                proc.start()
                theirs.close()
                self.workers.append([proc, mine, None])
        finally:
            if previous is not None:  # None: not the main thread, or a handler not set from Python
                signal.signal(signal.SIGINT, previous)

    def run(self, chunks, sink, window: int) -> None:
        """Feed `chunks` to idle workers (at most `window` ahead of the writer) and pass the
        results to `sink` in input order."""
        chunks, ready, next_id, exhausted = iter(chunks), {}, 0, False
        sent = 0
        while True:
            for w in self.workers:
                if w[2] is not None or exhausted or sent - next_id >= window:
                    continue
                chunk = next(chunks, None)
                if chunk is None:
                    exhausted = True
                    break
                w[2] = (chunk.chunk_id, chunk.file, chunk.first_line)
                try:
                    w[1].send(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    self._died(w)
                sent += 1
            busy = [w for w in self.workers if w[2] is not None]
            if not busy:
                if exhausted:
                    return
                continue
            # every worker's sentinel: an idle worker that dies must stop the run too
            for obj in wait([w[1] for w in busy] + [w[0].sentinel for w in self.workers]):
                w = next(w for w in self.workers if obj in (w[1], w[0].sentinel))
                if w[2] is None:
                    if not w[0].is_alive():
                        self._died(w)
                    continue
                try:
                    msg = w[1].recv()
                except (EOFError, ConnectionResetError):
                    self._died(w)
                if msg[0] == "error":
                    raise PreprocessError(
                        f"a preprocess worker failed on {w[2][1]} (chunk from line {w[2][2]}): {msg[1]}; "
                        "fix the input or report the bug (--debug shows the worker's traceback)"
                    ) from _RemoteTraceback(msg[2])
                ready[w[2][0]] = msg[1]
                w[2] = None
            while next_id in ready:
                sink(ready.pop(next_id))
                next_id += 1

    def _died(self, w) -> None:
        w[0].join(timeout=1)
        doing = f"while tokenising {w[2][1]} from line {w[2][2]}" if w[2] else "while idle"
        raise PreprocessError(
            f"a preprocess worker died (exit code {w[0].exitcode}) {doing} (killed, or out of memory?); "
            "rerun, with fewer --workers or a smaller --chunk-mb if memory is short"
        )

    def close(self, ok: bool) -> None:
        """Stop the workers: politely after success, at once otherwise; never leave one running."""
        for proc, conn, _ in self.workers:
            if ok and proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send(None)
        deadline = time.monotonic() + (10 if ok else 0)
        for proc, conn, _ in self.workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
            conn.close()
