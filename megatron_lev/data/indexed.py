"""Megatron's memory-mapped indexed dataset (MMIDIDX): a `.bin` of tokens and an `.idx` of sizes.

`.bin` is the tokens concatenated without a header. `.idx` (little-endian) holds a
magic, version, dtype code, sequence and document counts, then int32 sizes, int64
byte offsets and the int64 document index. Readers map both files; writers stream
to temp files and rename the `.bin` first and the `.idx` last, so a reader never
sees an index that points past its data. Opening a pair checks the header, that the
sizes and pointers describe the `.bin` exactly (contiguous, in order, ending at its
size) and that the document index is ordered, so a damaged index is refused by name
instead of training on garbage.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from array import array
from pathlib import Path

import numpy as np

from megatron_lev.errors import DataError
from megatron_lev.utils.io import atomic_open, temp_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # magic 9 + version 8 + dtype 1 + sequences 8 + documents 8
DTYPES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
CHECK_BLOCK = 1 << 24  # sequences per block when checking pointers (bounds temporary memory)
REBUILD = "rebuild it with `megatron-lev preprocess`"


class IndexedDatasetError(DataError):
    """A `.bin/.idx` pair is missing, truncated, or inconsistent; the message names the file."""


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabulary <= 65,536), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def data_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def index_file(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def _tmp(path: Path) -> Path:
    return temp_path(path)


def write_index(path: Path, dtype: np.dtype, sizes: np.ndarray, doc_idx: np.ndarray) -> str:
    """Write an `.idx` for `sizes` (tokens per sequence) and `doc_idx` atomically; returns its sha256."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    digest = hashlib.sha256()
    with atomic_open(path, "wb") as f:
        for part in (
            MAGIC,
            struct.pack("<Q", VERSION),
            struct.pack("<B", CODES[dtype]),
            struct.pack("<Q", len(sizes)),
            struct.pack("<Q", len(doc_idx)),
            sizes.astype("<i4").tobytes(),
            pointers.astype("<i8").tobytes(),
            doc_idx.astype("<i8").tobytes(),
        ):
            f.write(part)
            digest.update(part)
    return digest.hexdigest()


class IndexedDataset:
    """Memory-mapped reader of `<prefix>.bin/.idx`; `ds[i]` is sequence i as a numpy view."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = index_file(prefix), data_file(prefix)
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise IndexedDatasetError(
                    f"{p}: file not found (expected a .bin/.idx pair at prefix {prefix}); "
                    "check data.data_path or the --output-prefix preprocess wrote"
                )
        idx_bytes = idx_path.stat().st_size
        if idx_bytes < HEADER_SIZE:
            raise IndexedDatasetError(
                f"{idx_path}: truncated header ({idx_bytes} bytes < {HEADER_SIZE}); {REBUILD}"
            )
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[:9] != MAGIC:
            raise IndexedDatasetError(f"{idx_path}: not an MMIDIDX index (magic {header[:9]!r}); {REBUILD}")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise IndexedDatasetError(
                f"{idx_path}: unsupported version {version} (expected {VERSION}); {REBUILD}"
            )
        code = header[17]
        if code not in DTYPES:
            raise IndexedDatasetError(
                f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)}); {REBUILD}"
            )
        self.dtype = np.dtype(DTYPES[code])
        n, n_doc = struct.unpack("<QQ", header[18:34])
        expected = HEADER_SIZE + n * 4 + n * 8 + n_doc * 8
        if idx_bytes != expected:
            raise IndexedDatasetError(
                f"{idx_path}: size {idx_bytes} bytes does not match its header ({n} sequences, "
                f"{n_doc} document entries -> {expected} bytes); the file is truncated or corrupt: {REBUILD}"
            )
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(self._idx, dtype="<i4", count=n, offset=HEADER_SIZE)
        self.pointers = np.frombuffer(self._idx, dtype="<i8", count=n, offset=HEADER_SIZE + 4 * n)
        self.doc_idx = np.frombuffer(self._idx, dtype="<i8", count=n_doc, offset=HEADER_SIZE + 12 * n)
        need = self._check_pointers(idx_path)
        bin_bytes = bin_path.stat().st_size
        if bin_bytes != need:
            raise IndexedDatasetError(
                f"{bin_path}: {bin_bytes} bytes, but {idx_path} describes {need} bytes of "
                f"{self.dtype.name} tokens; the pair is truncated or mismatched: {REBUILD}"
            )
        if n_doc == 0 or self.doc_idx[0] != 0 or self.doc_idx[-1] != n:
            raise IndexedDatasetError(
                f"{idx_path}: document index must run from 0 to {n} sequences "
                f"(it has {n_doc} entries); the index is corrupt: {REBUILD}"
            )
        if n_doc > 1 and (np.diff(self.doc_idx) < 0).any():
            raise IndexedDatasetError(
                f"{idx_path}: document index is not in order; the index is corrupt: {REBUILD}"
            )
        self._bin = np.memmap(bin_path, mode="r", dtype=self.dtype) if bin_bytes else np.zeros(0, self.dtype)

    def _check_pointers(self, idx_path: Path) -> int:
        """Sizes are non-negative and each pointer is where the previous sequence ends (the only
        layout MMIDIDX writers produce); returns the `.bin` size they describe."""
        item, end = self.dtype.itemsize, 0
        for start in range(0, len(self.sizes), CHECK_BLOCK):
            sizes = self.sizes[start : start + CHECK_BLOCK].astype(np.int64)
            if sizes.min() < 0:
                i = start + int(np.argmin(sizes))
                raise IndexedDatasetError(
                    f"{idx_path}: sequence {i} has a negative size {int(sizes.min())}; "
                    f"the index is corrupt: {REBUILD}"
                )
            ends = end + np.cumsum(sizes) * item
            starts = np.concatenate(([end], ends[:-1]))
            bad = np.flatnonzero(self.pointers[start : start + CHECK_BLOCK] != starts)
            if bad.size:
                i = start + int(bad[0])
                raise IndexedDatasetError(
                    f"{idx_path}: sequence {i} points to byte {int(self.pointers[i])} "
                    f"but the sizes before it end at byte {int(starts[bad[0]])} for {self.dtype.name} "
                    f"tokens; sizes, pointers and dtype code disagree (the index is corrupt): {REBUILD}"
                )
            end = int(ends[-1])
        return end

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {self.prefix} ({len(self)} sequences)")
        i = int(i) % len(self)
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self._bin[start : start + int(self.sizes[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence i (to its end when length is None)."""
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        end = start - offset + int(self.sizes[i]) if length is None else start + length
        return self._bin[start:end]

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))


