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


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int,
                     block: int = 1 << 24) -> np.ndarray:
    """(num_samples + 1, 2) int32 (position in doc_idx, offset) of each sample's first token."""
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)  # (E*D,) exclusive end of each document in the stream
    if num_samples * seq_length >= ends[-1]:
        raise DataError(f"{num_samples} samples of {seq_length}+1 tokens need more than {ends[-1]} tokens; "
                        "use more data or fewer samples")
    out = np.empty((num_samples + 1, 2), dtype=np.int32)
    for start in range(0, num_samples + 1, block):  # blocks bound the temporary memory
        pos = np.arange(start, min(start + block, num_samples + 1), dtype=np.int64) * seq_length
        doc = np.searchsorted(ends, pos, side="right")
        before = np.where(doc > 0, ends[np.maximum(doc - 1, 0)], 0)
        out[start:start + len(pos), 0] = doc
        out[start:start + len(pos), 1] = pos - before
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
