"""Cross-entropy over vocabulary-parallel logits, without gathering the full vocabulary.

Each TP rank holds logits for its `V/tp` vocabulary rows. The max, the sum of
exponentials and the target's logit are each all-reduced over the TP group (three
`(B, S)`-sized collectives), so no rank ever holds `(B, S, V)` logits. The softmax
shard is kept for a closed-form backward: `grad = softmax - onehot(target)`.

Rows added to pad the vocabulary (to a multiple of `make_vocab_size_divisible_by x TP`)
are masked to -inf: they take no part in the softmax and get zero gradient, so the
loss is the same at every TP size and equals the exported model's (which drops them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lev.parallel.layout import ParallelLayout


def tp_all_reduce(x: torch.Tensor, layout: ParallelLayout, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`x` all-reduced in place over `layout`'s TP group (nothing at TP = 1); returns `x`."""
    if layout.tp > 1:
        dist.all_reduce(x, op=op, group=layout.tp_group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, vocab_size: int | None, layout: ParallelLayout
    ) -> torch.Tensor:
        # logits: (.., V/tp) this rank's shard; target: (..) global token ids; vocab_size: real rows
        rank = layout.tp_rank
        ctx.input_dtype = logits.dtype
        per = logits.shape[-1]
        start = rank * per
        logits = logits.float()  # the input is never modified in place below
        if vocab_size is not None and start + per > vocab_size:  # this shard holds padding rows
            padded = torch.arange(start, start + per, device=logits.device) >= vocab_size  # (V/tp,)
            logits = logits.masked_fill(padded, float("-inf"))
        logits_max = tp_all_reduce(logits.max(dim=-1).values, layout, op=dist.ReduceOp.MAX)  # (..)
        shifted = logits - logits_max.unsqueeze(-1)  # (.., V/tp)

        outside = (target < start) | (target >= start + per)  # (..) target row lives on another rank
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = tp_all_reduce(target_logit.masked_fill(outside, 0.0), layout)  # (..)

        exp = shifted.exp_()  # reuse the buffer: (.., V/tp)
        sum_exp = tp_all_reduce(exp.sum(dim=-1), layout)  # (..)
        loss = sum_exp.log() - target_logit  # (..) fp32

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()  # (.., V/tp)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (~outside).to(grad.dtype).unsqueeze(-1).neg())
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int | None = None,
    *,
    layout: ParallelLayout,
) -> torch.Tensor:
    """Per-token loss `(..)` in fp32 from this rank's logits `(.., V/tp)` and global target ids `(..)`.

    `vocab_size` is the real vocabulary (the tokenizer's): rows from it on are padding and
    are left out of the softmax; None treats every row as real. Targets must lie in
    `[0, vocab_size)` (no ignore index): mask the returned per-token loss instead. `layout`: the TP
    group the shards are spread over.
    """
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits_shard.shape)} and target {tuple(target.shape)} disagree: "
            "expected logits (.., V/tp) and target (..)"
        )
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, vocab_size, layout)
