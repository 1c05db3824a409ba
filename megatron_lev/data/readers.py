"""Reading Pile-format input: `*.jsonl[.zst|.gz]` files, directories, globs, local HF datasets.

The reader yields chunks of raw lines (bytes, bounded in size) so that parsing and
tokenising happen in the workers; `parse_line` turns one line into text or a
counted error. Nothing here raises on bad data: malformed JSON, a missing key,
invalid UTF-8, empty documents and truncated compressed files become `Problem`s. A
truncated `.zst`/`.gz` keeps every line decoded before the damage (zstd decodes whole
blocks of up to 128 KiB, so a cut inside the first block keeps nothing); its partial
last line is dropped with the file's problem. Inputs that cannot be read at all (no
such file, an unsupported type, a dataset without the text column) raise `InputError`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_lev.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".json", ".json.zst", ".json.gz")
# inside a directory only unambiguous line files are taken: a plain `.json` there is
# usually metadata (a corpus manifest), not one document per line
DIR_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz")
HF_SUFFIXES = (".arrow", ".parquet")
ERROR_KINDS = ("malformed_json", "missing_key", "invalid_utf8", "empty_document", "truncated_file")


class InputError(DataError):
    """An input path or dataset cannot be read at all; the message names it."""


@dataclass
class Problem:
    """One bad input found while reading: where it is and what is wrong."""

    file: str
    line: int
    kind: str  # one of ERROR_KINDS
    message: str

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "kind": self.kind, "message": self.message}


@dataclass
class Chunk:
    """A run of consecutive input lines (or records) handed to one worker."""

    chunk_id: int
    file: str
    first_line: int  # 1-based line number of the first item
    lines: list  # bytes lines for jsonl; (text, subset) tuples for HF datasets
    records: bool = False


def find_inputs(inputs: list[str]) -> list[str]:
    """Expand files, directories and globs into a sorted, de-duplicated list of input files/datasets."""
    found: list[str] = []
    for item in inputs:
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not matches:
            raise InputError(
                f"--input {item!r}: no file matches this pattern; check the pattern and quote it"
            )
        for m in matches:
            p = Path(m)
            if p.is_dir() and any(
                (p / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json")
            ):
                found.append(str(p))  # a `datasets.save_to_disk` directory
            elif p.is_dir():
                inner = sorted(
                    str(q)
                    for q in p.rglob("*")
                    if q.is_file() and q.name.endswith(DIR_SUFFIXES + HF_SUFFIXES)
                )
                if not inner:
                    raise InputError(
                        f"--input {p}: no *.jsonl, *.jsonl.zst, *.jsonl.gz, *.arrow or *.parquet "
                        "files in this directory; give the files or a directory holding them"
                    )
                found.extend(inner)
            elif p.is_file():
                if not p.name.endswith(JSONL_SUFFIXES + HF_SUFFIXES):
                    raise InputError(
                        f"--input {p}: unsupported file type (use .jsonl, .jsonl.zst, .jsonl.gz, "
                        ".arrow, .parquet or a datasets directory)"
                    )
                found.append(str(p))
            elif not p.exists():
                raise InputError(f"--input {p}: no such file or directory; check the path")
            else:
                raise InputError(f"--input {p}: not a regular file or directory")
    return list(dict.fromkeys(found))


def _decoded_blocks(
    f, path: str, problems: list[Problem], new_decoder, error: type, fmt: str, unit: str, block: int = 1 << 20
) -> Iterator[bytes]:
    """Decompress a multi-frame/member stream incrementally: a truncated or corrupt file still
    yields what precedes the damage, and the damage is reported, not raised."""
    dobj = new_decoder()
    fed = False
    while data := f.read(block):
        while data:
            try:
                out = dobj.decompress(data)
            except error as exc:
                problems.append(Problem(path, -1, "truncated_file", f"corrupt {fmt} data: {exc}"))
                return
            fed = True
            if out:
                yield out
            if dobj.eof:
                data = dobj.unused_data
                dobj = new_decoder()
                fed = False
            else:
                data = b""
    if fed:
        problems.append(Problem(path, -1, "truncated_file", f"{fmt} stream ends in the middle of a {unit}"))


def _zst_blocks(f, path: str, problems: list[Problem], block: int = 1 << 20) -> Iterator[bytes]:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    return _decoded_blocks(f, path, problems, dctx.decompressobj, zstandard.ZstdError, "zstd", "frame", block)


def _gz_blocks(f, path: str, problems: list[Problem], block: int = 1 << 20) -> Iterator[bytes]:
    return _decoded_blocks(
        f, path, problems, lambda: zlib.decompressobj(wbits=31), zlib.error, "gzip", "member", block
    )


def _plain_blocks(f, path: str, problems: list[Problem], block: int = 1 << 20) -> Iterator[bytes]:
    while data := f.read(block):
        yield data


def iter_jsonl_lines(path: str, problems: list[Problem]) -> Iterator[bytes]:
    """The raw lines of a jsonl file (compressed or not), without their newline."""
    opener = _zst_blocks if path.endswith(".zst") else _gz_blocks if path.endswith(".gz") else _plain_blocks
    rest, before = b"", len(problems)
    with open(path, "rb") as f:
        for block in opener(f, path, problems):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            yield from lines
    if rest and len(problems) > before:  # the stream was cut: its last line is partial
        problems[-1].message += f" (dropped the partial last line, {len(rest)} bytes)"
    elif rest:
        yield rest


def iter_chunks(
    files: list[str], problems: list[Problem], chunk_bytes: int = 1 << 20, text_key: str = "text"
) -> Iterator[Chunk]:
    """Chunks of at most ~`chunk_bytes` of consecutive lines, numbered in input order."""
    chunk_id = 0
    for path in files:
        if path.endswith(HF_SUFFIXES) or os.path.isdir(path):
            for first, records in _iter_hf_records(path, text_key, chunk_bytes):
                yield Chunk(chunk_id, path, first, records, records=True)
                chunk_id += 1
            continue
        lines, size, first, line_no = [], 0, 1, 0
        for line_no, line in enumerate(iter_jsonl_lines(path, problems), start=1):
            lines.append(line)
            size += len(line)
            if size >= chunk_bytes:
                yield Chunk(chunk_id, path, first, lines)
                chunk_id += 1
                lines, size, first = [], 0, line_no + 1
        if lines:
            yield Chunk(chunk_id, path, first, lines)
            chunk_id += 1
        for p in problems:
            if p.file == path and p.line == -1:
                p.line = line_no


def _iter_hf_records(path: str, text_key: str, chunk_bytes: int):
    """(first row number, [(text, subset), ...]) batches from a local HF dataset."""
    import datasets

    from megatron_lev.utils.progress import hf_bars_off_a_terminal

    hf_bars_off_a_terminal()

    quiet = logging.getLogger("datasets")  # its error log would repeat the one line raised below
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        if os.path.isdir(path):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                ds = datasets.concatenate_datasets([ds[k] for k in sorted(ds)])
        elif path.endswith(".parquet"):
            ds = datasets.Dataset.from_parquet(path)
        else:
            ds = datasets.Dataset.from_file(path)
    except Exception as exc:  # pyarrow and datasets raise many types for a damaged file
        raise InputError(
            f"--input {path}: not a readable dataset ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); check the file"
        ) from exc
    finally:
        quiet.setLevel(level)
    if text_key not in ds.column_names:
        raise InputError(
            f"--input {path}: dataset has no column {text_key!r} (columns: {ds.column_names}); "
            "set --json-key to the text column"
        )
    has_meta = "meta" in ds.column_names
    batch, size, first = [], 0, 1
    for row_no, row in enumerate(ds, start=1):
        meta = row.get("meta") if has_meta else None
        subset = meta.get("pile_set_name") if isinstance(meta, dict) else None
        text = row[text_key]
        batch.append((text, subset))
        size += len(text) if isinstance(text, str) else 0
        if size >= chunk_bytes:
            yield first, batch
            batch, size, first = [], 0, row_no + 1
    if batch:
        yield first, batch


def parse_line(line: bytes, text_key: str) -> tuple[str | None, str | None, str | None]:
    """(text, pile_set_name, None) for a good line, or (None, None, error kind + message)."""
    try:
        s = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, None, f"invalid_utf8: {exc}"
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as exc:
        return None, None, f"malformed_json: {exc}"
    if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
        return None, None, f"missing_key: no string field {text_key!r}"
    meta = obj.get("meta")
    subset = meta.get("pile_set_name") if isinstance(meta, dict) else None
    return obj[text_key], subset if isinstance(subset, str) else None, None


def check_text(text) -> str | None:
    """An error for a record whose text is unusable, else None."""
    if not isinstance(text, str):
        return "missing_key: text is not a string"
    if not text.strip():
        return "empty_document: text is empty or whitespace"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates from `\ud800` escapes
        return f"invalid_utf8: {exc}"
    return None
