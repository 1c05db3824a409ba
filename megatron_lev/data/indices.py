"""The GPTDataset index arrays (Megatron's scheme), built with vectorised numpy.

- `doc_idx`: the documents of a split tiled over E epochs and shuffled (E = the fewest
  epochs whose tokens hold N samples of S + 1 tokens overlapping by one: E*T - 1 >= N*S).
- `sample_idx[i] = (position in doc_idx, token offset)` where sample i starts; sample i
  runs to `sample_idx[i + 1]` inclusive, so consecutive samples share one token.
- `shuffle_idx`: the order in which samples are served.
- blending: for sample i, the dataset with the largest `weight * max(i, 1) - drawn_so_far`.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_lev.errors import DataError


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs E with E * tokens - 1 >= num_samples * seq_length (the last sample's +1 token)."""
    if tokens_per_epoch <= 0:
        raise DataError("cannot draw samples from a split with no tokens; change data.split or add data")
    return max(1, math.ceil((num_samples * seq_length + 1) / tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, epochs: int, rng: np.random.Generator) -> np.ndarray:
    """Document ids tiled `epochs` times and shuffled as one array: (E * D,) int32."""
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int, chunk: int = 1 << 16
) -> np.ndarray:
    """(num_samples + 1, 2) (position in doc_idx, offset) of each sample's first token: int32, or int64
    when doc_idx has 2**31 positions or more.

    Sample i starts at token i * S of the documents in doc_idx order. One pass over doc_idx
    in chunks of documents: from a chunk's cumulative ends, ceil(end / S) counts the samples
    that start before each document's end; a sample's document in the chunk is how many
    documents end at or before its first token (a histogram of the counts, then its running sum).
    Time and memory are linear in documents + samples, every temporary is chunk-sized
    (cache-resident) except the output, and documents after the last sample are not read.
    Row 0 is (0, 0) even when the first document is empty, as in Megatron's sample_idx.
    """
    sizes, doc_idx = np.asarray(sizes), np.asarray(doc_idx)
    if len(doc_idx) and (doc_idx.min() < 0 or doc_idx.max() >= len(sizes)):
        raise DataError(f"doc_idx holds ids outside the {len(sizes)} documents")
    out = np.empty((num_samples + 1, 2), dtype=np.int32 if len(doc_idx) < 2**31 else np.int64)
    lengths = np.empty(chunk, dtype=sizes.dtype)
    ends = np.empty(chunk + 1, dtype=np.int64)  # [0]: tokens before the chunk, [1:]: its documents' ends
    started = np.empty(chunk + 1, dtype=np.int64)  # samples starting before each of those ends
    before, done = 0, 0  # tokens before the chunk, samples placed so far
    for c0 in range(0, len(doc_idx), chunk):
        n = min(chunk, len(doc_idx) - c0)
        np.take(sizes, doc_idx[c0 : c0 + n], out=lengths[:n], mode="clip")  # ids checked above
        e, st = ends[: n + 1], started[: n + 1]
        e[0] = before
        np.cumsum(lengths[:n], out=e[1:])
        e[1:] += before
        np.add(e, seq_length - 1, out=st)
        st //= seq_length
        st[0] = done
        if st[-1] > num_samples + 1:
            np.minimum(st, num_samples + 1, out=st)
        upto = int(st[-1])
        if upto > done:
            m = upto - done
            doc = np.cumsum(np.bincount(st[1:n] - done, minlength=m)[:m])  # (m,) each sample's document
            rows = out[done:upto]
            first_token = np.arange(done * seq_length, upto * seq_length, seq_length, dtype=np.int64)
            np.subtract(first_token, e[doc], out=rows[:, 1], casting="unsafe")
            np.add(doc, np.int64(c0), out=rows[:, 0], casting="unsafe")
            done = upto
        before = int(e[-1])
        if done > num_samples:
            break
    if done <= num_samples:
        raise DataError(
            f"{num_samples} samples of {seq_length}+1 tokens need more than {before} tokens; "
            "use more data or fewer samples"
        )
    out[0] = 0
    return out


def build_shuffle_idx(num_samples: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of the samples: (N,) uint32 when it fits, else int64."""
    dtype = np.uint32 if num_samples < 2**32 else np.int64
    idx = np.arange(num_samples, dtype=dtype)
    rng.shuffle(idx)
    return idx


def build_blending_indices(weights, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: (dataset of each sample uint16, its index within that dataset int64).

    The rule is sequential (each choice depends on the counts so far), so this is
    the one loop in the index code; it runs at ~2M samples/s and is cached.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise DataError(f"blend weights must be non-negative with a positive sum, got {list(weights)}")
    w = (w / w.sum()).tolist()
    k = len(w)
    drawn = [0] * k
    which = np.empty(num_samples, dtype=np.uint16)
    within = np.empty(num_samples, dtype=np.int64)
    rk = range(k)
    for i in range(num_samples):
        scale = i if i > 0 else 1
        best = max(rk, key=lambda d: w[d] * scale - drawn[d])
        which[i] = best
        within[i] = drawn[best]
        drawn[best] += 1
    return which, within


def split_documents(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Megatron's split of documents by the weights 'train,valid,test' into [start, end) ranges."""
    weights = [float(s) for s in split.split(",")]
    total = sum(weights)
    bounds = [0]
    for wt in weights:
        bounds.append(bounds[-1] + int(round(wt / total * num_documents)))
    diff = bounds[-1] - num_documents
    for i in range(1, len(bounds)):
        bounds[i] -= diff
    bounds = [max(0, b) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(len(weights))]
