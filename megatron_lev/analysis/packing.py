"""The packing simulation that produced the capacity constants (CAPACITY.md).

Random packing: k Gaussian unit vectors in d dims, eps* = min over trials of max |cos|.
Optimised packing: Adam on a (d, k) matrix with unit columns, minimising sum |G - I|^p.
"""

from __future__ import annotations

import math
import time

import torch

from megatron_lev.utils.progress import progress_bar

# (d values, k values) per named sweep; "full" is the paper's grid and wants a GPU.
SWEEPS = {
    "small": ((16, 32, 64, 128), (128, 256)),
    "full": (
        (32, 64, 128, 256, 512, 1024, 1536, 2048, 2560, 3072, 3584, 4096),
        (2000, 4000, 8000, 16000, 24000, 32000),
    ),
}


def packing_exponent(d: int, k: int) -> int:
    """p = min(floor(m / ln d), 20), m = 40 if k <= 4000, 50 if d >= 3072, else 60."""
    m = 40 if k <= 4000 else (50 if d >= 3072 else 60)
    return min(math.floor(m / math.log(d)), 20)


def _max_offdiag(gram: torch.Tensor) -> float:
    off = gram - torch.diag_embed(torch.diagonal(gram))  # (k, k), zero diagonal
    return float(off.abs().max())


def random_packing(d: int, k: int, trials: int = 5, seed: int = 0, device: str = "cpu") -> float:
    """min over trials of max |cos| among k random Gaussian unit vectors in R^d."""
    gen = torch.Generator(device=device).manual_seed(seed)
    best = math.inf
    for _ in range(trials):
        v = torch.randn(d, k, generator=gen, device=device)
        v = v / v.norm(dim=0, keepdim=True)  # (d, k) unit columns
        best = min(best, _max_offdiag(v.T @ v))
    return best


def optimized_packing(
    d: int, k: int, steps: int = 5000, lr: float | None = None, seed: int = 0, device: str = "cpu"
) -> float:
    """eps* = max |G_ij|, i != j, after Adam on sum |G - I|^p with columns kept unit-norm."""
    gen = torch.Generator(device=device).manual_seed(seed)
    v = torch.randn(d, k, generator=gen, device=device)
    v = (v / v.norm(dim=0, keepdim=True)).requires_grad_(True)  # (d, k)
    lr = lr if lr is not None else (0.005 if d <= 1024 else 0.0025)
    p = packing_exponent(d, k)
    eye = torch.eye(k, device=device)
    opt = torch.optim.Adam([v], lr=lr)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (v.T @ v - eye).abs().pow(p).sum()
        loss.backward()
        opt.step()
        with torch.no_grad():
            v /= v.norm(dim=0, keepdim=True)
    with torch.no_grad():
        return _max_offdiag(v.T @ v)


def run_sweep(ds, ks, steps: int = 5000, trials: int = 5, device: str = "cpu", seed: int = 0) -> dict:
    """Both packings over the (d, k) grid; rows [k, d, eps*] like the paper's files."""
    grid = [(d, k) for d in ds for k in ks]
    rand_rows, opt_rows = [], []
    start = time.perf_counter()
    for d, k in progress_bar(grid, desc="packing (d, k)", unit="pt"):
        rand_rows.append([k, d, random_packing(d, k, trials, seed, device)])
        opt_rows.append([k, d, optimized_packing(d, k, steps, seed=seed, device=device)])
    return {
        "random": rand_rows,
        "optimized": opt_rows,
        "steps": steps,
        "trials": trials,
        "device": str(device),
        "seconds": time.perf_counter() - start,
    }
