"""Causal self-attention with heads split across tensor-parallel ranks.

Fused QKV layout (column-parallel, `partition_dim` 0): the full weight is
`[Wq (H*hd, D); Wk (KV*hd, D); Wv (KV*hd, D)]`; TP rank r holds
`[Wq rows of heads r*H/tp..(r+1)*H/tp ; Wk rows of its KV/tp heads ; Wv likewise]`,
i.e. its slice of each of the three parts, concatenated. The output projection
`(D, H*hd)` is row-parallel (split along its input columns, the heads).

With `documents` (see `model.documents`), RoPE takes per-token positions and attention stays
inside each packed document: flash-attn's variable-length kernel on CUDA, else a block-diagonal
causal mask with `scaled_dot_product_attention`.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.config import ModelConfig
from megatron_lev.model.documents import Documents
from megatron_lev.model.rotary import RotaryEmbedding, apply_rotary
from megatron_lev.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.random import RNGStatesTracker

try:  # optional, CUDA only
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = flash_attn_varlen_func = None


def use_flash_attention(x: torch.Tensor) -> bool:
    """flash-attn runs only on CUDA tensors in bf16/fp16; everything else takes SDPA."""
    return flash_attn_func is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


class ParallelAttention(nn.Module):
    """`rng` is the model's tracker (`parallel.random.tp_rng_tracker`): attention dropout draws from its
    model-parallel stream, which differs between TP ranks. Without one (a lone module) dropout draws
    from the default stream."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_layers_for_init: int,
        layout: ParallelLayout = SINGLE,
        rng: RNGStatesTracker | None = None,
    ):
        super().__init__()
        self.rng = rng
        tp = layout.tp
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.local_heads, self.local_kv_heads = self.num_heads // tp, self.num_kv_heads // tp
        self.dropout = cfg.attention_dropout
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, q + 2 * kv, part_sizes=(q, kv, kv), init_std=cfg.init_std, layout=layout
        )
        # output projections are scaled down with depth (GPT-2 / Megatron)
        self.dense = RowParallelLinear(
            q, cfg.hidden_size, init_std=cfg.init_std / math.sqrt(2 * num_layers_for_init), layout=layout
        )
        self.rotary = RotaryEmbedding(self.head_dim, cfg.rope_theta)
        # selective recompute, set from outside (`engine.recompute`): a `checkpointed(fn, *args)` that
        # runs the attention core without keeping its activations, recomputing it in backward
        self.recompute_core = None

    def forward(
        self, x: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:  # (B, S, D) -> (B, S, D)
        b, s, _ = x.shape
        hd = self.head_dim
        qkv = self.qkv(x)  # (B, S, (H/tp + 2 KV/tp) * hd)
        q, k, v = qkv.split(
            [self.local_heads * hd, self.local_kv_heads * hd, self.local_kv_heads * hd], dim=-1
        )
        q = q.view(b, s, self.local_heads, hd)
        k = k.view(b, s, self.local_kv_heads, hd)
        v = v.view(b, s, self.local_kv_heads, hd)
        cos, sin = self.rotary(s, x.device, q.dtype)  # (S, hd)
        if documents is not None and documents.position_ids is not None:
            cos, sin = (
                cos[documents.position_ids],
                sin[documents.position_ids],
            )  # (B, S, hd): restart per document
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute_core is not None and self.training and torch.is_grad_enabled():
            out = self.recompute_core(self._core, q, k, v, documents)
        else:
            out = self._core(q, k, v, documents)
        return self.dense(out.reshape(b, s, self.local_heads * hd))

    def _core(self, q, k, v, documents: Documents | None) -> torch.Tensor:
        """Scores, softmax (dropout) and the weighted values: `q (B, S, H/tp, hd)`, `k`, `v (B, S,
        KV/tp, hd)` -> `(B, S, H/tp, hd)`; what selective recompute recomputes."""
        b, s, _, hd = q.shape
        separate = documents is not None and documents.separate_attention
        p = self.dropout if self.training else 0.0
        with (
            self.rng.fork() if p > 0 and self.rng is not None else contextlib.nullcontext()
        ):  # dropout on this rank's own heads
            if use_flash_attention(q) and separate:
                cu, longest = documents.cu_seqlens()  # every document of every row, end to end
                out = flash_attn_varlen_func(
                    q.reshape(b * s, self.local_heads, hd),
                    k.reshape(b * s, self.local_kv_heads, hd),
                    v.reshape(b * s, self.local_kv_heads, hd),
                    cu,
                    cu,
                    longest,
                    longest,
                    dropout_p=p,
                    causal=True,
                ).view(b, s, self.local_heads, hd)  # (B*S, H/tp, hd) -> (B, S, H/tp, hd)
            elif use_flash_attention(q):
                out = flash_attn_func(q, k, v, dropout_p=p, causal=True)  # (B, S, H/tp, hd), GQA native
            else:
                mask = documents.attention_mask() if separate else None  # (B, 1, S, S) bool
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    attn_mask=mask,
                    dropout_p=p,
                    is_causal=mask is None,
                    enable_gqa=self.local_kv_heads != self.local_heads,
                ).transpose(1, 2)  # (B, S, H/tp, hd)
        return out
