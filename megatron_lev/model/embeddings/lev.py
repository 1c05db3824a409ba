"""The LEV layer: token id -> compositional seed -> per-head separable spline -> `(B, S, D)`.

Spec: LEV.md, "The LEV layer, exactly". Efficiency: `G` is computed only for the
unique ids of the batch, in chunks, and the separable product never stores
`[tokens, h, d_seed, r]` activations: it sums logs over blocks of coordinates in
forward and recomputes them in backward. With `recompute` the per-chunk basis
(projection, LayerNorm, sigmoid) is checkpointed as well.
Tensor parallel: the heads are split across TP ranks; codebooks are replicated.
Option `lev.centred` (default off): `G = sum_l (M_l - 1) W_out_l`, which removes the vector
`sum_l 1 W_out_l` that the all-ones mode adds to every token (same parameters).
Option `lev.centre_reference = R` (default 0, off): `G = sum_l (M_l - mean_R M_l) W_out_l`, the mean
taken over R evenly spaced token ids (`reference_ids`) with the current weights at every forward
(gradients flow through it), so the readout stays centred during training, not only at step 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_lev.config import LevConfig, ModelConfig
from megatron_lev.errors import CheckpointDataError, ConfigError
from megatron_lev.model.embeddings.base import InputEmbedding, check_token_ids
from megatron_lev.model.embeddings.id_order import BUFFER as ID_RANK
from megatron_lev.model.embeddings.id_order import check_permutation, initial_ranks, pending_error
from megatron_lev.model.embeddings.lev_constants import GROUP, LOG_EPS, SAFE_FACTOR, SAFE_RANGE
from megatron_lev.model.embeddings.lev_rules import LevRules
from megatron_lev.model.embeddings.spline import active_basis
from megatron_lev.parallel.layers import init_sharded_
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region

LN_EPS = 1e-5
DELTA_INIT_STD = 0.1
# phi elements materialised at once inside the separable product: cache-sized on CPU,
# larger on GPUs so that a chunk needs few kernel launches (~64 MB fp32 temporaries)
_BLOCK_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 24}
NO_GRAD_BLOCK_SCALE = 4  # no-grad blocks (eval, materialize) save nothing, so they can be larger
# "kernel": the fused C kernel on CPU (cpu_kernel.py); "triton": the fused Triton kernel on CUDA
# (triton_kernel.py); "dense": phi by bmm; "gather": the spec's 3-row gather
PHI_MODES = ("gather", "dense", "kernel", "triton")
FUSED_MODES = ("kernel", "triton")  # basis and product in one kernel, from u
PHI_MODE_BY_DEVICE = {"cpu": "kernel", "cuda": "triton"}
KERNEL_FALLBACK = "dense"  # where the CPU kernel cannot be built
TRITON_FALLBACK = "gather"  # where Triton is not importable, or MEGATRON_LEV_TRITON=0


def digit_base(vocab_size: int, k: int) -> int:
    """Smallest integer `b` with `b ** k >= vocab_size` (= ceil(V ** (1/k)), exactly, in integers)."""
    if vocab_size < 1 or k < 1:
        raise ValueError(f"need vocab_size >= 1 and k >= 1, got {vocab_size}, {k}")
    b = max(1, int(round(vocab_size ** (1.0 / k))))
    while b**k < vocab_size:
        b += 1
    while b > 1 and (b - 1) ** k >= vocab_size:
        b -= 1
    return b


def token_digits(ids: torch.Tensor, base: int, k: int) -> torch.Tensor:
    """Compositional index: `(...,)` ids -> `(..., k)` digits, `i_j = (i // b**j) % b`."""
    powers = base ** torch.arange(k, device=ids.device, dtype=torch.int64)
    return (ids.long().unsqueeze(-1) // powers) % base


def reference_ids(vocab_size: int, count: int, device: torch.device | None = None) -> torch.Tensor:
    """`lev.centre_reference`'s ids: `count` evenly spaced token ids, `floor((2j + 1) V / 2count)`
    (every id when `count >= V`). A formula, not a draw, so an export recomputes it anywhere."""
    if count >= vocab_size:
        return torch.arange(vocab_size, device=device)
    j = torch.arange(count, device=device, dtype=torch.int64)
    return ((2 * j + 1) * vocab_size) // (2 * count)


def lev_parameter_count(vocab_size: int, hidden_size: int, lev: LevConfig) -> int:
    """`k*b*d_seed + h*(d_seed^2 + 2*d_seed + d_seed*kappa*r + r*D)` (+ `d_seed*D` with the residual)."""
    d = lev.d_seed
    per_head = d * d + 2 * d + d * lev.kappa * lev.rank + lev.rank * hidden_size
    count = lev.k * digit_base(vocab_size, lev.k) * d + lev.heads * per_head
    return count + (d * hidden_size if lev.residual else 0)


class Codebooks(nn.Module):
    """`k` shared codebooks `C_j (b x d_seed)`; the seed of token i is `z(i) = sum_j C_j[i_j]`.

    With a token-id order other than `bpe` (`lev.id_order`, see `id_order.py`) the digits are those
    of `id_rank[i]`, a permutation stored as the persistent buffer `id_rank` (replicated on every TP
    rank, like the codebooks); with `bpe` nothing is stored and the module is the spec's.
    """

    def __init__(self, vocab_size: int, k: int, d_seed: int, init_std: float, lev: LevConfig | None = None):
        super().__init__()
        self.k, self.base, self.vocab_size = k, digit_base(vocab_size, k), vocab_size
        self.weight = nn.Parameter(torch.empty(k * self.base, d_seed))  # rows of C_0, then C_1, ...
        nn.init.normal_(self.weight, mean=0.0, std=init_std)
        self.lev = lev
        rank, self.order_pending = initial_ranks(lev, vocab_size) if lev is not None else (None, False)
        self.id_rank: torch.Tensor | None
        if rank is None:
            self.id_rank = None  # bpe: no buffer, so checkpoints and exports are those of the spec
        else:
            self.register_buffer(ID_RANK, rank.to(self.weight.device))  # persistent: saved and loaded

    def digit_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids whose digits token `ids` take: `id_rank[ids]`, or `ids` in bpe order."""
        if self.id_rank is None:
            return ids
        if self.order_pending:
            raise pending_error(self.lev, "the model")
        return self.id_rank[ids.long()]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, d_seed)
        digits = token_digits(self.digit_ids(ids), self.base, self.k)  # (N, k)
        offsets = torch.arange(self.k, device=ids.device) * self.base
        return F.embedding(digits + offsets, self.weight).sum(dim=-2)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        key = prefix + ID_RANK
        if self.id_rank is not None and key in state_dict:
            try:
                check_permutation(self.id_rank, self.vocab_size, key)
            except ValueError as exc:
                raise CheckpointDataError(f"{exc}: the checkpoint is damaged or from another model") from None
            self.order_pending = False  # a checkpoint's order replaces the placeholder


