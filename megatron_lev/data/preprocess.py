"""Text to MMIDIDX shards: workers parse and tokenise, the main process writes, in input order.

The main process splits the input into chunks of raw lines and hands each to an idle
worker over that worker's own pipe (no queue, no feeder thread); workers parse,
tokenise, append EOD and send the token arrays back. The main process writes them in
input order into the outputs (one per Pile subset if asked, cut into shards by size),
so the output is the same bytes for any number of workers, and memory is bounded by
a window of chunks in flight. Workers ignore Ctrl-C and die with the main process
(PR_SET_PDEATHSIG on Linux, and a thread watching the parent pid everywhere).

The whole output set is one unit: it is written into a hidden staging directory beside
the outputs, moved into place, and `<prefix>.manifest.json` (see `manifest.py`) is
written last. An earlier set at the same prefix stays intact until then, and its files
that the new set does not have are removed after.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

import numpy as np

from megatron_lev.data.indexed import IndexedDatasetBuilder, best_dtype
from megatron_lev.data.manifest import SET_FILES, SHARD_FILES, read_manifest, write_manifest
from megatron_lev.data.manifest import SUFFIX as MANIFEST_SUFFIX
from megatron_lev.data.readers import Chunk, Problem, check_text, find_inputs, iter_chunks, parse_line
from megatron_lev.data.tokenizers import PIECE_CHARS, build_tokenizer, tokenizer_fingerprint
from megatron_lev.errors import DataError, UserError
from megatron_lev.utils.io import (
    TEMP_MARK,
    atomic_open,
    atomic_write_json,
    raise_if_disk_full,
    remove_stale_temps,
    temp_tag,
)
from megatron_lev.utils.lock import exclusive_lock

UNKNOWN_SUBSET = "unknown"
FILE_PROBLEMS = ("truncated_file",)  # problems of a whole file, not of one line


class PreprocessError(DataError):
    """The input, a flag or a worker made preprocessing fail; nothing was written."""


class FlagError(UserError):
    """A preprocess flag has a value out of range."""

    exit_code = 2


@dataclass
class PreprocessOptions:
    inputs: list[str]
    output_prefix: str
    tokenizer_type: str
    tokenizer_path: str
    json_key: str = "text"
    workers: int = 1
    split_by_subset: bool = False  # one output per meta.pile_set_name
    shard_size_mb: float | None = None  # split each output into shards of about this size
    chunk_bytes: int = 1 << 20  # input bytes per work item
    progress: bool = True
    max_error_records: int = 1000  # problems listed by file and line in the stats (all are counted)
    max_bad_fraction: float = 1.0  # fail when more than this fraction of lines is bad (always when all are)
    piece_chars: int = PIECE_CHARS  # longer documents are tokenised in pieces (bounded memory)


def check_options(opts: PreprocessOptions) -> None:
    """Refuse flag values out of range before any work, naming the flag."""
    if not isinstance(opts.workers, int) or opts.workers < 1:
        raise FlagError(f"--workers must be an integer >= 1, got {opts.workers}")
    if opts.shard_size_mb is not None and not (np.isfinite(opts.shard_size_mb) and opts.shard_size_mb > 0):
        raise FlagError(f"--shard-size-mb must be a positive number of MB, got {opts.shard_size_mb}")
    if not opts.chunk_bytes or opts.chunk_bytes < 1:
        raise FlagError(f"--chunk-mb must be positive, got {opts.chunk_bytes} bytes")
    if not 0.0 <= opts.max_bad_fraction <= 1.0:
        raise FlagError(f"--max-bad-fraction must be in [0, 1], got {opts.max_bad_fraction}")
    if not opts.json_key:
        raise FlagError("--json-key must not be empty")
    name = Path(opts.output_prefix).name
    if not name or name in (".", "..") or str(opts.output_prefix).endswith(os.sep):
        raise FlagError(
            f"--output-prefix {opts.output_prefix!r} must end in a file name prefix, e.g. data/pile"
        )
    if Path(opts.output_prefix).is_dir():
        raise FlagError(
            f"--output-prefix {opts.output_prefix} is a directory; give a prefix inside it, "
            f"e.g. {Path(opts.output_prefix) / 'text_document'}"
        )


def subset_slug(subset: str) -> str:
    """A subset name as it may appear in a file name: no path separators, control or glob
    characters; a name that had to change gets a short hash, so two never collide."""
    safe = "".join(c if c.isprintable() and c not in "/\\*?[]" else "_" for c in subset)[:80]
    if safe != subset or not safe:
        safe = f"{safe}-{hashlib.sha256(subset.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"
    return safe


@dataclass
class ChunkResult:
    chunk_id: int
    groups: list = field(default_factory=list)  # (output key, flat tokens, sizes) in document order
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    subsets: dict = field(default_factory=dict)  # subset -> [documents, tokens]
    problems: list = field(default_factory=list)


def tokenize_chunk(chunk: Chunk, opts: PreprocessOptions, tok) -> ChunkResult:
    """Parse and tokenise one chunk; bad lines become problems."""
    res = ChunkResult(chunk.chunk_id)
    texts, subsets = [], []
    for i, item in enumerate(chunk.lines):
        if chunk.records:
            (text, subset), err = item, check_text(item[0])
        else:
            text, subset, err = parse_line(item, opts.json_key)
            err = err or check_text(text)
        if err:
            kind, _, msg = err.partition(": ")
            res.problems.append(Problem(chunk.file, chunk.first_line + i, kind, msg))
            continue
        texts.append(text)
        subsets.append(subset if isinstance(subset, str) and subset else UNKNOWN_SUBSET)
        res.text_bytes += len(text)
    if not texts:
        return res
    # a huge document is encoded in pieces (the same ids: `Tokenizer.encode_long`), the others together
    long = {j for j, t in enumerate(texts) if len(t) > opts.piece_chars}
    batch = iter(
        tok.encode_batch([t for j, t in enumerate(texts) if j not in long]) if len(long) < len(texts) else []
    )
    ids = [tok.encode_long(t, opts.piece_chars) if j in long else next(batch) for j, t in enumerate(texts)]
    dtype = best_dtype(tok.vocab_size)
    groups: dict[str, list[int]] = {}
    for j, s in enumerate(subsets):
        ids[j].append(tok.eod)
        groups.setdefault(subset_slug(s) if opts.split_by_subset else "", []).append(j)
        entry = res.subsets.setdefault(s, [0, 0])
        entry[0] += 1
        entry[1] += len(ids[j])
    for key, members in groups.items():
        arrays = [np.asarray(ids[j], dtype=np.int64) for j in members]
        sizes = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
        res.groups.append((key, np.concatenate(arrays).astype(dtype), sizes))
    res.documents = len(texts)
    res.tokens = sum(len(x) for x in ids)
    return res


# --------------------------------------------------------------------------- workers


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


class _Pool:
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


# --------------------------------------------------------------------------- writing


class _Outputs:
    """The output shards in the staging directory: one stream per subset key, cut by size."""

    def __init__(self, opts: PreprocessOptions, staging: Path, vocab_size: int):
        self.opts, self.staging = opts, staging
        self.name = Path(opts.output_prefix).name
        self.dtype = best_dtype(vocab_size)
        self.limit = int(opts.shard_size_mb * 1e6) if opts.shard_size_mb else None
        self.builders: dict[str, IndexedDatasetBuilder] = {}
        self.shard_no: dict[str, int] = {}
        self.done: list[IndexedDatasetBuilder] = []
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.max_token_id = 0

    def base(self, key: str) -> str:
        return f"{self.name}_{key}" if key else self.name

    def _open(self, key: str) -> IndexedDatasetBuilder:
        n = self.shard_no.get(key, 0)
        self.shard_no[key] = n + 1
        name = f"{self.base(key)}_{n:05d}" if self.limit else self.base(key)
        self.builders[key] = IndexedDatasetBuilder(self.staging / name, self.dtype)
        return self.builders[key]

    def add(self, res: ChunkResult) -> None:
        for key, flat, sizes in res.groups:
            self.counts += np.bincount(flat, minlength=len(self.counts))[: len(self.counts)]
            self.max_token_id = max(self.max_token_id, int(flat.max()))
            builder = self.builders.get(key) or self._open(key)
            offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
            i, item = 0, self.dtype.itemsize
            while i < len(sizes):
                take = len(sizes) - i
                if self.limit is not None:
                    nbytes = (offsets[i + 1 :] - offsets[i]) * item
                    take = int(np.searchsorted(nbytes, self.limit - builder.num_bytes, side="right"))
                    if take == 0 and builder.num_sequences:  # full: start the next shard
                        builder.finalize()
                        self.done.append(builder)
                        builder = self._open(key)
                        continue
                    take = max(take, 1)  # one document larger than a shard gets a shard of its own
                builder.add_raw(flat[offsets[i] : offsets[i + take]].tobytes(), sizes[i : i + take])
                i += take

    def bases(self) -> set[str]:
        """The output names before any shard number: the prefix, or prefix_<subset> per subset."""
        return {self.base(k) for k in self.shard_no} | {self.name}

    def finish(self) -> list[IndexedDatasetBuilder]:
        for key in sorted(self.builders):
            self.builders[key].finalize()
            self.done.append(self.builders[key])
        self.builders = {}
        return sorted(self.done, key=lambda b: b.prefix)

    def abort(self) -> None:
        for b in self.builders.values():
            b.abort()


class _Progress:
    """Counts and a progress bar (plain lines off a terminal) with docs/s, MB/s and tokens/s."""

    def __init__(self, enabled: bool):
        from megatron_lev.utils.progress import progress_bar

        self.bar = progress_bar(
            desc="preprocess", unit=" docs", disable=not enabled, smoothing=0.1, dynamic_ncols=True
        )
        self.start = time.monotonic()
        self.docs = self.tokens = self.bytes = 0

    def update(self, res: ChunkResult) -> None:
        self.docs += res.documents
        self.tokens += res.tokens
        self.bytes += res.text_bytes
        dt = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"{self.bytes / dt / 1e6:.1f} MB/s, {self.tokens / dt / 1e3:.0f}k tok/s", refresh=False
        )
        self.bar.update(res.documents)


class _Tally:
    """Documents, tokens, subsets and problems over all chunks (problems kept up to a limit)."""

    def __init__(self, limit: int):
        self.limit, self.documents, self.tokens, self.text_bytes = limit, 0, 0, 0
        self.subsets: dict[str, dict] = {}
        self.errors: dict[str, int] = {}
        self.problems: list[Problem] = []

    def add_problems(self, problems: list[Problem]) -> None:
        for p in problems:
            self.errors[p.kind] = self.errors.get(p.kind, 0) + 1
            if len(self.problems) < self.limit:
                self.problems.append(p)

    def add(self, res: ChunkResult) -> None:
        self.documents += res.documents
        self.tokens += res.tokens
        self.text_bytes += res.text_bytes
        for s, (d, t) in res.subsets.items():
            e = self.subsets.setdefault(s, {"documents": 0, "tokens": 0})
            e["documents"] += d
            e["tokens"] += t
        self.add_problems(res.problems)

    @property
    def bad_lines(self) -> int:
        return sum(n for k, n in self.errors.items() if k not in FILE_PROBLEMS)


# --------------------------------------------------------------------------- the pipeline


def preprocess(opts: PreprocessOptions) -> dict:
    """Run the whole pipeline; returns the statistics also written to `<prefix>.stats.json`."""
    check_options(opts)
    files = find_inputs(opts.inputs)
    tok = build_tokenizer(opts.tokenizer_type, opts.tokenizer_path)
    fingerprint = tokenizer_fingerprint(opts.tokenizer_type, opts.tokenizer_path, tok)
    out_prefix = Path(opts.output_prefix)
    out_dir = out_prefix.parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise_if_disk_full(exc, out_dir)
        raise PreprocessError(
            f"--output-prefix {out_prefix}: cannot create the directory {out_dir} "
            f"({exc.strerror}); choose a writable place"
        ) from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise PreprocessError(
            f"--output-prefix {out_prefix}: the directory {out_dir} is not writable; "
            "choose another place or fix its permissions"
        )
    # one writer per prefix: a second run into it would replace this one's output when it commits
    lock = lock_path(out_prefix)
    with exclusive_lock(lock, f"--output-prefix {out_prefix}", "megatron-lev preprocess"):
        return _preprocess(opts, files, tok, fingerprint, out_prefix)


def lock_path(out_prefix: str | os.PathLike) -> Path:
    """The lock file a run into `out_prefix` holds (`utils.lock`): `.<name>.lock` beside the outputs."""
    out_prefix = Path(out_prefix)
    return out_prefix.parent / f".{out_prefix.name}.lock"


def _preprocess(opts: PreprocessOptions, files: list[str], tok, fingerprint: dict, out_prefix: Path) -> dict:
    """`preprocess` once its checks passed and it holds the prefix's lock."""
    out_dir = out_prefix.parent
    removed = clean_dead_runs(out_prefix)
    if removed:
        print(
            f"removed {len(removed)} temporary file(s) of an interrupted earlier run into {out_prefix}",
            file=sys.stderr,
        )
    staging = out_dir / f".{out_prefix.name}.staging{TEMP_MARK}{temp_tag()}"
    try:
        staging.mkdir()
    except OSError as exc:
        raise_if_disk_full(exc, out_prefix)
        raise
    progress = _Progress(opts.progress)
    tally = _Tally(opts.max_error_records)
    outputs = _Outputs(opts, staging, tok.vocab_size)
    read_problems: list[Problem] = []
    committed = False

    def sink(res: ChunkResult) -> None:
        try:
            outputs.add(res)
        except OSError as exc:
            raise_if_disk_full(exc, out_prefix)
            raise
        tally.add(res)
        progress.update(res)

    try:
        chunks = iter_chunks(files, read_problems, opts.chunk_bytes, opts.json_key)
        if opts.workers <= 1:
            for chunk in chunks:
                sink(tokenize_chunk(chunk, opts, tok))
        else:
            pool, ok = _Pool(opts), False
            try:
                pool.run(chunks, sink, window=2 * opts.workers)
                ok = True
            finally:
                pool.close(ok)
        progress.bar.close()
        tally.add_problems(read_problems)
        _warn_truncated(read_problems)
        _check_enough_documents(opts, files, tally)
        try:
            shards = outputs.finish()
            stats = _stats(
                opts,
                files,
                tok,
                tally,
                [str(out_dir / Path(b.prefix).name) for b in shards],
                time.monotonic() - progress.start,
            )
            with atomic_open(staging / f"{out_prefix.name}.counts.npy", "wb") as f:
                np.save(f, outputs.counts)
            atomic_write_json(staging / f"{out_prefix.name}.stats.json", stats)
            known = {k: v for b in shards for k, v in b.sha256.items()}
            stale = _commit(
                out_prefix, staging, shards, outputs.bases(), fingerprint, outputs.max_token_id, known, stats
            )
        except OSError as exc:
            raise_if_disk_full(exc, out_prefix)
            raise
        committed = True
        if stale:
            print(
                f"removed {len(stale)} file(s) of an earlier run into {out_prefix} that this run does not "
                f"write: {', '.join(p.name for p in stale[:4])}{' ...' if len(stale) > 4 else ''}"
            )
        return stats
    finally:
        progress.bar.close()
        if not committed:
            outputs.abort()
        shutil.rmtree(staging, ignore_errors=True)


