"""The loss of one micro-batch, as the engine computes it for a training or evaluation step."""

from __future__ import annotations

import torch

from megatron_lev.data.batches import MicroBatch


def micro_batch_loss(model, batch: tuple[torch.Tensor, torch.Tensor] | MicroBatch) -> torch.Tensor:
    """The mean per-token loss `()` (fp32) of one micro-batch; with a loss mask, over the tokens it keeps.

    The step averages these means over micro-batches and data-parallel ranks with equal weights
    (as Megatron-LM and GPT-NeoX do), so a token's weight depends slightly on how many targets its
    micro-batch masks.

    The model returns the masked mean itself (`reduction="mean"`): with `model.fused_loss` its head
    and loss run fused, and otherwise it is `model.loss.masked_mean` of the per-token losses, what a
    pipeline's `loss_fn` (`engine.pipeline.pipeline_loss`) computes.
    """
    if not isinstance(batch, MicroBatch):
        input_ids, labels = batch
        return model(input_ids, labels=labels, reduction="mean")  # ()
    return model(
        batch.input_ids,
        labels=batch.labels,
        position_ids=batch.position_ids,
        document_ids=batch.document_ids,
        loss_mask=batch.loss_mask,
        reduction="mean",
    )  # ()
