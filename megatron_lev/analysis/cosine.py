"""Exact distribution statistics of pairwise cosine similarities of an embedding matrix.

All `V(V-1)/2` pairs `i < j` are visited in blocks: `X_i @ X_j^T` of row-normalised float32
blocks, reduced at once into float64 running sums of `c` and `c^2` and a streaming
histogram, so memory is O(block^2), never V x V.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from megatron_lev.errors import DataError


@dataclass
class CosineStats:
    """Mean, std and accepted deviation `eps = mu + 2 sigma` over the pairs, with a histogram."""

    rows: int               # rows kept (non-zero norm)
    dropped_zero_rows: int
    dim: int
    pairs: int              # pairs the mean/std are over
    mean: float
    std: float
    eps: float
    hist_edges: np.ndarray  # (bins + 1,) over [-1, 1]
    hist_counts: np.ndarray  # (bins,) int64
    hist_pairs: int         # pairs in the histogram (all of them unless hist_stride > 1)
    sampled_rows: int | None  # None: exact over all rows
    seconds: float

    def to_dict(self) -> dict:
        return {"rows": self.rows, "dropped_zero_rows": self.dropped_zero_rows, "dim": self.dim,
                "pairs": self.pairs, "mean": self.mean, "std": self.std, "eps": self.eps,
                "exact": self.sampled_rows is None, "sampled_rows": self.sampled_rows,
                "hist_pairs": self.hist_pairs, "seconds": self.seconds}


class MatrixError(DataError):
    """An embedding matrix cannot be measured (wrong rank or dtype, non-finite rows, too few rows)."""


def normalized_rows(matrix: torch.Tensor | np.ndarray, chunk: int = 16384) -> tuple[torch.Tensor, int]:
    """(V, d) -> (V', d) float32 unit rows with zero-norm rows dropped, and how many were dropped.

    Norms are taken in float64 a chunk of rows at a time, so memory stays ~ one float32 copy.
    A row with nan/inf is refused (it is neither a zero row nor a direction).
    """
    if isinstance(matrix, np.ndarray) and not (np.issubdtype(matrix.dtype, np.floating)
                                               or np.issubdtype(matrix.dtype, np.integer)):
        raise MatrixError(f"embedding matrix must hold real numbers, got dtype {matrix.dtype}")
    x = matrix if isinstance(matrix, torch.Tensor) else torch.from_numpy(np.asarray(matrix))
    if x.ndim != 2:
        raise MatrixError(f"embedding matrix must be 2-D (V, d), got shape {tuple(x.shape)}")
    if x.is_complex() or x.dtype == torch.bool:
        raise MatrixError(f"embedding matrix must hold real numbers, got dtype {x.dtype}")
    x = x.detach().cpu()
    parts = []
    for s in range(0, x.shape[0], chunk):
        rows = x[s:s + chunk].to(torch.float64)                    # (c, d)
        bad = (~torch.isfinite(rows)).any(dim=1).nonzero().flatten()
        if len(bad):
            raise MatrixError(f"row {s + int(bad[0])} holds non-finite values (nan/inf), and "
                              f"{len(bad) - 1} more row(s) among rows {s}..{s + len(rows) - 1}: the weights are "
                              "damaged; measure an earlier checkpoint")
        norms = rows.norm(dim=1)                                   # (c,)
        keep = norms > 0
        parts.append((rows[keep] / norms[keep, None]).to(torch.float32))
    out = torch.cat(parts) if parts else x.new_zeros((0, x.shape[1]), dtype=torch.float32)
    return out.contiguous(), x.shape[0] - out.shape[0]


def _accumulate(x: torch.Tensor, block: int, bins: int, hist_stride: int,
                progress: bool) -> tuple[float, float, torch.Tensor, int]:
    """One pass over the pair blocks of unit rows x (n, d): sum c, sum c^2, histogram, its pairs."""
    n, dev = x.shape[0], x.device
    s1 = s2 = 0.0                                  # float64 running sums of c and c^2
    counts = torch.zeros(bins, dtype=torch.float64, device=dev)
    zero_bin = int(torch.histc(torch.zeros(1, device=dev), bins=bins, min=-1.0, max=1.0).argmax())
    hist_pairs = 0
    starts = range(0, n, block)
    bar = tqdm(total=n * (n - 1) // 2, desc="cosine pairs", unit="pair", unit_scale=True,
               disable=not progress)
    for i in starts:
        xi = x[i:i + block]                                    # (b, d)
        for j in starts[i // block:]:
            g = xi @ x[j:j + block].T                          # (b, b') cosines
            if j == i:
                g.triu_(1)                                     # keep pairs i < j; the rest become 0.0
            s1 += float(g.sum(dim=1).double().sum())           # row sums in float32, total in float64
            s2 += float(torch.linalg.vector_norm(g, dim=1).double().square().sum())
            g.clamp_(-1.0, 1.0)                                # rounding can exceed 1 by an ulp
            src = g if hist_stride == 1 else g[::hist_stride]
            counts += torch.histc(src, bins=bins, min=-1.0, max=1.0).to(torch.float64)
            n_src = src.numel()
            if j == i:                                         # remove the zeros triu_ put below the diagonal
                rows = torch.arange(0, g.shape[0], hist_stride)
                zeros = int((rows + 1).sum())                  # row r holds r + 1 of them
                counts[zero_bin] -= zeros
                n_src -= zeros
            hist_pairs += n_src
            bar.update(g.shape[0] * (g.shape[0] - 1) // 2 if j == i else g.numel())
    bar.close()
    return s1, s2, counts, hist_pairs


def cosine_stats(matrix: torch.Tensor | np.ndarray, block: int = 4096, bins: int = 2000,
                 sample: int | None = None, seed: int = 0, hist_stride: int | None = None,
                 device: str | torch.device | None = None, progress: bool = False) -> CosineStats:
    """Exact mu, sigma, eps of cos(row_i, row_j) over all i < j (or over `sample` random rows).

    `hist_stride` > 1 histograms every k-th row of each block only (a cheaper plot; by default
    `auto_hist_stride`); mu, sigma and eps are always over every pair.
    """
    if block < 1 or bins < 1 or (hist_stride is not None and hist_stride < 1):
        raise MatrixError(f"--block, bins and --hist-stride must be >= 1, got {block}, {bins}, {hist_stride}")
    start = time.perf_counter()
    x, dropped = normalized_rows(matrix)
    if sample is not None and sample < x.shape[0]:
        if sample < 2:
            raise MatrixError(f"--sample must be >= 2 rows, got {sample}")
        gen = torch.Generator().manual_seed(seed)
        x = x[torch.randperm(x.shape[0], generator=gen)[:sample]].contiguous()
    else:
        sample = None
    n, d = x.shape
    if n < 2:
        raise MatrixError(f"need at least 2 non-zero rows to measure pairwise cosines, got {n} "
                          f"(of {n + dropped} rows, {dropped} zero)")
    hist_stride = hist_stride or auto_hist_stride(n, d)
    dev = torch.device(device) if device is not None else x.device
    x = x.to(dev)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False              # TF32 would round cosines to ~1e-3
    try:
        s1, s2, counts, hist_pairs = _accumulate(x, block, bins, hist_stride, progress)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    pairs = n * (n - 1) // 2
    mean = s1 / pairs
    std = math.sqrt(max(s2 / pairs - mean * mean, 0.0))
    return CosineStats(rows=n, dropped_zero_rows=dropped, dim=d,
                       pairs=pairs, mean=mean, std=std, eps=mean + 2 * std,
                       hist_edges=np.linspace(-1.0, 1.0, bins + 1),
                       hist_counts=counts.cpu().numpy().round().astype(np.int64), hist_pairs=hist_pairs,
                       sampled_rows=sample, seconds=time.perf_counter() - start)


def auto_hist_stride(rows: int, dim: int) -> int:
    """Histogram every k-th row, k = 4096 // d, once there are > 1e8 pairs: a histogram costs
    ~16 ns per value on a CPU and a product 2d flops, so this keeps it near 10% of the time
    while the plot still rests on > 1e7 pairs."""
    return max(1, 4096 // dim) if rows * (rows - 1) // 2 > 100_000_000 else 1


def gram_moments(matrix: torch.Tensor | np.ndarray) -> tuple[float, float]:
    """Exact mu, sigma over all pairs in O(V d^2) float64, without visiting pairs (a cross-check).

    sum_{i<j} c_ij = (|sum_i x_i|^2 - sum_i |x_i|^2) / 2 and
    sum_{i<j} c_ij^2 = (|X^T X|_F^2 - sum_i |x_i|^4) / 2 for unit rows x_i.
    """
    x, _ = normalized_rows(matrix)
    x = x.to(torch.float64)
    n = x.shape[0]
    sq = (x * x).sum(dim=1)                                    # (V',) ~ 1
    total = x.sum(dim=0)                                       # (d,)
    s1 = (float(total @ total) - float(sq.sum())) / 2
    gram = x.T @ x                                             # (d, d)
    s2 = (float((gram * gram).sum()) - float((sq * sq).sum())) / 2
    pairs = n * (n - 1) // 2
    mean = s1 / pairs
    return mean, math.sqrt(max(s2 / pairs - mean * mean, 0.0))