def clean_dead_runs(out_prefix: Path) -> list[Path]:
    """Remove temp files, staging and part directories (`.parts.`: the earlier design) that dead
    runs left for this prefix; those of other hosts only when old (see `remove_stale_temps`)."""
    return remove_stale_temps(out_prefix.parent, out_prefix.name, marks=(TEMP_MARK, ".parts."))


def _warn_truncated(problems: list[Problem]) -> None:
    for p in problems:
        if p.kind == "truncated_file":
            print(
                f"warning: {p.file}: {p.message}; "
                f"kept the {max(p.line, 0)} line(s) decoded before the damage",
                file=sys.stderr,
            )


def _check_enough_documents(opts: PreprocessOptions, files: list[str], tally: _Tally) -> None:
    """No documents, or more bad lines than --max-bad-fraction allows, is a failed run."""
    bad, docs = tally.bad_lines, tally.documents
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(tally.errors.items()))
    first = next((p for p in tally.problems if p.kind not in FILE_PROBLEMS), None) or (
        tally.problems[0] if tally.problems else None
    )
    where = f"; first: {first.file}:{first.line}: {first.kind}" if first else ""
    what = files[0] if len(files) == 1 else f"{len(files)} input files ({files[0]}, ...)"
    if docs == 0:
        detail = f"{bad} bad line(s): {kinds}{where}" if tally.errors else "the input is empty"
        raise PreprocessError(
            f"{what}: no documents ({detail}); the input must be one JSON object per line with a "
            f"string {opts.json_key!r} field (see --json-key); nothing was written"
        )
    if bad and bad / (bad + docs) > opts.max_bad_fraction:
        raise PreprocessError(
            f"{what}: {bad} of {bad + docs} lines are bad ({kinds}{where}), more than --max-bad-fraction "
            f"{opts.max_bad_fraction}; fix the input or raise --max-bad-fraction; nothing was written"
        )


