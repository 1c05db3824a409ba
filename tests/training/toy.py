"""A two-layer language model with the GPTModel call signature, for engine-level tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ToyLM(nn.Module):
    """`forward(input_ids, labels)` -> per-token loss `(B, S)` fp32, like `GPTModel`."""

    def __init__(self, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.norm(self.embed(input_ids)))  # (B, S, V)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def toy_batches(seed: int, micro_batch: int, seq: int, vocab: int = 64, start: int = 0):
    """Deterministic `(input_ids, labels)` micro-batches; `start` skips that many."""
    g = torch.Generator().manual_seed(seed)
    i = 0
    while True:
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
        if i >= start:
            yield tokens[:, :-1], tokens[:, 1:]
        i += 1