class IndexedDatasetBuilder:
    """Streams sequences to `<prefix>.bin` and writes `<prefix>.idx` on `finalize()`.

    Memory is 4 bytes per sequence (the sizes); tokens go straight to disk.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise IndexedDatasetError(f"dtype {self.dtype} has no MMIDIDX code (allowed: {list(CODES)})")
        self._bin_path = data_file(prefix)
        self._bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = _tmp(self._bin_path)
        self._out = open(self._tmp_bin, "wb")
        self._hash = hashlib.sha256()  # of the .bin, as written (the shard-set manifest records it)
        self.sha256: dict[str, str] = {}  # file name -> sha256, filled by finalize()
        self._sizes = array("i")
        self._doc_idx = array("q", [0])

    def add_item(self, tokens) -> None:
        """Append one sequence (without ending the document)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._write(arr.tobytes())
        self._sizes.append(len(arr))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens) -> None:
        self.add_item(tokens)
        self.end_document()

    def add_raw(self, data: bytes, sizes: np.ndarray) -> None:
        """Append already-encoded sequences (one document each): `data` are their bytes."""
        start = len(self._sizes)
        self._write(data)
        self._sizes.extend(np.asarray(sizes, dtype=np.int32).tolist())
        self._doc_idx.extend(range(start + 1, len(self._sizes) + 1))

    def merge_file_(self, other_prefix: str | os.PathLike) -> None:
        """Append a whole finalized shard, keeping its document boundaries."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(
                f"{other_prefix}: dtype {other.dtype} differs from the output's {self.dtype}"
            )
        base = len(self._sizes)
        self._out.flush()
        with open(data_file(other_prefix), "rb") as src:
            while buf := src.read(16 << 20):
                self._write(buf)
        self._sizes.extend(other.sizes.tolist())
        self._doc_idx.extend((other.doc_idx[1:] + base).tolist())

    def _write(self, data: bytes) -> None:
        self._out.write(data)
        self._hash.update(data)

    @property
    def num_bytes(self) -> int:
        return self._out.tell()

    @property
    def num_sequences(self) -> int:
        return len(self._sizes)

    def finalize(self) -> None:
        """Rename the `.bin` into place, then write the `.idx` (last, atomically)."""
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        idx_path = index_file(self.prefix)
        if idx_path.exists():  # never leave an old index beside a new .bin
            idx_path.unlink()
        os.replace(self._tmp_bin, self._bin_path)
        self.sha256[self._bin_path.name] = self._hash.hexdigest()
        self.sha256[idx_path.name] = write_index(
            idx_path,
            self.dtype,
            np.frombuffer(self._sizes, dtype=np.int32),
            np.frombuffer(self._doc_idx, dtype=np.int64),
        )

    def abort(self) -> None:
        """Drop the partial output (used when a run fails)."""
        if not self._out.closed:
            with contextlib.suppress(OSError):  # e.g. the disk is full: the partial file goes anyway
                self._out.close()
        self._tmp_bin.unlink(missing_ok=True)