def _commit(
    out_prefix: Path,
    staging: Path,
    shards: list[IndexedDatasetBuilder],
    bases: set[str],
    fingerprint: dict,
    max_token_id: int,
    known_sha256: dict,
    stats: dict,
) -> list[Path]:
    """Move the staged set into place, write its manifest last and remove what an earlier run into
    the same prefix wrote that this one does not. Returns the removed files."""
    out_dir, name = out_prefix.parent, out_prefix.name
    staged = sorted(p for p in staging.iterdir() if TEMP_MARK not in p.name)
    _refuse_other_sets(out_prefix, [p.name for p in staged], bases)
    old_manifest = Path(f"{out_prefix}{MANIFEST_SUFFIX}")
    old_files: list[str] = []
    if old_manifest.is_file():
        try:
            old_files = list(read_manifest(old_manifest)["files"])
        except DataError:
            old_files = []
        old_manifest.unlink()  # from here on the old set is no longer a complete set
    new_files = []
    for path in staged:
        os.replace(path, out_dir / path.name)
        new_files.append(path.name)
    write_manifest(
        out_prefix,
        [str(out_dir / Path(b.prefix).name) for b in shards],
        fingerprint,
        max_token_id,
        known_sha256,
        documents=stats["documents"],
        tokens=stats["tokens"],
        dtype=stats["dtype"],
    )
    # numbered shards of the bases this run writes are this prefix's outputs too (e.g. from a run
    # without a manifest); so are the files the old manifest listed. A file that the manifest of
    # another shard set lists is that set's, whatever its name, and is never removed.
    ours = re.compile(rf"^(?:{'|'.join(sorted(map(re.escape, bases)))})(?:_\d{{5}})?\.(?:bin|idx)$")
    keep = set(new_files)
    stale = [out_dir / f for f in old_files if f not in keep and "/" not in f and (out_dir / f).is_file()]
    stale += [
        p
        for p in out_dir.iterdir()
        if p.is_file() and ours.match(p.name) and p.name not in keep and p not in stale
    ]
    stale = [p for p in stale if _other_owner(out_dir, p.name, name) is None]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _other_owner(out_dir: Path, file: str, name: str) -> Path | None:
    """The manifest of another shard set than prefix `name` that owns `file` in `out_dir`, or None
    when the file is this prefix's (its manifest lists it) or no set's. As in
    `manifest.find_manifest`, the owner of `P_Github_00003.bin` is the first of
    `P_Github_00003`, `P_Github`, `P` `.manifest.json` that lists it; an unreadable manifest of
    another set is taken to own everything it could."""
    stem, shard = file, False
    for ext in (*SHARD_FILES, *SET_FILES):
        if file.endswith(ext):
            stem, shard = file[: -len(ext)], ext in SHARD_FILES
            break
    candidate = stem
    while True:
        path = out_dir / f"{candidate}{MANIFEST_SUFFIX}"
        if path.is_file():
            try:
                manifest = read_manifest(path)
            except DataError:
                if candidate != name:
                    return path
                manifest = {"shards": [], "files": {}}
            if file in manifest["files"] or (shard and stem in manifest["shards"]):
                return None if candidate == name else path
        if "_" not in candidate:
            return None
        candidate = candidate.rsplit("_", 1)[0]