class _PhiBlocks:
    """phi for a block of coordinates x ids, and the block's share of the backward pass.

    Layout (h, d, N, 3) for the basis weights/indices, so phi comes out as (h, j, nb, r).
    mode "gather": 3 `index_select`s of r-wide delta rows (the spec's sparse form);
    mode "dense": scatter the 3 weights into a kappa-wide basis and use `torch.bmm`
    per (head, coordinate): more flops, but matmul kernels instead of element-wise passes.
    """

    def __init__(self, w, idx, delta, mode):
        self.w, self.idx, self.mode = w, idx, mode
        self.h, self.d, self.kappa, self.r = delta.shape
        self.shifted = (
            delta + 1.0
        )  # phi = sum_m B_m (1 + delta_m), as the spec writes it: no separate "+1" pass
        if mode == "gather":
            heads_coords = torch.arange(self.h * self.d, device=w.device).view(self.h, self.d, 1, 1)
            self.offsets = heads_coords * self.kappa  # (h, d, 1, 1): first delta row of (l, j)
            self.rows = self.shifted.view(-1, self.r)  # (h*d*kappa, r)

    def coords(self, s, e):
        """Per coordinate block: the (1 + delta) slice the dense mode multiplies with, (h*j, kappa, r)."""
        return self.shifted[:, s:e].reshape(-1, self.kappa, self.r) if self.mode == "dense" else None

    def phi(self, s, e, n0, n1, dblk):  # -> phi (h, j, nb, r), saved state for `backward`
        wb, ib = self.w[:, s:e, n0:n1], self.idx[:, s:e, n0:n1].long()  # (h, j, nb, 3)
        h, j, nb, _ = wb.shape
        if self.mode == "dense":
            basis = wb.new_zeros(h * j, nb, self.kappa)
            basis.view(h, j, nb, self.kappa).scatter_add_(-1, ib, wb)  # (h*j, nb, kappa)
            return torch.bmm(basis, dblk).view(h, j, nb, self.r), (basis, ib)
        flat = ib + self.offsets[:, s:e]
        gathered = [
            self.rows.index_select(0, flat[..., a].reshape(-1)).view(h, j, nb, self.r) for a in range(3)
        ]
        phi = gathered[0] * wb[..., 0:1]
        for a in (1, 2):
            phi.addcmul_(wb[..., a : a + 1], gathered[a])
        return phi, (gathered, flat)

    def backward(self, gphi, saved, s, e, n0, n1, dblk, grad_w, grad_delta):
        """Accumulate d/d(weights) into grad_w (h, d, N, 3) and d/d(delta) into grad_delta."""
        h, j, nb, r = gphi.shape
        if self.mode == "dense":
            basis, ib = saved
            flat_g = gphi.view(h * j, nb, r)
            if grad_delta is not None:
                grad_delta[:, s:e] += torch.bmm(basis.transpose(1, 2), flat_g).view(h, j, self.kappa, r)
            if grad_w is not None:
                grad_basis = torch.bmm(flat_g, dblk.transpose(1, 2)).view(h, j, nb, self.kappa)
                grad_w[:, s:e, n0:n1] = torch.gather(grad_basis, -1, ib)
            return
        gathered, flat = saved
        wb = self.w[:, s:e, n0:n1]
        rows = grad_delta.view(-1, r) if grad_delta is not None else None
        for a in range(3):
            if grad_w is not None:
                grad_w[:, s:e, n0:n1, a] = (gphi * gathered[a]).sum(-1)
            if rows is not None:
                rows.index_add_(0, flat[..., a].reshape(-1), (gphi * wb[..., a : a + 1]).reshape(-1, r))


