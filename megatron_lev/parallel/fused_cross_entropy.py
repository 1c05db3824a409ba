"""The output head's matmul and the vocabulary-parallel cross-entropy in one function, chunked over
tokens, so no rank ever holds `(B, S, V/tp)` logits.

    mean, losses = fused_linear_cross_entropy(hidden (N, D), weight (V/tp, D), target (N,),
                                              vocab_size, layout, loss_mask (N,) or None)

For each chunk of `chunk_tokens` tokens: the chunk's logits `(c, V/tp)` (one buffer, in fp32), the
max, the target's logit and the sum of exponentials all-reduced over the TP group (as
`parallel.cross_entropy` does for whole logits), the per-token loss, and, when a gradient is wanted,
the chunk's softmax turned in place into `d mean / d logits` and multiplied into the gradients of the
hidden states `(c, D)` and of this rank's head rows `(V/tp, D)`. Then the buffer is dropped: what
lives from the forward to the backward is those two gradients, not the logits.

The gradients are those of the one scalar it returns, the masked mean (`model.loss.masked_mean`:
over the tokens `loss_mask` keeps, or all of them), computed in the same order as the unfused path,
so the backward only scales them by the upstream gradient (the engine's loss scale and 1 / gradient
accumulation steps). The per-token losses come back too, detached: for logging and evaluation.

Rows beyond `vocab_size` (the padding of `model.make_vocab_size_divisible_by x TP`) are set to -inf
in the chunk's own buffer (no copy); they take no part in the softmax and get no gradient.

The hidden state is replicated over TP ranks: the caller passes it through
`copy_to_tensor_parallel_region`, whose backward sums its gradient over the vocabulary shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lev.parallel.cross_entropy import tp_all_reduce
from megatron_lev.parallel.layout import ParallelLayout

CHUNK_BYTES = 256 << 20  # one chunk's fp32 logits, when the chunk size is not given


def chunk_tokens_for(rows: int, tokens: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits `(c, rows)` take about `chunk_bytes`."""
    return max(1, min(tokens, chunk_bytes // (4 * max(rows, 1))))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, loss_mask, vocab_size, layout, chunk, grad_enabled):
        # hidden (N, D); weight (V/tp, D) this rank's rows; target (N,) global ids; loss_mask (N,) or None
        n = hidden.shape[0]
        per = weight.shape[0]
        start = layout.tp_rank * per
        pad_from = None if vocab_size is None or start + per <= vocab_size else max(vocab_size - start, 0)
        # needs_input_grad says what requires grad, also under no_grad: evaluation computes no gradient
        want_h, want_w = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        outside = (target < start) | (target >= start + per)  # (N,) the target row is on another rank
        local_target = (target - start).masked_fill(outside, 0)
        # d mean / d loss_t, as masked_mean's backward gives it
        if loss_mask is None:
            count = torch.tensor(float(max(n, 1)), device=hidden.device)
            token_weight = None
        else:
            mask = loss_mask.float()
            count = mask.sum().clamp(min=1.0)
            token_weight = mask / count  # (N,)
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            h = hidden[lo:hi]
            logits = (h @ weight.t()).float()  # (c, V/tp), this chunk's own buffer
            if pad_from is not None:
                logits[:, pad_from:] = float("-inf")
            logits_max = tp_all_reduce(logits.max(dim=-1).values, layout, op=dist.ReduceOp.MAX)  # (c,)
            logits.sub_(logits_max.unsqueeze(-1))
            out, tgt = outside[lo:hi], local_target[lo:hi]
            target_logit = logits.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).masked_fill(out, 0.0)
            target_logit = tp_all_reduce(target_logit, layout)  # (c,)
            exp = logits.exp_()
            sum_exp = tp_all_reduce(exp.sum(dim=-1), layout)  # (c,)
            losses[lo:hi] = sum_exp.log() - target_logit
            if not (want_h or want_w):
                del logits, exp  # free this chunk's buffer before the next one is made
                continue
            grad = exp.div_(sum_exp.unsqueeze(-1))  # softmax, then minus the one-hot target
            grad.scatter_add_(-1, tgt.unsqueeze(-1), (~out).to(grad.dtype).unsqueeze(-1).neg())
            if token_weight is None:
                grad.div_(count)
            else:
                grad.mul_(token_weight[lo:hi].unsqueeze(-1))
            grad = grad.to(weight.dtype)  # (c, V/tp) d mean / d logits
            if want_h:
                grad_hidden[lo:hi] = grad @ weight
            if want_w and grad.dtype == grad_weight.dtype:
                grad_weight.addmm_(grad.t(), h)  # (V/tp, D), accumulated in place
            elif want_w:
                grad_weight.add_(grad.t() @ h)  # half precision: summed in fp32
            del logits, exp, grad  # free this chunk's buffer before the next one is made
        mean = losses.mean() if loss_mask is None else (losses * loss_mask.to(losses.dtype)).sum() / count
        # kept as attributes, not saved tensors: neither is an input or output, and the backward scales
        # them in place and hands them on (no second copy of the head's gradient)
        ctx.grads = [grad_hidden, grad_weight.to(weight.dtype) if want_w else None]
        ctx.mark_non_differentiable(losses)
        return mean, losses

    @staticmethod
    def backward(ctx, grad_mean, _grad_losses):
        if ctx.grads is None:
            raise RuntimeError(
                "the fused cross-entropy's backward ran twice: its gradients were handed on the first "
                "time (retain_graph is not supported; set model.fused_loss=false for that)"
            )
        grads, ctx.grads = ctx.grads, None
        for g in grads:
            if g is not None:
                g.mul_(grad_mean.to(g.dtype))  # the upstream scale: loss scale, 1 / accumulation steps
        return grads[0], grads[1], None, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int | None = None,
    *,
    layout: ParallelLayout,
    loss_mask: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(mean (), losses (..))`: the masked mean loss (fp32, differentiable) and the per-token losses
    (fp32, detached) of `hidden (.., D) @ weight (V/tp, D).T` against global ids `target (..)`.

    `vocab_size`: the real vocabulary (rows from it on are padding; None: every row is real).
    `loss_mask (..)`: the tokens the mean keeps (None: all). `chunk_tokens`: tokens per chunk (None:
    `chunk_tokens_for`). `hidden` must already be in the TP region (`copy_to_tensor_parallel_region`).
    """
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree: "
            "expected hidden (.., D) and target (..)"
        )
    if loss_mask is not None and loss_mask.shape != target.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and target {tuple(target.shape)} disagree")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    shape = target.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    n = flat_hidden.shape[0]
    chunk = chunk_tokens or chunk_tokens_for(weight.shape[0], n)
    flat_mask = None if loss_mask is None else loss_mask.reshape(-1)
    mean, losses = _FusedLinearCrossEntropy.apply(
        flat_hidden,
        weight,
        target.reshape(-1),
        flat_mask,
        vocab_size,
        layout,
        max(int(chunk), 1),
        torch.is_grad_enabled(),
    )
    return mean, losses.view(shape)
