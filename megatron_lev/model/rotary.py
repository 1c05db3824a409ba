"""Rotary position embedding in the "rotate half" convention of Hugging Face's Llama.

Using the same convention means exported q/k projection weights need no permutation.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for head width `head_dim`, cached per (sequence length, device, dtype)."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head width, got {head_dim}")
        self.head_dim, self.theta = head_dim, theta
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device), dtype)
        if key not in self._cache:
            inv_freq = 1.0 / (
                self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
            )
            freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (S, hd/2)
            angles = torch.cat([freqs, freqs], dim=-1)  # (S, hd)
            self._cache = {key: (angles.cos().to(device, dtype), angles.sin().to(device, dtype))}
        return self._cache[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x (B, S, H, hd)` by position; `cos`, `sin` are `(S, hd)`, or `(B, S, hd)` for per-row
    positions."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (S, 1, hd) or (B, S, 1, hd): broadcast over heads
    return x * cos + _rotate_half(x) * sin
