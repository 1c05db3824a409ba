"""The LEV layer: token id -> compositional seed -> per-head separable spline -> `(B, S, D)`.

Spec: LEV.md, "The LEV layer, exactly". Efficiency: `G` is computed only for the
unique ids of the batch, in chunks, and the separable product never stores
`[tokens, h, d_seed, r]` activations: it sums logs over blocks of coordinates in
forward and recomputes them in backward. With `recompute` the per-chunk basis
(projection, LayerNorm, sigmoid) is checkpointed as well.
Tensor parallel: the heads are split across TP ranks; codebooks are replicated.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_lev.config import ConfigError, LevConfig, ModelConfig
from megatron_lev.model.embeddings.base import InputEmbedding, check_token_ids
from megatron_lev.model.embeddings.spline import active_basis
from megatron_lev.parallel import state
from megatron_lev.parallel.layers import init_sharded_
from megatron_lev.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region

LOG_EPS = 1e-9  # log(|phi| + eps): keeps a zero factor finite
LN_EPS = 1e-5
DELTA_INIT_STD = 0.1
# phi elements materialised at once inside the separable product: cache-sized on CPU,
# larger on GPUs so that a chunk needs few kernel launches (~64 MB fp32 temporaries)
_BLOCK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 24}


def digit_base(vocab_size: int, k: int) -> int:
    """Smallest integer `b` with `b ** k >= vocab_size` (= ceil(V ** (1/k)), exactly, in integers)."""
    if vocab_size < 1 or k < 1:
        raise ValueError(f"need vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
    b = max(1, int(round(vocab_size ** (1.0 / k))))
    while b ** k < vocab_size:
        b += 1
    while b > 1 and (b - 1) ** k >= vocab_size:
        b -= 1
    return b


def token_digits(ids: torch.Tensor, base: int, k: int) -> torch.Tensor:
    """Compositional index: `(...,)` ids -> `(..., k)` digits, `i_j = (i // b**j) % b`."""
    powers = base ** torch.arange(k, device=ids.device, dtype=torch.int64)
    return (ids.long().unsqueeze(-1) // powers) % base


class Codebooks(nn.Module):
    """`k` shared codebooks `C_j (b x d_seed)`; the seed of token i is `z(i) = sum_j C_j[i_j]`."""

    def __init__(self, vocab_size: int, k: int, d_seed: int, init_std: float):
        super().__init__()
        self.k, self.base = k, digit_base(vocab_size, k)
        self.weight = nn.Parameter(torch.empty(k * self.base, d_seed))  # rows of C_0, then C_1, ...
        nn.init.normal_(self.weight, mean=0.0, std=init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, d_seed)
        digits = token_digits(ids, self.base, self.k)  # (N, k)
        offsets = torch.arange(self.k, device=ids.device) * self.base
        return F.embedding(digits + offsets, self.weight).sum(dim=-2)


def _block_size(n: int, heads: int, d_seed: int, rank: int, device: torch.device) -> int:
    budget = _BLOCK_ELEMENTS.get(device.type, _BLOCK_ELEMENTS["cuda"])
    return max(1, min(d_seed, budget // max(1, n * heads * rank)))


def _phi_block(weight, flat, delta_rows, start, stop):
    """phi = 1 + sum over the 3 active knots of B_m * delta[j, m, :], for coordinates [start, stop).

    Coordinate-major layout so every slice is contiguous: weight (3, d, N, h) basis weights,
    flat (3, d, N, h) row indices into delta_rows (h*d*kappa, r).
    Returns phi (j, N, h, r) and the 3 gathered delta blocks (j, N, h, r).
    """
    _, _, n, h = weight.shape
    r = delta_rows.shape[1]
    rows = [delta_rows.index_select(0, flat[a, start:stop].reshape(-1)).view(stop - start, n, h, r)
            for a in range(3)]
    phi = torch.addcmul(rows[0].new_ones(()), weight[0, start:stop].unsqueeze(-1), rows[0])
    for a in (1, 2):
        phi.addcmul_(weight[a, start:stop].unsqueeze(-1), rows[a])
    return phi, rows


class SeparableProduct(torch.autograd.Function):
    """`M[n, l, rho] = prod_j phi_l[j, rho]` in sign-and-log form, with its exact gradient.

    Forward: `sign * exp(sum_j log(|phi_j| + eps))`, sign = parity of negative factors.
    Backward: the derivative of that formula, `sign * sign(phi_j) * exp(L - log(|phi_j| + eps))`
    = the product of the other factors (no division by a possibly tiny `M`). `phi` is
    recomputed block by block from the basis weights, so memory stays O(N h d).
    """

    @staticmethod
    def forward(ctx, weight, index, delta):  # (N,h,d,3), (N,h,d,3) long, (h,d,kappa,r) -> (N,h,r)
        n, h, d, _ = weight.shape
        kappa, r = delta.shape[2], delta.shape[3]
        flat = index + (torch.arange(h * d, device=index.device) * kappa).view(1, h, d, 1)
        flat = flat.permute(3, 2, 0, 1).contiguous()  # (3, d, N, h)
        w = weight.permute(3, 2, 0, 1).contiguous()  # (3, d, N, h)
        rows = delta.reshape(h * d * kappa, r)
        log_abs = weight.new_zeros(n, h, r)
        negatives = torch.zeros(n, h, r, dtype=torch.int32, device=weight.device)
        step = _block_size(n, h, d, r, weight.device)
        for start in range(0, d, step):
            phi, _ = _phi_block(w, flat, rows, start, min(d, start + step))
            negatives += (phi < 0).sum(dim=0, dtype=torch.int32)
            log_abs += phi.abs_().add_(LOG_EPS).log_().sum(dim=0)  # in place: phi is not needed again
        sign = 1.0 - 2.0 * (negatives % 2).to(weight.dtype)
        ctx.save_for_backward(w, flat.to(torch.int32), delta, log_abs, sign)
        return sign * torch.exp(log_abs)

    @staticmethod
    def backward(ctx, grad_out):  # (N, h, r)
        w, flat, delta, log_abs, sign = ctx.saved_tensors
        flat = flat.long()
        _, d, n, h = w.shape
        kappa, r = delta.shape[2], delta.shape[3]
        rows = delta.reshape(h * d * kappa, r)
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[0] else None  # (3, d, N, h)
        grad_rows = torch.zeros_like(rows) if ctx.needs_input_grad[2] else None
        signed = grad_out * sign  # (N, h, r)
        step = _block_size(n, h, d, r, w.device)
        for start in range(0, d, step):
            stop = min(d, start + step)
            phi, gathered = _phi_block(w, flat, rows, start, stop)
            # product of the other factors' |phi| + eps, then the signs: (j, N, h, r)
            others = phi.abs().add_(LOG_EPS).log_().neg_().add_(log_abs).exp_().mul_(signed)
            grad_phi = torch.where(phi < 0, -others, others)
            for a in range(3):
                if grad_w is not None:
                    torch.sum(grad_phi * gathered[a], dim=-1, out=grad_w[a, start:stop])
                if grad_rows is not None:
                    contrib = grad_phi * w[a, start:stop].unsqueeze(-1)
                    grad_rows.index_add_(0, flat[a, start:stop].reshape(-1), contrib.reshape(-1, r))
        grad_weight = grad_w.permute(2, 3, 1, 0) if grad_w is not None else None  # (N, h, d, 3)
        grad_delta = grad_rows.view_as(delta) if grad_rows is not None else None
        return grad_weight, None, grad_delta


def separable_product(weight: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """See `SeparableProduct`: basis (weight, index) `(N,h,d,3)`, delta `(h,d,kappa,r)` -> `(N,h,r)`."""
    return SeparableProduct.apply(weight, index, delta)


class LevEmbedding(InputEmbedding):
    """The LEV input layer (spec: LEV.md). Per-head parameters hold this TP rank's heads (dim 0)."""

    def __init__(self, vocab_size: int, hidden_size: int, lev: LevConfig, init_std: float = 0.02,
                 dedupe: bool = True):
        super().__init__()
        tp, tp_rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
        if lev.heads % tp:
            raise ConfigError(f"model.lev.heads={lev.heads} is not divisible by the tensor-parallel size {tp}: "
                              "LEV heads are split across tensor-parallel ranks")
        self.vocab_size, self.hidden_size, self.lev = vocab_size, hidden_size, lev
        self.dedupe = dedupe  # compute G once per unique id of the batch (False: once per token)
        h, d, r = lev.heads, lev.d_seed, lev.rank
        self.local_heads = h // tp
        self.head_offset = tp_rank * self.local_heads
        hl = self.local_heads
        self.codebooks = Codebooks(vocab_size, lev.k, d, init_std)  # replicated
        # per head l: W_l (d x d), LayerNorm_l, delta_l (d x kappa x r), W_out_l (r x D)
        self.proj = nn.Parameter(torch.empty(hl, d, d))
        self.norm_weight = nn.Parameter(torch.empty(hl, d))
        self.norm_bias = nn.Parameter(torch.empty(hl, d))
        self.delta = nn.Parameter(torch.empty(hl, d, lev.kappa, r))
        self.out_proj = nn.Parameter(torch.empty(hl, r, hidden_size))
        out_std = init_std / math.sqrt(h) * lev.w_out_init_scale
        for name, shape, init in (
            ("proj", (h, d, d), lambda t: nn.init.normal_(t, 0.0, init_std)),
            ("norm_weight", (h, d), nn.init.ones_),
            ("norm_bias", (h, d), nn.init.zeros_),
            ("delta", (h, d, lev.kappa, r), lambda t: nn.init.normal_(t, 0.0, DELTA_INIT_STD)),
            ("out_proj", (h, r, hidden_size), lambda t: nn.init.normal_(t, 0.0, out_std)),
        ):
            param = getattr(self, name)
            init_sharded_(param, shape, 0, init)
            param.tensor_model_parallel = True  # sharded along the head dimension
            param.partition_dim = 0
        # optional residual `+ W_res z` (replicated, added once after the head reduction)
        self.residual = nn.Linear(d, hidden_size, bias=False) if lev.residual else None
        if self.residual is not None:
            nn.init.normal_(self.residual.weight, 0.0, init_std)

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, vocab_size: int) -> LevEmbedding:
        return cls(vocab_size, model_cfg.hidden_size, model_cfg.lev, init_std=model_cfg.init_std)

    def _compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.delta.dtype == torch.float64 else torch.float32

    def spline_basis(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head `u_l = sigmoid(LayerNorm_l(W_l z))` and its 3 active basis functions, `(N, h, d, 3)`."""
        y = torch.einsum("nd,hed->nhe", z, self.proj.to(z.dtype))  # (N, h, d)
        y = F.layer_norm(y, (y.shape[-1],), eps=LN_EPS) * self.norm_weight.to(z.dtype) + self.norm_bias.to(z.dtype)
        u = torch.sigmoid(y).clamp(0.0, 1.0)  # (N, h, d): bounded latent coordinates
        return active_basis(u, self.lev.kappa)

    def heads(self, seed: torch.Tensor, recompute: bool = False) -> torch.Tensor:
        """Sum over this rank's heads of `M_l @ W_out_l`: `(N, d_seed)` -> `(N, D)` (fp32 inside).

        With `recompute` the basis computation is checkpointed (its `(N, h, d)` intermediates
        are rebuilt in backward); the separable product recomputes its own blocks anyway, so
        it is never run twice.
        """
        cdt = self._compute_dtype()
        z = seed.to(cdt)
        if recompute:
            index, weight = checkpoint(self.spline_basis, z, use_reentrant=False)
        else:
            index, weight = self.spline_basis(z)
        modes = separable_product(weight, index, self.delta.to(cdt))  # (N, h, r)
        out = modes.flatten(1) @ self.out_proj.to(cdt).flatten(0, 1)  # (N, h*r) @ (h*r, D)
        return out.to(seed.dtype)

    def _chunked_heads(self, seed: torch.Tensor) -> torch.Tensor:
        recompute = self.lev.recompute and torch.is_grad_enabled()
        parts = [self.heads(chunk, recompute) for chunk in seed.split(self.lev.chunk_size, dim=0)]
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """G for a flat list of ids: `(N,)` -> `(N, D)`, full D on every TP rank."""
        seed = self.codebooks(ids)  # (N, d_seed)
        out = reduce_from_tensor_parallel_region(self._chunked_heads(copy_to_tensor_parallel_region(seed)))
        if self.residual is not None:
            out = out + self.residual(seed)
        return out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, D)
        check_token_ids(input_ids, self.vocab_size)
        flat = input_ids.reshape(-1)
        if not self.dedupe:
            return self.embed_ids(flat).view(*input_ids.shape, self.hidden_size)
        unique, inverse = torch.unique(flat, return_inverse=True)
        return self.embed_ids(unique)[inverse].view(*input_ids.shape, self.hidden_size)

    @torch.no_grad()
    def materialize(self, chunk_size: int | None = None) -> torch.Tensor:
        """The dense `(V, D)` table, in chunks of `chunk_size` ids (default `lev.chunk_size`).

        Under tensor parallelism this is collective (every TP rank must call it).
        """
        step = chunk_size or self.lev.chunk_size
        device = self.delta.device
        return torch.cat([self.embed_ids(torch.arange(s, min(s + step, self.vocab_size), device=device))
                          for s in range(0, self.vocab_size, step)], dim=0)
