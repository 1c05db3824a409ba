"""Shape statistics of an embedding matrix `(rows, d)`, as device tensors (no host read).

    effective_rank(x)     exp(H), H the Shannon entropy of the singular values normalised to sum 1
    mean_row_ratio(x)     |mean_i x_i| / mean_i |x_i|   (0: rows spread in all directions; 1: all equal)
    rms(x)                sqrt(mean of x^2)

The one definition of each: `megatron-lev geometry` (`analysis.geometry`, over a checkpoint's
whole table) and the training loop's dynamics (`training.dynamics`, over a fixed sample of rows
at every log line) both call these, so their numbers agree on the same rows. Everything is in
float64 on the matrix's own device.
"""

from __future__ import annotations

import torch


def gram_singular_values(matrix: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """The singular values of `matrix (n, d)` in float64, from the smaller of the two Gram matrices
    (`d x d` summed over row chunks, or `n x n` when there are fewer rows than columns)."""
    n, d = matrix.shape
    if n < d:
        x = matrix.to(torch.float64)
        gram = x @ x.T
    else:
        gram = torch.zeros(d, d, dtype=torch.float64, device=matrix.device)
        for s in range(0, n, chunk):
            x = matrix[s : s + chunk].to(torch.float64)
            gram.addmm_(x.T, x)
    return torch.linalg.eigvalsh(gram).clamp(min=0.0).sqrt()


def effective_rank(matrix: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """`exp(-sum p log p)`, p the singular values of `matrix (n, d)` over their sum (Roy & Vetterli,
    2007); 0 for a zero matrix. A float64 scalar tensor on the matrix's device."""
    sv = gram_singular_values(matrix, chunk)
    total = sv.sum()
    p = sv / torch.where(total > 0, total, torch.ones_like(total))
    entropy = -torch.where(p > 0, p * p.clamp(min=torch.finfo(p.dtype).tiny).log(), torch.zeros_like(p)).sum()
    return torch.where(total > 0, entropy.exp(), torch.zeros_like(total))


def mean_row_ratio(matrix: torch.Tensor) -> torch.Tensor:
    """`|mean_i x_i| / mean_i |x_i|` in float64 (0 for a zero matrix); a scalar tensor."""
    x = matrix.to(torch.float64)
    norms = x.norm(dim=1).mean()
    ratio = x.mean(dim=0).norm() / torch.where(norms > 0, norms, torch.ones_like(norms))
    return torch.where(norms > 0, ratio, torch.zeros_like(ratio))


def rms(matrix: torch.Tensor) -> torch.Tensor:
    """Root mean square of every element, in float64; a scalar tensor."""
    return matrix.to(torch.float64).square().mean().sqrt()


__all__ = ["effective_rank", "gram_singular_values", "mean_row_ratio", "rms"]