def _group_product(phi):
    """Product over a group of coordinates: (h, j, nb, r) -> log|prod| and sign (h, nb, r), and
    the mask of entries that took the per-factor path `sum log(|phi| + eps)` (a factor below
    SAFE_FACTOR, or a product outside SAFE_RANGE: zero, subnormal, huge or not finite)."""
    p = phi.prod(dim=1)
    smallest = phi.abs().amin(dim=1)  # min |phi| over the group (torch.aminmax is ~10x slower on CPU)
    size = p.abs()
    bad = (smallest < SAFE_FACTOR) | ~((size >= SAFE_RANGE[0]) & (size <= SAFE_RANGE[1]))
    log_abs, sign = size.log_(), torch.sign(p)
    if bad.any():
        factors = phi.transpose(0, 1)[:, bad]  # (j, n_bad)
        log_abs[bad] = factors.abs().add(LOG_EPS).log().sum(0)
        sign[bad] = 1.0 - 2.0 * ((factors < 0).sum(0) % 2).to(phi.dtype)
    return log_abs, sign, bad


def _blocks(d, n, group, sub):
    for g, s in enumerate(range(0, d, group)):
        yield g, s, min(d, s + group), [(n0, min(n, n0 + sub)) for n0 in range(0, n, sub)]


def _subchunk(n, h, r, device, scale=1):
    budget = _BLOCK_ELEMENTS.get(device.type, _BLOCK_ELEMENTS["cuda"]) * scale
    return max(1, min(n, budget // max(1, h * GROUP * r)))


def _forward_product(w, idx, delta, mode, keep_mask, scale=1):
    """sign and log|M| (h, N, r) from basis (h, d, N, 3) and delta; the bad-group mask if asked."""
    blocks = _PhiBlocks(w, idx, delta, mode)
    h, d, n, _ = w.shape
    r = delta.shape[-1]
    log_abs, sign = w.new_zeros(h, n, r), w.new_ones(h, n, r)
    mask = torch.zeros(-(-d // GROUP), h, n, r, dtype=torch.bool, device=w.device) if keep_mask else None
    for g, s, e, subs in _blocks(d, n, GROUP, _subchunk(n, h, r, w.device, scale)):
        dblk = blocks.coords(s, e)
        for n0, n1 in subs:
            phi, _ = blocks.phi(s, e, n0, n1, dblk)
            lg, sg, bad = _group_product(phi)
            log_abs[:, n0:n1] += lg
            sign[:, n0:n1] *= sg
            if mask is not None:
                mask[g, :, n0:n1] = bad
    return log_abs, sign, mask


class SeparableProduct(torch.autograd.Function):
    """`M[n, l, rho] = prod_j phi_l[j, rho]` in sign-and-log form, with its exact gradient.

    Factors are multiplied directly in groups of GROUP coordinates and one log is taken per
    group (GROUP times fewer transcendental ops than a log per factor); a group with a factor
    below SAFE_FACTOR or a product outside SAFE_RANGE takes the spec's per-factor
    `sum log(|phi| + eps)`. Backward: the product of the other factors is `M / phi_j` in
    plain groups (|phi_j| >= SAFE_FACTOR there) and `sign * exp(L - log(|phi_j| + eps))` in
    the others. `phi` is recomputed block by block, so memory stays O(N h d).
    """

    @staticmethod
    def forward(ctx, weight, index, delta, mode):  # (N,h,d,3), (N,h,d,3) long, (h,d,kappa,r) -> (N,h,r)
        w = weight.permute(1, 2, 0, 3).contiguous()  # (h, d, N, 3)
        idx = index.permute(1, 2, 0, 3).to(torch.int32).contiguous()
        log_abs, sign, mask = _forward_product(w, idx, delta, mode, keep_mask=True)
        ctx.mode = mode
        ctx.save_for_backward(w, idx, delta, log_abs, sign, mask)
        return (sign * torch.exp(log_abs)).permute(1, 0, 2).contiguous()

    @staticmethod
    def backward(ctx, grad_out):  # (N, h, r)
        w, idx, delta, log_abs, sign, mask = ctx.saved_tensors
        blocks = _PhiBlocks(w, idx, delta, ctx.mode)
        h, d, n, _ = w.shape
        r = delta.shape[-1]
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[0] else None  # (h, d, N, 3)
        grad_delta = torch.zeros_like(delta) if ctx.needs_input_grad[2] else None
        signed = grad_out.permute(1, 0, 2) * sign  # (h, N, r)
        grad_m = signed * torch.exp(log_abs)  # dLoss/dM * M
        for g, s, e, subs in _blocks(d, n, GROUP, _subchunk(n, h, r, w.device)):
            dblk = blocks.coords(s, e)
            for n0, n1 in subs:
                phi, saved = blocks.phi(s, e, n0, n1, dblk)
                gphi = grad_m[:, n0:n1].unsqueeze(1) / phi  # (h, j, nb, r): M / phi_j
                bad = mask[g, :, n0:n1]
                if bad.any():
                    factors = phi.transpose(0, 1)[:, bad]  # (j, n_bad)
                    others = (log_abs[:, n0:n1][bad] - factors.abs().add(LOG_EPS).log()).exp()
                    others = others * signed[:, n0:n1][bad]
                    gphi.transpose(0, 1)[:, bad] = torch.where(factors < 0, -others, others)
                blocks.backward(gphi, saved, s, e, n0, n1, dblk, grad_w, grad_delta)
        grad_weight = grad_w.permute(2, 0, 1, 3) if grad_w is not None else None  # (N, h, d, 3)
        return grad_weight, None, grad_delta, None


class KernelProduct(torch.autograd.Function):
    """`active_basis` + `SeparableProduct` by the fused CPU kernel: the same arithmetic (groups,
    per-factor fallback, gradients), with the basis in registers and phi in a GROUP x r buffer
    instead of (N, h, d, 3) and (h, d, N, r) tensors. Saves u (N, h, d), 1 + delta and the
    (N, h, r) log-magnitude and sign for backward: no basis or phi tensors."""

    @staticmethod
    def forward(ctx, u, delta):  # (N, h, d) in [0, 1], (h, d, kappa, r) -> (N, h, r)
        from megatron_lev.model.embeddings import cpu_kernel

        u, shifted = u.contiguous(), (delta + 1.0).contiguous()
        out, log_abs, sign = cpu_kernel.forward(u, shifted)
        ctx.save_for_backward(u, shifted, log_abs, sign)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from megatron_lev.model.embeddings import cpu_kernel

        u, shifted, log_abs, sign = ctx.saved_tensors
        signed = (grad_out * sign).contiguous()
        grad_m = signed * torch.exp(log_abs)  # dLoss/dM * M
        return cpu_kernel.backward(u, shifted, log_abs, grad_m, signed, *ctx.needs_input_grad[:2])


def default_phi_mode(device: torch.device) -> str:
    """Which phi construction runs where (measured: benchmarks/results/lev.md)."""
    mode = PHI_MODE_BY_DEVICE.get(device.type, "gather")
    if mode == "kernel":
        from megatron_lev.model.embeddings import cpu_kernel

        if device.type != "cpu" or not cpu_kernel.available():
            return KERNEL_FALLBACK
    if mode == "triton":
        from megatron_lev.model.embeddings import triton_kernel

        if device.type != "cuda" or not triton_kernel.available():
            return TRITON_FALLBACK
    return mode


def separable_product(
    weight: torch.Tensor, index: torch.Tensor, delta: torch.Tensor, mode: str | None = None
) -> torch.Tensor:
    """See `SeparableProduct`: basis (weight, index) `(N,h,d,3)`, delta `(h,d,kappa,r)` -> `(N,h,r)`.

    Without autograd (eval, `materialize`) nothing is saved and blocks are larger.
    """
    mode = mode or default_phi_mode(weight.device)
    if mode in FUSED_MODES:  # the fused kernels start from u: see spline_product
        mode = KERNEL_FALLBACK if mode == "kernel" else TRITON_FALLBACK
    if mode not in PHI_MODES:
        raise ValueError(f"phi mode must be one of {PHI_MODES}, got {mode!r}")
    if torch.is_grad_enabled() and (weight.requires_grad or delta.requires_grad):
        return SeparableProduct.apply(weight, index, delta, mode)
    w = weight.permute(1, 2, 0, 3).contiguous()
    idx = index.permute(1, 2, 0, 3).to(torch.int32).contiguous()
    log_abs, sign, _ = _forward_product(w, idx, delta, mode, keep_mask=False, scale=NO_GRAD_BLOCK_SCALE)
    return (sign * torch.exp(log_abs)).permute(1, 0, 2).contiguous()


def spline_product(u: torch.Tensor, delta: torch.Tensor, kappa: int, mode: str | None = None) -> torch.Tensor:
    """Spec steps 4-6 from the latent coordinates: u `(N,h,d)` in [0,1], delta `(h,d,kappa,r)` -> `(N,h,r)`.

    Modes "gather"/"dense": `active_basis` then `separable_product`; "kernel": both fused in the
    CPU kernel (the default on CPU where it builds); "triton": both fused in the Triton kernel
    (the default on CUDA where Triton imports).
    """
    mode = mode or default_phi_mode(u.device)
    if mode == "triton":
        from megatron_lev.model.embeddings import triton_kernel

        if delta.shape[2] != kappa:
            raise ValueError(f"delta has {delta.shape[2]} knots, kappa is {kappa}")
        return triton_kernel.spline_product(u, delta)
    if mode != "kernel":
        index, weight = active_basis(u, kappa)
        return separable_product(weight, index, delta, mode)
    from megatron_lev.model.embeddings import cpu_kernel

    if u.device.type != "cpu" or not cpu_kernel.available():
        raise RuntimeError(
            f"phi mode 'kernel' needs CPU tensors and a built CPU kernel (device {u.device.type}; "
            f"a C compiler, and {cpu_kernel.ENV_SWITCH} not set to 0)"
        )
    if delta.shape[2] != kappa:
        raise ValueError(f"delta has {delta.shape[2]} knots, kappa is {kappa}")
    return KernelProduct.apply(u, delta)  # without autograd (eval, materialize) nothing is kept for backward


def _check_heads(heads: int, tp: int) -> None:
    if heads % tp:
        raise ConfigError(
            f"model.lev.heads={heads} is not divisible by parallel.tensor_model_parallel_size={tp}: "
            "LEV heads are split across tensor-parallel ranks; set model.lev.heads to a multiple of TP"
        )


class LevEmbedding(LevRules, InputEmbedding):
    """The LEV input layer (spec: LEV.md). Per-head parameters hold this TP rank's heads (dim 0)."""

    name, label = "lev", "LEV"
    output_parameters = ("out_proj", "residual.weight")  # G is linear in these together

    @classmethod
    def check_config(cls, model_cfg: ModelConfig, tensor_parallel: int) -> None:
        _check_heads(model_cfg.lev.heads, tensor_parallel)

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        lev: LevConfig,
        init_std: float = 0.02,
        dedupe: bool = True,
        layout: ParallelLayout = SINGLE,
    ):
        super().__init__()
        self.layout = layout
        tp, tp_rank = layout.tp, layout.tp_rank
        _check_heads(lev.heads, tp)
        self.vocab_size, self.hidden_size, self.lev = vocab_size, hidden_size, lev
        self.dedupe = dedupe  # compute G once per unique id of the batch (False: once per token)
        h, d, r = lev.heads, lev.d_seed, lev.rank
        self.local_heads = h // tp
        self.head_offset = tp_rank * self.local_heads
        hl = self.local_heads
        seed_std = init_std * lev.seed_init_scale
        self.codebooks = Codebooks(vocab_size, lev.k, d, seed_std, lev)  # replicated (with its token order)
        # per head l: W_l (d x d), LayerNorm_l, delta_l (d x kappa x r), W_out_l (r x D)
        self.proj = nn.Parameter(torch.empty(hl, d, d))
        self.norm_weight = nn.Parameter(torch.empty(hl, d))
        self.norm_bias = nn.Parameter(torch.empty(hl, d))
        self.delta = nn.Parameter(torch.empty(hl, d, lev.kappa, r))
        self.out_proj = nn.Parameter(torch.empty(hl, r, hidden_size))
        out_std = init_std / math.sqrt(h) * lev.w_out_init_scale
        for name, shape, init in (
            ("proj", (h, d, d), lambda t: nn.init.normal_(t, 0.0, seed_std)),
            ("norm_weight", (h, d), nn.init.ones_),
            ("norm_bias", (h, d), nn.init.zeros_),
            ("delta", (h, d, lev.kappa, r), lambda t: nn.init.normal_(t, 0.0, DELTA_INIT_STD)),
            ("out_proj", (h, r, hidden_size), lambda t: nn.init.normal_(t, 0.0, out_std)),
        ):
            param = getattr(self, name)
            init_sharded_(param, shape, 0, init, layout)
            param.tensor_model_parallel = True  # sharded along the head dimension
            param.partition_dim = 0
        # optional residual `+ W_res z` (replicated, added once after the head reduction)
        self.residual = nn.Linear(d, hidden_size, bias=False) if lev.residual else None
        if self.residual is not None:
            nn.init.normal_(self.residual.weight, 0.0, init_std)

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        vocab_size: int,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ) -> LevEmbedding:
        # replicated over the vocabulary: the digit base, reference ids and id order are those of
        # the one-process vocabulary, so a TP run computes what one process does
        return cls(
            base_vocab or vocab_size,
            model_cfg.hidden_size,
            model_cfg.lev,
            init_std=model_cfg.init_std,
            layout=layout,
        )

    @classmethod
    def parameter_count(cls, model_cfg: ModelConfig, vocab_size: int) -> int:
        return lev_parameter_count(vocab_size, model_cfg.hidden_size, model_cfg.lev)

    def _compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.delta.dtype == torch.float64 else torch.float32

    def latent(self, z: torch.Tensor) -> torch.Tensor:
        """Per head `u_l = sigmoid(LayerNorm_l(W_l z))`: `(N, d_seed)` -> `(N, h, d_seed)` in [0, 1]."""
        y = torch.einsum("nd,hed->nhe", z, self.proj.to(z.dtype))  # (N, h, d)
        y = F.layer_norm(y, (y.shape[-1],), eps=LN_EPS) * self.norm_weight.to(z.dtype) + self.norm_bias.to(
            z.dtype
        )
        return torch.sigmoid(y).clamp(0.0, 1.0)  # bounded latent coordinates

    def modes(self, seed: torch.Tensor, recompute: bool = False) -> torch.Tensor:
        """This rank's heads' modes `M_l[rho]`: `(N, d_seed)` -> `(N, h_local * r)` (fp32 inside).

        With `recompute` the basis computation is checkpointed (its `(N, h, d)` intermediates
        are rebuilt in backward); the separable product recomputes its own blocks anyway, so
        it is never run twice.
        """
        cdt = self._compute_dtype()
        z = seed.to(cdt)
        mode, kappa = default_phi_mode(z.device), self.lev.kappa

        def basis(z):  # what `recompute` checkpoints: the kernel takes u, the other modes the active basis
            u = self.latent(z)
            return u if mode in FUSED_MODES else active_basis(u, kappa)

        inputs = checkpoint(basis, z, use_reentrant=False) if recompute else basis(z)
        if mode in FUSED_MODES:
            modes = spline_product(inputs, self.delta.to(cdt), kappa, mode)  # (N, h, r)
        else:
            index, weight = inputs
            modes = separable_product(weight, index, self.delta.to(cdt), mode)
        return modes.flatten(1)  # (N, h*r)

    def heads(
        self, seed: torch.Tensor, recompute: bool = False, offset: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sum over this rank's heads of `(M_l - c) @ W_out_l`: `(N, d_seed)` -> `(N, D)`, with `c` 0
        (the spec), 1 (`lev.centred`) or `offset` (`lev.centre_reference`: the reference ids' mean modes).

        Centring is applied to the modes after the product, so every phi mode, the fused kernels,
        dedupe, chunking and recompute compute the same function; under tensor parallelism each
        rank subtracts only its own heads' term before the reduction.
        """
        modes = self.modes(seed, recompute)
        if self.lev.centred:  # (M_l - 1) W_out_l: each rank drops its own heads' all-ones term
            modes = modes - 1.0
        elif offset is not None:
            modes = modes - offset
        out = modes @ self.out_proj.to(modes.dtype).flatten(0, 1)  # (N, h*r) @ (h*r, D)
        return out.to(seed.dtype)

    def reference_modes(self) -> torch.Tensor | None:
        """`lev.centre_reference`'s offset: the mean over `reference_ids` of this rank's modes,
        `(h_local * r,)`, differentiable (None when the option is off)."""
        count = self.lev.centre_reference
        if not count:
            return None
        ids = reference_ids(self.vocab_size, count, self.delta.device)
        seed = copy_to_tensor_parallel_region(self.codebooks(ids), self.layout)
        recompute = self.lev.recompute and torch.is_grad_enabled()
        parts = [self.modes(chunk, recompute) for chunk in seed.split(self.lev.chunk_size, dim=0)]
        return torch.cat(parts, dim=0).mean(dim=0)

    def _chunked_heads(self, seed: torch.Tensor) -> torch.Tensor:
        recompute = self.lev.recompute and torch.is_grad_enabled()
        offset = self.reference_modes()
        parts = [self.heads(chunk, recompute, offset) for chunk in seed.split(self.lev.chunk_size, dim=0)]
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """G for a flat list of ids: `(N,)` -> `(N, D)`, full D on every TP rank."""
        seed = self.codebooks(ids)  # (N, d_seed)
        heads = self._chunked_heads(copy_to_tensor_parallel_region(seed, self.layout))
        out = reduce_from_tensor_parallel_region(heads, self.layout)
        if self.residual is not None:
            out = out + self.residual(seed)
        return out

    @torch.no_grad()
    def sample_rows(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) distinct ids -> (N, D)
        return self.embed_ids(ids)

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
        return torch.cat(
            [
                self.embed_ids(torch.arange(s, min(s + step, self.vocab_size), device=device))
                for s in range(0, self.vocab_size, step)
            ],
            dim=0,
        )
