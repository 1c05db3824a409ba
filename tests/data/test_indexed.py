"""MMIDIDX byte layout: our writer against a reader written from the spec, and the reverse."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from megatron_lev.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_dtype,
)

SPEC_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def spec_read(prefix):
    """An independent reader, from the table in PLATFORM.md ('Data format')."""
    raw = open(f"{prefix}.idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17])[0] == 1
    dtype = np.dtype(SPEC_CODES[raw[17]])
    n, docs = struct.unpack("<QQ", raw[18:34])
    off = 34
    sizes = np.frombuffer(raw, "<i4", n, off)
    off += 4 * n
    pointers = np.frombuffer(raw, "<i8", n, off)
    off += 8 * n
    doc_idx = np.frombuffer(raw, "<i8", docs, off)
    assert off + 8 * docs == len(raw)
    data = open(f"{prefix}.bin", "rb").read()
    seqs = [np.frombuffer(data, dtype, s, p) for s, p in zip(sizes, pointers)]
    return dtype, seqs, doc_idx


def spec_write(prefix, dtype, seqs, doc_idx):
    """An independent writer of the same layout."""
    codes = {np.dtype(v): k for k, v in SPEC_CODES.items()}
    sizes = [len(s) for s in seqs]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, codes[np.dtype(dtype)], len(seqs), len(doc_idx)))
        f.write(np.asarray(sizes, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes())
        f.write(np.asarray(doc_idx, "<i8").tobytes())


def test_shard_written_here_reads_with_spec_reader(pile_shard, pile_docs, neox_path):
    from megatron_lev.data.tokenizers import build_tokenizer

    tok = build_tokenizer("hf", neox_path)
    dtype, seqs, doc_idx = spec_read(pile_shard)
    assert dtype == np.uint16 and len(seqs) == len(pile_docs)
    assert doc_idx.tolist() == list(range(len(pile_docs) + 1))
    for doc, seq in zip(pile_docs, seqs):  # round trip: every document equals its tokenisation + EOD
        assert seq.tolist() == tok.encode(doc["text"]) + [tok.eod]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_bytes_written_by_spec_read_by_indexed_dataset(tmp_path, dtype):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 60000, rng.integers(1, 50)) for _ in range(20)]
    doc_idx = [0, 3, 10, 20]  # several sequences per document
    spec_write(tmp_path / "x", dtype, seqs, doc_idx)
    ds = IndexedDataset(tmp_path / "x")
    assert ds.dtype == dtype and len(ds) == 20 and ds.doc_idx.tolist() == doc_idx
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s.tolist()
    assert ds.get(4, 1, 2).tolist() == seqs[4][1:3].tolist()
    b = IndexedDatasetBuilder(tmp_path / "y", dtype)  # and our builder writes the same bytes
    for i, s in enumerate(seqs):
        b.add_item(s)
        if i + 1 in doc_idx:
            b.end_document()
    b.finalize()
    for ext in ("bin", "idx"):
        assert (tmp_path / f"y.{ext}").read_bytes() == (tmp_path / f"x.{ext}").read_bytes()


def test_dtype_choice():
    assert best_dtype(50277) == np.uint16 and best_dtype(65536) == np.uint16
    assert best_dtype(65537) == np.int32


def test_merge_keeps_documents(tmp_path):
    for name, docs in (("a", [[1, 2], [3]]), ("b", [[4, 5, 6]])):
        b = IndexedDatasetBuilder(tmp_path / name, np.uint16)
        for d in docs:
            b.add_document(d)
        b.finalize()
    m = IndexedDatasetBuilder(tmp_path / "m", np.uint16)
    m.merge_file_(tmp_path / "a")
    m.merge_file_(tmp_path / "b")
    m.finalize()
    ds = IndexedDataset(tmp_path / "m")
    assert [ds[i].tolist() for i in range(3)] == [[1, 2], [3], [4, 5, 6]] and ds.doc_idx.tolist() == [
        0,
        1,
        2,
        3,
    ]


def _pair(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "p", np.uint16)
    for d in ([1, 2, 3], [4, 5]):
        b.add_document(d)
    b.finalize()
    return tmp_path / "p"


def test_truncated_bin_is_a_clear_error(tmp_path):
    prefix = _pair(tmp_path)
    data = (tmp_path / "p.bin").read_bytes()
    (tmp_path / "p.bin").write_bytes(data[:-2])
    with pytest.raises(IndexedDatasetError, match=r"p\.bin.*truncated or mismatched"):
        IndexedDataset(prefix)


def test_truncated_idx_is_a_clear_error(tmp_path):
    prefix = _pair(tmp_path)
    raw = (tmp_path / "p.idx").read_bytes()
    (tmp_path / "p.idx").write_bytes(raw[:-8])
    with pytest.raises(IndexedDatasetError, match=r"p\.idx.*truncated or corrupt"):
        IndexedDataset(prefix)
    (tmp_path / "p.idx").write_bytes(raw[:20])
    with pytest.raises(IndexedDatasetError, match="truncated header"):
        IndexedDataset(prefix)


def test_bad_magic_dtype_and_missing_file(tmp_path):
    prefix = _pair(tmp_path)
    raw = bytearray((tmp_path / "p.idx").read_bytes())
    bad = bytearray(raw)
    bad[17] = 9
    (tmp_path / "p.idx").write_bytes(bytes(bad))
    with pytest.raises(IndexedDatasetError, match="unknown dtype code 9"):
        IndexedDataset(prefix)
    bad = bytearray(raw)
    bad[17] = 4  # int32 claimed for a uint16 .bin: the pointers no longer match the sizes
    (tmp_path / "p.idx").write_bytes(bytes(bad))
    with pytest.raises(IndexedDatasetError, match=r"p\.idx.*disagree"):
        IndexedDataset(prefix)
    (tmp_path / "p.idx").write_bytes(b"NOTMMIDX" + bytes(raw[8:]))
    with pytest.raises(IndexedDatasetError, match="not an MMIDIDX"):
        IndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match="file not found"):
        IndexedDataset(tmp_path / "missing")


def test_interrupted_builder_leaves_no_index(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "i", np.uint16)
    b.add_document([1, 2, 3])
    b.abort()  # what a failing run does; a killed one leaves only the hidden temp file
    assert not (tmp_path / "i.idx").exists() and not (tmp_path / "i.bin").exists()
