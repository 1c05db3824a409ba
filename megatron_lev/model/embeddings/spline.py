"""Normalised quadratic B-spline basis on `kappa` uniform knots over [0, 1] (spec: LEV.md, step 4).

Knots `g_m = m / (kappa - 1)`; with `x = (kappa - 1) * u` the raw basis is
`beta(x - m)`. Only the 3 knots nearest to `x` can be non-zero, so the LEV layer
works with `active_basis` (3 indices and 3 weights per coordinate) instead of
the dense `kappa`-wide basis; `spline_basis` is the dense form, for reference.
"""

from __future__ import annotations

import torch


def quadratic_bspline(t: torch.Tensor) -> torch.Tensor:
    """The centred quadratic B-spline `beta(t)`: 0.75 - t^2, 0.5 (1.5 - |t|)^2, or 0."""
    a = t.abs()
    inner = 0.75 - t * t
    outer = 0.5 * (1.5 - a).clamp(min=0.0) ** 2
    return torch.where(a < 0.5, inner, outer)


def active_basis(u: torch.Tensor, kappa: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 3 possibly non-zero basis functions at each `u` in [0, 1].

    Returns `(index, weight)`, both `u.shape + (3,)`: knot indices in [0, kappa) and
    normalised weights that sum to 1. Knots that fall outside the grid get weight 0
    (their index is clamped so it can still be gathered).
    """
    x = u * (kappa - 1)  # (...,)
    centre = torch.floor(x.detach() + 0.5).clamp(0, kappa - 1)
    f = x - centre  # offset from the nearest knot, in [-0.5, 0.5] (up to the clamp at the ends)
    # beta(f + 1), beta(f), beta(f - 1) in closed form on that interval: no abs/where passes
    raw = torch.stack((0.5 * (0.5 - f) ** 2, 0.75 - f * f, 0.5 * (0.5 + f) ** 2), dim=-1)  # (..., 3)
    index = centre.long().unsqueeze(-1) + torch.arange(-1, 2, device=u.device)  # (..., 3)
    raw = raw * ((index >= 0) & (index < kappa))
    weight = raw / raw.sum(dim=-1, keepdim=True)  # the raw sum is >= 0.875 on [0, 1]
    return index.clamp(0, kappa - 1), weight


def spline_basis(u: torch.Tensor, kappa: int) -> torch.Tensor:
    """The dense normalised basis `B_m(u)`, shape `u.shape + (kappa,)`."""
    x = u * (kappa - 1)
    grid = torch.arange(kappa, device=u.device, dtype=x.dtype)
    raw = quadratic_bspline(x.unsqueeze(-1) - grid)  # (..., kappa)
    return raw / raw.sum(dim=-1, keepdim=True)
