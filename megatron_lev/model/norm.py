"""RMSNorm (Llama): `x / rms(x) * weight`, computed in fp32 and cast back."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))  # replicated across TP ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (.., D) -> (.., D)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight.to(x.dtype)
