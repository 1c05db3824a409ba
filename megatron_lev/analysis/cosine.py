"""Distribution statistics of the pairwise cosine similarities of an embedding matrix.

mu, sigma and eps over all `V(V-1)/2` pairs `i < j` come from the `d x d` Gram matrix of the
unit rows, in float64 and O(V d^2), without visiting a pair: for unit rows `x_i`,

    sum_{i<j} c_ij   = (|sum_i x_i|^2   - n) / 2
    sum_{i<j} c_ij^2 = (|X^T X|_F^2     - n) / 2

Only the histogram needs the pairs themselves: blocks `X_i @ X_j^T` of float32 unit rows over all
rows (`histogram="full"`) or over a seeded row sample (the default), memory O(block^2), never V x V.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from megatron_lev.errors import DataError
from megatron_lev.utils.progress import progress_bar

HISTOGRAM_MODES = ("sample", "full", "off")


@dataclass
class CosineStats:
    """Mean, std and accepted deviation `eps = mu + 2 sigma` over the pairs, with a histogram."""

    rows: int  # rows kept (non-zero norm)
    dropped_zero_rows: int
    dim: int
    pairs: int  # pairs the mean/std are over
    mean: float
    std: float
    eps: float  # exact over `pairs`, from the Gram matrix
    hist_mode: str  # "full": every row; "sample": `hist_rows` seeded random rows; "off"
    hist_rows: int  # rows whose pairs the histogram is over (0 when off)
    hist_seed: int | None  # seed of the histogram's row sample (None unless "sample")
    hist_stride: int  # every k-th row of a pair block histogrammed
    hist_edges: np.ndarray  # (bins + 1,) over [-1, 1]
    hist_counts: np.ndarray  # (bins,) int64
    hist_pairs: int  # pairs in the histogram
    eps_pairs: float | None  # eps from the all-pairs pass (float32 products) when it ran in full
    sampled_rows: int | None  # None: eps over all rows; else over this many seeded random rows
    seed: int
    seconds: float
    gram_seconds: float
    hist_seconds: float

    def to_dict(self) -> dict:
        return {
            "rows": self.rows,
            "dropped_zero_rows": self.dropped_zero_rows,
            "dim": self.dim,
            "pairs": self.pairs,
            "mean": self.mean,
            "std": self.std,
            "eps": self.eps,
            "eps_method": "gram",
            "exact": self.sampled_rows is None,
            "sampled_rows": self.sampled_rows,
            "seed": self.seed,
            "hist_mode": self.hist_mode,
            "hist_rows": self.hist_rows,
            "hist_seed": self.hist_seed,
            "hist_stride": self.hist_stride,
            "hist_pairs": self.hist_pairs,
            "eps_pairs": self.eps_pairs,
            "seconds": self.seconds,
            "gram_seconds": self.gram_seconds,
            "hist_seconds": self.hist_seconds,
        }


class MatrixError(DataError):
    """An embedding matrix cannot be measured (wrong rank or dtype, non-finite rows, too few rows)."""


def _as_matrix(matrix: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A (V, d) real CPU tensor view of `matrix`, or MatrixError."""
    if isinstance(matrix, np.ndarray) and not (
        np.issubdtype(matrix.dtype, np.floating) or np.issubdtype(matrix.dtype, np.integer)
    ):
        raise MatrixError(f"embedding matrix must hold real numbers, got dtype {matrix.dtype}")
    x = matrix if isinstance(matrix, torch.Tensor) else torch.from_numpy(np.asarray(matrix))
    if x.ndim != 2:
        raise MatrixError(f"embedding matrix must be 2-D (V, d), got shape {tuple(x.shape)}")
    if x.is_complex() or x.dtype == torch.bool:
        raise MatrixError(f"embedding matrix must hold real numbers, got dtype {x.dtype}")
    return x.detach().cpu()


