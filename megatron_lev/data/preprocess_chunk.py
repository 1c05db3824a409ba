"""What preprocessing makes of one chunk of input lines: the options and their checks, and the
tokenising of a chunk into per-output token arrays (run in a worker, or in the main process with one
worker). Bad lines become `Problem`s, never exceptions."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_lev.data.indexed import best_dtype
from megatron_lev.data.readers import Chunk, Problem, check_text, parse_line
from megatron_lev.data.tokenizers import PIECE_CHARS
from megatron_lev.errors import DataError, UserError

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
