"""The loss of one micro-batch, as the engine computes it for a training or evaluation step."""

from __future__ import annotations

import torch

from megatron_lev.data.batches import MicroBatch
from megatron_lev.model.loss import masked_mean


def micro_batch_loss(model, batch: tuple[torch.Tensor, torch.Tensor] | MicroBatch) -> torch.Tensor:
    """The mean per-token loss `()` (fp32) of one micro-batch; with a loss mask, over the tokens it keeps.

    The step averages these means over micro-batches and data-parallel ranks with equal weights
    (as Megatron-LM and GPT-NeoX do), so a token's weight depends slightly on how many targets its
    micro-batch masks.

    The model returns the per-token losses (`model.loss.token_losses`); their `masked_mean` here is
    what a pipeline's `loss_fn` (`model.loss.lm_loss`) computes.
    """
    if not isinstance(batch, MicroBatch):
        input_ids, labels = batch
        return masked_mean(model(input_ids, labels=labels))  # (B, S) per-token -> ()
    losses = model(
        batch.input_ids, labels=batch.labels, position_ids=batch.position_ids, document_ids=batch.document_ids
    )  # (B, S)
    return masked_mean(losses, batch.loss_mask)