def _unit_blocks(
    x: torch.Tensor, chunk: int, device: torch.device | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per chunk of rows of (V, d) x: (keep mask (c,), float64 unit rows (c', d) of the kept rows).

    Norms are taken in float64; a row with nan/inf is refused (it is neither a zero row nor a direction).
    """
    for s in range(0, x.shape[0], chunk):
        rows = x[s : s + chunk].to(device=device, dtype=torch.float64)  # (c, d)
        bad = (~torch.isfinite(rows)).any(dim=1).nonzero().flatten()
        if len(bad):
            raise MatrixError(
                f"row {s + int(bad[0])} holds non-finite values (nan/inf), and "
                f"{len(bad) - 1} more row(s) among rows {s}..{s + len(rows) - 1}: the weights are "
                "damaged; measure an earlier checkpoint"
            )
        norms = rows.norm(dim=1)  # (c,)
        keep = norms > 0
        yield keep, rows[keep] / norms[keep, None]


def normalized_rows(matrix: torch.Tensor | np.ndarray, chunk: int = 16384) -> tuple[torch.Tensor, int]:
    """(V, d) -> (V', d) float32 unit rows with zero-norm rows dropped, and how many were dropped.

    Rows are normalised in float64 a chunk at a time, so memory stays ~ one float32 copy.
    """
    x = _as_matrix(matrix)
    parts = [u.to(torch.float32) for _, u in _unit_blocks(x, chunk)]
    out = torch.cat(parts) if parts else x.new_zeros((0, x.shape[1]), dtype=torch.float32)
    return out.contiguous(), x.shape[0] - out.shape[0]


def nonzero_rows(matrix: torch.Tensor | np.ndarray, chunk: int = 16384) -> torch.Tensor:
    """Indices (V',) of the rows with non-zero norm (non-finite rows refused)."""
    x = _as_matrix(matrix)
    masks = [keep for keep, _ in _unit_blocks(x, chunk)]
    return torch.cat(masks).nonzero().flatten() if masks else torch.zeros(0, dtype=torch.long)


class GramSums(NamedTuple):
    rows: int  # rows kept (non-zero norm)
    dropped: int
    s1: float  # sum_{i<j} c_ij
    s2: float  # sum_{i<j} c_ij^2
    kept: torch.Tensor  # (rows,) indices of the kept rows


def gram_sums(
    matrix: torch.Tensor | np.ndarray,
    block: int = 4096,
    rows_dtype: torch.dtype = torch.float64,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> GramSums:
    """Exact sums of c_ij and c_ij^2 over the pairs i < j of non-zero rows, in O(V d^2) float64.

    The rows are normalised in float64 a block at a time and, with `rows_dtype=torch.float32`, rounded
    to float32 (the rows the pair pass multiplies) before the float64 products. The identities
    subtract the actual sum_i |x_i|^2 and sum_i |x_i|^4 (n for exactly unit rows), so they hold for
    rounded rows too. Only the panels on and above the diagonal of X^T X are formed (it is symmetric),
    about 0.55 of the products at d = 4096.
    """
    x = _as_matrix(matrix)
    d = x.shape[1]
    dev = torch.device(device) if device is not None else torch.device("cpu")
    width = max(256, -(-d // 16))  # panel width
    panels = [
        (p, torch.zeros(min(width, d - p), d - p, dtype=torch.float64, device=dev))
        for p in range(0, d, width)
    ]  # rows p..p+w of X^T X, columns p..d
    total = torch.zeros(d, dtype=torch.float64, device=dev)  # sum_i x_i
    sq = torch.zeros((), dtype=torch.float64, device=dev)  # sum_i |x_i|^2
    quad = torch.zeros((), dtype=torch.float64, device=dev)  # sum_i |x_i|^4
    n, masks = 0, []
    with progress_bar(
        total=x.shape[0], desc="Gram rows", unit="row", unit_scale=True, disable=not progress
    ) as bar:
        for keep, u in _unit_blocks(x, block, dev):  # u: (b, d) float64
            if rows_dtype != torch.float64:
                u = u.to(rows_dtype).to(torch.float64)
            n += u.shape[0]
            masks.append(keep.cpu())
            total += u.sum(dim=0)
            norms2 = (u * u).sum(dim=1)  # (b,)
            sq += norms2.sum()
            quad += (norms2 * norms2).sum()
            for p, acc in panels:
                acc.addmm_(u[:, p : p + acc.shape[0]].T, u[:, p:])  # (w, d - p) += (w, b) @ (b, d - p)
            bar.update(len(keep))
    frob = sum(
        float(acc[:, : acc.shape[0]].square().sum()) + 2 * float(acc[:, acc.shape[0] :].square().sum())
        for _, acc in panels
    )  # |X^T X|_F^2
    s1 = (float(total @ total) - float(sq)) / 2
    s2 = (frob - float(quad)) / 2
    kept = torch.cat(masks).nonzero().flatten() if masks else torch.zeros(0, dtype=torch.long)
    return GramSums(n, x.shape[0] - n, s1, s2, kept)


def _moments(s1: float, s2: float, pairs: int) -> tuple[float, float]:
    """mu, sigma from the pair sums. sigma^2 = E[c^2] - mu^2 cancels: where sigma is ~0 (all rows
    parallel) it carries an absolute error up to ~sqrt(ulp * E[c^2]) ~ 1e-8; one pair has sigma 0."""
    mean = s1 / pairs
    if pairs == 1:
        return mean, 0.0
    return mean, math.sqrt(max(s2 / pairs - mean * mean, 0.0))


def gram_moments(
    matrix: torch.Tensor | np.ndarray, rows_dtype: torch.dtype = torch.float64
) -> tuple[float, float]:
    """Exact mu, sigma over all pairs of non-zero rows, from the Gram matrix (see `gram_sums`)."""
    n, _, s1, s2, _ = gram_sums(matrix, rows_dtype=rows_dtype)
    if n < 2:
        raise MatrixError(f"need at least 2 non-zero rows to measure pairwise cosines, got {n}")
    return _moments(s1, s2, n * (n - 1) // 2)


def _accumulate(
    x: torch.Tensor, block: int, bins: int, hist_stride: int, progress: bool
) -> tuple[float, float, torch.Tensor, int]:
    """One pass over the pair blocks of unit rows x (n, d): sum c, sum c^2, histogram, its pairs."""
    n, dev = x.shape[0], x.device
    s1 = s2 = 0.0  # float64 running sums of c and c^2
    counts = torch.zeros(bins, dtype=torch.float64, device=dev)
    zero_bin = int(torch.histc(torch.zeros(1, device=dev), bins=bins, min=-1.0, max=1.0).argmax())
    hist_pairs = 0
    starts = range(0, n, block)
    bar = progress_bar(
        total=n * (n - 1) // 2,
        desc="cosine pairs (histogram)",
        unit="pair",
        unit_scale=True,
        disable=not progress,
    )
    for i in starts:
        xi = x[i : i + block]  # (b, d)
        for j in starts[i // block :]:
            g = xi @ x[j : j + block].T  # (b, b') cosines
            if j == i:
                g.triu_(1)  # keep pairs i < j; the rest become 0.0
            s1 += float(g.sum(dim=1).double().sum())  # row sums in float32, total in float64
            s2 += float(torch.linalg.vector_norm(g, dim=1).double().square().sum())
            g.clamp_(-1.0, 1.0)  # rounding can exceed 1 by an ulp
            src = g if hist_stride == 1 else g[::hist_stride]
            counts += torch.histc(src, bins=bins, min=-1.0, max=1.0).to(torch.float64)
            n_src = src.numel()
            if j == i:  # remove the zeros triu_ put below the diagonal
                rows = torch.arange(0, g.shape[0], hist_stride)
                zeros = int((rows + 1).sum())  # row r holds r + 1 of them
                counts[zero_bin] -= zeros
                n_src -= zeros
            hist_pairs += n_src
            bar.update(g.shape[0] * (g.shape[0] - 1) // 2 if j == i else g.numel())
    bar.close()
    return s1, s2, counts, hist_pairs


def _pair_pass(
    x: torch.Tensor, block: int, bins: int, hist_stride: int, dev: torch.device, progress: bool
) -> tuple[float, float, torch.Tensor, int]:
    """The all-pairs pass over float32 unit rows x on `dev`, with TF32 off (it rounds cosines to ~1e-3)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return _accumulate(x.to(dev), block, bins, hist_stride, progress)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def cosine_stats(
    matrix: torch.Tensor | np.ndarray,
    block: int = 4096,
    bins: int = 2000,
    histogram: str = "sample",
    hist_rows: int = 10_000,
    sample: int | None = None,
    seed: int = 0,
    hist_stride: int | None = None,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> CosineStats:
    """Exact mu, sigma, eps of cos(row_i, row_j) over all i < j (or over `sample` seeded random rows).

    mu, sigma and eps always come from the Gram matrix (`gram_sums`). The histogram visits pairs:
    `histogram="sample"` those among `hist_rows` rows drawn with `seed` (all rows if there are no
    more), `"full"` every pair (its float32 eps is kept in `eps_pairs` as a cross-check), `"off"` none.
    `hist_stride` > 1 histograms every k-th row of each pair block (default `auto_hist_stride`).
    """
    if block < 1 or bins < 1 or (hist_stride is not None and hist_stride < 1):
        raise MatrixError(f"--block, bins and --hist-stride must be >= 1, got {block}, {bins}, {hist_stride}")
    if histogram not in HISTOGRAM_MODES:
        raise MatrixError(f"--histogram must be one of {', '.join(HISTOGRAM_MODES)}, got {histogram!r}")
    start = time.perf_counter()
    x = _as_matrix(matrix)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dropped = None
    if sample is not None:
        kept = nonzero_rows(x)
        if sample < len(kept):
            if sample < 2:
                raise MatrixError(f"--sample must be >= 2 rows, got {sample}")
            dropped = x.shape[0] - len(kept)
            x = x[kept[torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed))[:sample]]]
        else:
            sample = None
    n, dropped_here, s1, s2, kept = gram_sums(x, block, device=dev, progress=progress)
    dropped = dropped_here if dropped is None else dropped
    d = x.shape[1]
    if n < 2:
        raise MatrixError(
            f"need at least 2 non-zero rows to measure pairwise cosines, got {n} "
            f"(of {n + dropped} rows, {dropped} zero)"
        )
    pairs = n * (n - 1) // 2
    mean, std = _moments(s1, s2, pairs)
    gram_seconds = time.perf_counter() - start

    counts, hist_pairs, eps_pairs, stride, m, hist_seed = torch.zeros(bins), 0, None, 1, 0, None
    if histogram != "off":
        if histogram == "sample" and hist_rows < n:
            if hist_rows < 2:
                raise MatrixError(f"--hist-rows must be >= 2, got {hist_rows}")
            hist_seed = seed
            pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:hist_rows]
            u, _ = normalized_rows(x[kept[pick.sort().values]])  # (hist_rows, d) float32
        else:
            histogram = "full"
            u, _ = normalized_rows(x)  # (n, d) float32
        m = u.shape[0]
        stride = hist_stride or auto_hist_stride(m, d)
        p1, p2, counts, hist_pairs = _pair_pass(u, block, bins, stride, dev, progress)
        if histogram == "full":
            mu_p, sigma_p = _moments(p1, p2, pairs)
            eps_pairs = mu_p + 2 * sigma_p
    seconds = time.perf_counter() - start
    return CosineStats(
        rows=n,
        dropped_zero_rows=dropped,
        dim=d,
        pairs=pairs,
        mean=mean,
        std=std,
        eps=mean + 2 * std,
        hist_mode=histogram,
        hist_rows=m,
        hist_seed=hist_seed,
        hist_stride=stride,
        hist_edges=np.linspace(-1.0, 1.0, bins + 1),
        hist_counts=counts.cpu().numpy().round().astype(np.int64),
        hist_pairs=hist_pairs,
        eps_pairs=eps_pairs,
        sampled_rows=sample,
        seed=seed,
        seconds=seconds,
        gram_seconds=gram_seconds,
        hist_seconds=seconds - gram_seconds,
    )


def auto_hist_stride(rows: int, dim: int) -> int:
    """Histogram every k-th row, k = 4096 // d, once there are > 1e8 pairs: a histogram costs
    ~16 ns per value on a CPU and a product 2d flops, so this keeps it near 10% of the time
    while the plot still rests on > 1e7 pairs."""
    return max(1, 4096 // dim) if rows * (rows - 1) // 2 > 100_000_000 else 1
