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

The parts: `preprocess_chunk.py` (options, one chunk tokenised), `preprocess_workers.py` (the worker
pool), `preprocess_outputs.py` (the staged shards and their commit); this module runs them.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from megatron_lev.data.indexed import best_dtype
from megatron_lev.data.preprocess_chunk import (
    FILE_PROBLEMS,
    UNKNOWN_SUBSET,
    ChunkResult,
    FlagError,
    PreprocessError,
    PreprocessOptions,
    check_options,
    subset_slug,
    tokenize_chunk,
)
from megatron_lev.data.preprocess_outputs import StagedOutputs, commit_shard_set
from megatron_lev.data.preprocess_workers import WorkerPool, set_chunk_hook
from megatron_lev.data.readers import Problem, find_inputs, iter_chunks
from megatron_lev.data.tokenizers import build_tokenizer, tokenizer_fingerprint
from megatron_lev.utils.io import (
    TEMP_MARK,
    atomic_open,
    atomic_write_json,
    raise_if_disk_full,
    remove_stale_temps,
    temp_tag,
)
from megatron_lev.utils.lock import exclusive_lock

__all__ = [
    "FILE_PROBLEMS",
    "UNKNOWN_SUBSET",
    "ChunkResult",
    "FlagError",
    "PreprocessError",
    "PreprocessOptions",
    "check_options",
    "clean_dead_runs",
    "lock_path",
    "preprocess",
    "set_chunk_hook",
    "subset_slug",
    "tokenize_chunk",
]


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
    outputs = StagedOutputs(opts, staging, tok.vocab_size)
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
            pool, ok = WorkerPool(opts), False
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
            stale = commit_shard_set(
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