def _refuse_other_sets(out_prefix: Path, files: list[str], bases: set[str]) -> None:
    """Refuse, before anything is moved, a run whose outputs would overwrite a file of another shard
    set, or whose output name (`<prefix>_<subset>` of --split-by-subset) is another set's prefix."""
    out_dir, name = out_prefix.parent, out_prefix.name
    for file in files:
        owner = _other_owner(out_dir, file, name) if (out_dir / file).exists() else None
        if owner is not None:
            raise PreprocessError(
                f"--output-prefix {out_prefix}: would overwrite {out_dir / file} of the shard set "
                f"{out_dir / owner.name[: -len(MANIFEST_SUFFIX)]} (see {owner}); "
                "choose another --output-prefix, or move or delete that set first; nothing was written"
            )
    for base in sorted(bases - {name}):
        other = out_dir / f"{base}{MANIFEST_SUFFIX}"
        if other.exists():
            raise PreprocessError(
                f"--output-prefix {out_prefix}: would write {out_dir / base}.bin/.idx, "
                f"but {out_dir / base} is "
                f"the prefix of another shard set (see {other}); choose another --output-prefix, or move or "
                f"delete that set first; nothing was written"
            )


def _stats(opts, files, tok, tally: _Tally, outputs: list[str], seconds: float) -> dict:
    return {
        "inputs": files,
        "outputs": outputs,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eod": tok.eod,
        "dtype": best_dtype(tok.vocab_size).name,
        "json_key": opts.json_key,
        "documents": tally.documents,
        "tokens": tally.tokens,
        "text_bytes": tally.text_bytes,
        "subsets": dict(sorted(tally.subsets.items())),
        "errors": dict(sorted(tally.errors.items())),
        "error_count": sum(tally.errors.values()),
        "problems": [p.to_dict() for p in tally.problems],
        "workers": opts.workers,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tally.tokens / max(seconds, 1e-9), 1),
    }
