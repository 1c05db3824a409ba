"""Document boundaries inside packed samples, found from the tokenizer's end-of-document id.

A training sample spans `S + 1` tokens across document boundaries (Megatron's scheme).
Three options, each off by default (`data.reset_position_ids`, `data.reset_attention_mask`,
`data.eod_mask_loss`), treat the documents of a sample as separate sequences, with the
semantics of Megatron-LM and GPT-NeoX: an EOD token ends its document (it still belongs to
it), and the token after it starts the next one.

    input ids   a  b  E  c  d  E  e        (E = EOD)
    documents   0  0  0  1  1  1  2
    positions   0  1  2  0  1  2  0
    loss mask   1  1  0  1  1  0  1        (the target after an EOD is the next document's first token)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentLayout:
    """What a run does at document boundaries, and the EOD id of its tokenizer."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @classmethod
    def from_config(cls, data_cfg, eod: int) -> DocumentLayout | None:
        """The layout of `data_cfg` (a `DataConfig`), or None when every option is off."""
        layout = cls(
            int(eod), data_cfg.reset_position_ids, data_cfg.reset_attention_mask, data_cfg.eod_mask_loss
        )
        return layout if layout.active else None

    @property
    def active(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss

    def __call__(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """`position_ids`, `document_ids` (int64) and `loss_mask` (float32), each `(B, S)` or None when
        off."""
        position_ids, document_ids = document_positions(input_ids, self.eod)
        return {
            "position_ids": position_ids if self.reset_position_ids else None,
            "document_ids": document_ids if self.reset_attention_mask else None,
            "loss_mask": (input_ids != self.eod).float() if self.eod_mask_loss else None,
        }


def document_positions(input_ids: torch.Tensor, eod: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position within its document and document index within its row of every token, both `(B, S)` int64.

    Fixed-shape tensor operations only (no host synchronisation on an accelerator).
    """
    b, s = input_ids.shape
    is_eod = input_ids == eod  # (B, S)
    starts = torch.ones_like(is_eod)
    starts[:, 1:] = is_eod[:, :-1]  # a document starts at the row's first token and after every EOD
    document_ids = starts.long().cumsum(dim=1) - 1  # (B, S): 0, 0, 0, 1, 1, ...
    index = torch.arange(s, device=input_ids.device).expand(b, s)
    first = (
        torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    )  # start of each token's document
    return index - first, document_ids
