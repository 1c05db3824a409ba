"""The language-model loss, written once for the plain model, the pipeline and the engine.

    logits (B, S, V/tp), labels (B, S)   --token_losses-->   per-token loss (B, S) fp32
    per-token loss, loss_mask (B, S)     --masked_mean--->   mean over the kept tokens ()
    lm_loss = masked_mean(token_losses(...))

`GPTModel(input_ids, labels)` returns `token_losses`, and `engine.loss.micro_batch_loss` takes
their `masked_mean`; a pipeline's last stage holds only logits, so its `loss_fn` is `lm_loss`.
Both paths run the same operations in the same order, so they give the same numbers.

The cross-entropy is vocabulary-parallel (`parallel.cross_entropy`): no rank gathers the
vocabulary, and the rows that pad it (beyond the real `vocab_size`) are left out of the softmax.
"""

from __future__ import annotations

import torch

from megatron_lev.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lev.parallel.layout import ParallelLayout


def real_vocab_size(padded_vocab_size: int, true_vocab_size: int | None = None) -> int:
    """The vocabulary the loss keeps: `true_vocab_size` (the tokenizer's), or all padded rows when None."""
    if true_vocab_size is None:
        return padded_vocab_size
    if not 0 < true_vocab_size <= padded_vocab_size:
        raise ValueError(
            f"true vocabulary size {true_vocab_size} must be in [1, {padded_vocab_size}] (the padded size)"
        )
    return true_vocab_size


def token_losses(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None, *, layout: ParallelLayout
) -> torch.Tensor:
    """Per-token loss `(B, S)` fp32 from this rank's logits `(B, S, V/tp)` and labels `(B, S)`.

    `vocab_size`: the real vocabulary; the padding rows beyond it are left out of the softmax
    (None: every row is real). `layout`: the TP group the vocabulary is split over.
    """
    return vocab_parallel_cross_entropy(logits, labels, vocab_size, layout=layout)


def masked_mean(losses: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of per-token `losses (B, S)` over the tokens `loss_mask (B, S)` keeps (all of them when None).

    With a mask this is `sum(loss * mask) / sum(mask)` over the micro-batch (Megatron-LM's and
    GPT-NeoX's per-micro-batch average); a micro-batch whose every target is masked gives 0.
    """
    losses = losses.float()
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    loss_mask: torch.Tensor | None = None,
    *,
    layout: ParallelLayout,
) -> torch.Tensor:
    """The mean per-token loss `()` (fp32) of logits `(B, S, V/tp)`, over the tokens `loss_mask` keeps."""
    return masked_mean(token_losses(logits, labels, vocab_size, layout=layout), loss_mask)
