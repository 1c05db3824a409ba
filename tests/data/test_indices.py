"""sample_idx equals Megatron's, row for row: a token-by-token reference, a fixed case, edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lev.data import indices as ix
from megatron_lev.errors import DataError


def reference_sample_idx(sizes, doc_idx, seq_length: int, num_samples: int) -> np.ndarray:
    """Megatron's walk, one document at a time: from each sample's first token, step S tokens on.

    The next sample starts on the last token of this one (S + 1 tokens, one shared), so a
    sample ending on a document's last token leaves the next one starting in that document,
    and empty documents are stepped over; row 0 is (0, 0) whatever the first document holds.
    """
    rows = [(0, 0)]
    pos, offset = 0, 0
    for _ in range(num_samples):
        need = seq_length
        while need >= int(sizes[doc_idx[pos]]) - offset:  # the target token lies past this document
            need -= int(sizes[doc_idx[pos]]) - offset
            pos, offset = pos + 1, 0
        offset += need
        rows.append((pos, offset))
    return np.array(rows, dtype=np.int32)


# Output of Megatron-LM's C++ helper (megatron-core 0.16.1, build_sample_idx_int32 with
# 2 epochs and add_extra_token_to_sequence=1) on this input: empty documents first, in
# the middle and at a sample boundary; a sample ending on a document's last token.
SIZES = [0, 5, 1, 0, 7, 4, 3, 0, 8, 2]
DOC_IDX = [3, 0, 5, 1, 9, 7, 2, 4, 8, 6, 0, 6, 2, 1, 9, 5, 4, 3, 7, 8]
MEGATRON = [
    [0, 0],
    [3, 0],
    [3, 4],
    [7, 0],
    [7, 4],
    [8, 1],
    [8, 5],
    [9, 1],
    [11, 2],
    [13, 2],
    [14, 1],
    [15, 3],
    [16, 3],
    [19, 0],
    [19, 4],
]


@pytest.mark.parametrize("chunk", [1, 3, 1 << 17])
def test_fixed_case_equals_megatron_helper(chunk):
    sizes, doc_idx = np.array(SIZES, dtype=np.int32), np.array(DOC_IDX, dtype=np.int32)
    got = ix.build_sample_idx(sizes, doc_idx, 4, len(MEGATRON) - 1, chunk=chunk)
    assert got.dtype == np.int32 and got.tolist() == MEGATRON
    assert reference_sample_idx(sizes, doc_idx, 4, len(MEGATRON) - 1).tolist() == MEGATRON
    with pytest.raises(DataError, match="need more than 60 tokens"):  # 15 * 4 is past the last token
        ix.build_sample_idx(sizes, doc_idx, 4, len(MEGATRON), chunk=chunk)


def test_random_cases_equal_the_reference():
    rng = np.random.default_rng(0)
    checked = 0
    while checked < 400:
        docs, seq_length, epochs = int(rng.integers(1, 50)), int(rng.integers(2, 30)), int(rng.integers(1, 4))
        sizes = rng.integers(0, int(rng.integers(1, 3 * seq_length)), size=docs).astype(np.int32)
        if rng.random() < 0.3:
            sizes[rng.random(docs) < 0.5] = 0  # runs of empty documents
        most = (epochs * int(sizes.sum()) - 1) // seq_length  # every sample the tokens hold
        if most < 1:
            continue
        doc_idx = ix.build_doc_idx(np.arange(docs), epochs, rng)
        num_samples = int(rng.integers(1, most + 1))
        chunk = int(rng.choice([1, 2, 5, 1 << 17]))  # chunk edges anywhere, or one chunk
        got = ix.build_sample_idx(sizes, doc_idx, seq_length, num_samples, chunk=chunk)
        assert np.array_equal(got, reference_sample_idx(sizes, doc_idx, seq_length, num_samples))
        with pytest.raises(DataError, match="need more than"):
            ix.build_sample_idx(sizes, doc_idx, seq_length, most + 1, chunk=chunk)
        checked += 1


def test_samples_tile_the_stream_at_scale():
    """100k documents in several chunks: sample i starts at token i * S of the stream."""
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 3000, size=100_000).astype(np.int32)
    doc_idx = ix.build_doc_idx(np.arange(len(sizes)), 2, rng)
    seq_length = 2048
    num_samples = (2 * int(sizes.sum()) - 1) // seq_length
    got = ix.build_sample_idx(sizes, doc_idx, seq_length, num_samples, chunk=1 << 12)
    starts = np.concatenate([[0], np.cumsum(sizes[doc_idx], dtype=np.int64)[:-1]])
    first_token = starts[got[:, 0]] + got[:, 1]
    assert np.array_equal(first_token, np.arange(num_samples + 1, dtype=np.int64) * seq_length)
    assert (got[1:, 1] < sizes[doc_idx[got[1:, 0]]]).all()  # every start after row 0 is a real token


def test_rejects_document_ids_out_of_range():
    with pytest.raises(DataError, match="outside"):
        ix.build_sample_idx(np.array([5, 5], dtype=np.int32), np.array([0, 2], dtype=np.int32), 2, 1)
