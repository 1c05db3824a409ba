"""Several documents packed in one sequence: their positions, and attention that stays inside each.

The model does not know the tokenizer: it receives `position_ids` (RoPE positions, restarting at
each document) and/or `document_ids` (the document index of every token in its row) made by the
data side (`data.boundaries`). Attention then sees a block-diagonal causal pattern:

    scaled_dot_product_attention   boolean mask (B, 1, S, S): causal and same document
    flash-attn (CUDA)              flash_attn_varlen_func over the documents of all rows, laid end to end:
                                   cu_seqlens = [0, end of document 1, end of document 2, ..., B * S]
"""

from __future__ import annotations

import torch


class Documents:
    """The document layout of one micro-batch; masks and boundaries are built once and shared by all
    layers."""

    def __init__(self, position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None):
        self.position_ids = position_ids  # (B, S) int64 or None: positions 0..S-1 of every row
        self.document_ids = document_ids  # (B, S) int64 or None: attention crosses documents (plain causal)
        self._mask: torch.Tensor | None = None
        self._cu_seqlens: tuple[torch.Tensor, int] | None = None

    @property
    def separate_attention(self) -> bool:
        return self.document_ids is not None

    def attention_mask(self) -> torch.Tensor:
        """(B, 1, S, S) bool, True where query i may attend to key j (j <= i, same document)."""
        if self._mask is None:
            self._mask = block_causal_mask(self.document_ids)
        return self._mask

    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """flash-attn's varlen arguments: cumulative document lengths (int32) and the longest document."""
        if self._cu_seqlens is None:
            self._cu_seqlens = cu_seqlens(self.document_ids)
        return self._cu_seqlens


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """`(B, S)` document ids -> `(B, 1, S, S)` bool: causal, and no attention across documents."""
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()  # (S, S)
    same = document_ids[:, :, None] == document_ids[:, None, :]  # (B, S, S)
    return (same & causal)[:, None]


def cu_seqlens(document_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Boundaries of every document of every row in the flattened `(B * S)` token order.

    Returns `cu_seqlens` (N + 1,) int32 (starts of the N documents, then B * S) and `max_seqlen`, the
    longest document (a Python int, as flash-attn sizes its grid and buffers by it). The host waits
    for the device once, at `nonzero` (its size); reading the maximum right after costs only a copy.
    """
    b, s = document_ids.shape
    starts = torch.ones_like(document_ids, dtype=torch.bool)  # (B, S): a row's first token starts a document
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = starts.reshape(-1).nonzero().reshape(-1)  # (N,) flattened start index of each document
    end = torch.full((1,), b * s, dtype=first.dtype, device=first.device)
    cu = torch.cat([first, end]).to(torch.int32)  # (N + 1,)
    return cu, int((cu[1:] - cu[:-1]).max())


_last: tuple | None = None  # (position_ids, document_ids, Documents) of the latest call


def documents_for(position_ids: torch.Tensor | None, document_ids: torch.Tensor | None) -> Documents:
    """A `Documents` for these tensors, reused while the same tensor objects come back.

    A pipeline stage receives the tensors afresh with every micro-batch and hands the same objects
    from layer to layer, so the mask (and flash-attn's one synchronisation) is built once per stage.
    """
    global _last
    if _last is not None and _last[0] is position_ids and _last[1] is document_ids:
        return _last[2]
    docs = Documents(position_ids, document_ids)
    _last = (position_ids, document_ids, docs)
    return docs
