"""Fused Triton kernel for LEV's spline basis and separable product (spec: LEV.md, steps 4-6).

The GPU counterpart of the C kernel (`csrc/lev_cpu.c`), with the same arithmetic:

    (idx, w)[n,l,j,:3] = the 3 active quadratic B-spline basis functions at u[n,l,j]   (spline.py)
    phi[n,l,j,rho]     = sum_{a<3} w[n,l,j,a] * (1 + delta[l,j,idx[n,l,j,a],rho])
    M[n,l,rho]         = prod_j phi[n,l,j,rho]   in sign-and-log form

Factors are multiplied directly in groups of GROUP coordinates with one log per group; a
group whose smallest |phi| is below SAFE_FACTOR, or whose product is outside SAFE_RANGE or
not finite, takes the spec's per-factor form `sum_j log(|phi_j| + LOG_EPS)` (lev.py,
`_group_product`). The basis and phi live in registers: nothing of size (N, h, d, 3) or
(N, h, d, r) is written. Accumulation is in fp32 (fp64 for fp64 inputs); bf16/fp16/fp32
inputs are read as they are, `1 + delta` is formed in the accumulation type, and the output
has the promoted input dtype.

Forward: one program per (block of BLOCK_N ids, head), all r modes at once.
Backward: one program per (head, group of GROUP coordinates, split of the ids). The
plain/per-factor decision is per group, so a program recomputes its group's product, then
`dM/dphi_j` (`M / phi_j` in plain groups, `sign * exp(L - log(|phi_j| + eps))` in the others)
and from it grad u (its own coordinates: disjoint writes) and grad delta. grad delta is a sum
over ids; each program adds its ids' share (`basis^T @ dM/dphi`, one small matmul per
coordinate) into its own slice of a partial buffer (splits, h, d, kappa, r), and the splits
are summed once at the end. No atomics: the result is deterministic (the same bits on every
run, as the C kernel), and the buffer is small because the ids are split only as far as the
GPU needs programs (a few per multiprocessor), not once per block.

Launched on CUDA tensors; on CPU tensors only under Triton's interpreter (`TRITON_INTERPRET=1`
set before this module is imported), which is how the tests run it.
"""

from __future__ import annotations

import contextlib
import os

import torch

from megatron_lev.model.embeddings.lev_constants import GROUP, LOG_EPS, SAFE_FACTOR, SAFE_RANGE

ENV_SWITCH = "MEGATRON_LEV_TRITON"  # "0": never use the Triton kernel (the gather path runs instead)
MIN_VERSION = (3, 0)  # tl.dot(input_precision=...)
TILE_ELEMENTS = 2048  # BLOCK_N x BLOCK_R per program: register-sized tiles
MAX_BLOCK_N = 64  # ids per program, at most
PROGRAMS_PER_SM = 4  # backward: split the ids until about this many programs per multiprocessor
NUM_WARPS = {"forward": 8, "backward": 8}  # the backward holds about twice the tiles (not tuned on a GPU yet)

try:
    import triton
    import triton.language as tl

    _VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
except ImportError:  # the gather path runs instead
    triton, tl, _VERSION = None, None, (0, 0)


def available() -> bool:
    """Triton importable (>= 3.0) and not switched off with MEGATRON_LEV_TRITON=0."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and triton is not None and _VERSION >= MIN_VERSION


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (CPU tensors) rather than compiled."""
    return triton is not None and type(_lev_forward).__name__ == "InterpretedFunction"


if triton is not None:
    _GROUP = tl.constexpr(GROUP)
    _LOG_EPS = tl.constexpr(LOG_EPS)
    _SAFE_FACTOR = tl.constexpr(SAFE_FACTOR)
    _SAFE_LO = tl.constexpr(SAFE_RANGE[0])
    _SAFE_HI = tl.constexpr(SAFE_RANGE[1])

    @triton.jit
    def _basis(u, K: tl.constexpr):
        """The 3 active basis functions at u (BLOCK_N,): knot indices, normalised weights and
        d(weight)/du, as `active_basis`; knots outside [0, K) get weight 0, index clamped."""
        x = u * (K - 1)
        c = tl.minimum(tl.maximum(tl.floor(x + 0.5), 0.0), K - 1.0)
        f = x - c
        ci = c.to(tl.int32)
        v0 = ci >= 1
        v2 = ci + 1 < K
        r0 = tl.where(v0, 0.5 * (0.5 - f) * (0.5 - f), 0.0)
        r1 = 0.75 - f * f
        r2 = tl.where(v2, 0.5 * (0.5 + f) * (0.5 + f), 0.0)
        total = r0 + r1 + r2
        w0, w1, w2 = r0 / total, r1 / total, r2 / total
        # d/df of r_a / total, times df/du = K - 1 (the centre is piecewise constant)
        d0 = tl.where(v0, f - 0.5, 0.0)
        d1 = -2.0 * f
        d2 = tl.where(v2, 0.5 + f, 0.0)
        ds = d0 + d1 + d2
        scale = (K - 1) / total
        dw0, dw1, dw2 = (d0 - w0 * ds) * scale, (d1 - w1 * ds) * scale, (d2 - w2 * ds) * scale
        i0 = tl.where(v0, ci - 1, 0)
        i2 = tl.where(v2, ci + 1, K - 1)
        return i0, ci, i2, w0, w1, w2, dw0, dw1, dw2

    @triton.jit
    def _phi(u_rows, delta_l, j, D, n_ok, rho, tile_ok, K: tl.constexpr, R: tl.constexpr, ACC: tl.constexpr):
        """phi at coordinate j for a block of ids, (BLOCK_N, BLOCK_R), 1 where padded (j >= D, an id
        past N, a mode past R); also the 3 gathered rows of 1 + delta and the basis."""
        u_ok = n_ok & (n_ok.to(tl.int32) * 0 + j < D)  # (a tensor, not a scalar, for the interpreter)
        ok = tile_ok & u_ok[:, None]
        uj = tl.load(u_rows + j, mask=u_ok, other=0.5).to(ACC)
        i0, i1, i2, w0, w1, w2, dw0, dw1, dw2 = _basis(uj, K)
        coord = delta_l + j * (K * R)
        row0 = tl.load(coord + i0[:, None] * R + rho[None, :], mask=ok, other=0.0).to(ACC) + 1.0
        row1 = tl.load(coord + i1[:, None] * R + rho[None, :], mask=ok, other=0.0).to(ACC) + 1.0
        row2 = tl.load(coord + i2[:, None] * R + rho[None, :], mask=ok, other=0.0).to(ACC) + 1.0
        phi = w0[:, None] * row0 + w1[:, None] * row1 + w2[:, None] * row2
        phi = tl.where(ok, phi, 1.0)
        return phi, row0, row1, row2, i0, i1, i2, w0, w1, w2, dw0, dw1, dw2

    @triton.jit
    def _factor(
        u_rows, delta_l, j, D, n_ok, rho, tile_ok, K: tl.constexpr, R: tl.constexpr, ACC: tl.constexpr
    ):
        """phi alone (see `_phi`)."""
        phi, row0, row1, row2, i0, i1, i2, w0, w1, w2, dw0, dw1, dw2 = _phi(
            u_rows, delta_l, j, D, n_ok, rho, tile_ok, K, R, ACC
        )
        return phi

    @triton.jit
    def _group_start(
        u_rows,
        delta_l,
        j0,
        D,
        n_ok,
        rho,
        tile_ok,
        K: tl.constexpr,
        R: tl.constexpr,
        ACC: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        """Product and smallest |phi| over the group starting at j0, and which entries are bad."""
        prod = tl.full((BLOCK_N, BLOCK_R), 1.0, ACC)
        smallest = tl.full((BLOCK_N, BLOCK_R), float("inf"), ACC)
        for jj in range(_GROUP):
            phi = _factor(u_rows, delta_l, j0 + jj, D, n_ok, rho, tile_ok, K, R, ACC)
            prod = prod * phi
            smallest = tl.minimum(smallest, tl.abs(phi))
        size = tl.abs(prod)
        bad = (smallest < _SAFE_FACTOR) | ~((size >= _SAFE_LO) & (size <= _SAFE_HI))  # NaN: bad
        return prod, size, bad

    @triton.jit
    def _lev_forward(
        u_ptr,
        delta_ptr,
        out_ptr,
        log_ptr,
        sign_ptr,
        N,
        H,
        D,
        K: tl.constexpr,
        R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        ACC: tl.constexpr,
        SAVE: tl.constexpr,
    ):
        """Program (id block, head): out (and, if SAVE, log|M| and sign) for BLOCK_N ids, all modes."""
        head = tl.program_id(1)
        n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rho = tl.arange(0, BLOCK_R)
        n_ok = n < N
        tile_ok = n_ok[:, None] & (rho < R)[None, :]
        u_rows = u_ptr + (n * H + head) * D  # (BLOCK_N,) pointers to u[n, l, :]
        delta_l = delta_ptr + head.to(tl.int64) * D * (K * R)
        logsum = tl.zeros((BLOCK_N, BLOCK_R), ACC)
        sign = tl.full((BLOCK_N, BLOCK_R), 1.0, ACC)
        for j0 in range(0, D, _GROUP):
            prod, size, bad = _group_start(
                u_rows, delta_l, j0, D, n_ok, rho, tile_ok, K, R, ACC, BLOCK_N, BLOCK_R
            )
            logsum += tl.where(bad, 0.0, tl.log(tl.where(bad, 1.0, size)))  # one log per group
            sign = tl.where(~bad & (prod < 0), -sign, sign)
            if tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0:  # rare: the per-factor form
                for jj in range(_GROUP):
                    phi = _factor(u_rows, delta_l, j0 + jj, D, n_ok, rho, tile_ok, K, R, ACC)
                    real = bad & (n_ok.to(tl.int32) * 0 + j0 + jj < D)[:, None]  # not a padding factor
                    logsum += tl.where(real, tl.log(tl.abs(phi) + _LOG_EPS), 0.0)
                    sign = tl.where(bad & (phi < 0), -sign, sign)
        offs = (n * H + head)[:, None] * R + rho[None, :]
        tl.store(out_ptr + offs, sign * tl.exp(logsum), mask=tile_ok)
        if SAVE:
            tl.store(log_ptr + offs, logsum, mask=tile_ok)
            tl.store(sign_ptr + offs, sign.to(tl.int8), mask=tile_ok)

    @triton.jit
    def _lev_backward(
        u_ptr,
        delta_ptr,
        log_ptr,
        sign_ptr,
        grad_ptr,
        grad_u_ptr,
        partial_ptr,
        N,
        H,
        D,
        K: tl.constexpr,
        R: tl.constexpr,
        KP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        ACC: tl.constexpr,
        NEED_U: tl.constexpr,
        NEED_DELTA: tl.constexpr,
    ):
        """Program (group g, head, split s): for the id blocks s, s + S, ..., grad u at the group's
        coordinates, and their share of grad delta into partial[s, head, group] (owned: no atomics)."""
        g, head, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        splits = tl.num_programs(2)
        j0 = g * _GROUP
        rho = tl.arange(0, BLOCK_R)
        knots = tl.arange(0, KP)
        delta_l = delta_ptr + head.to(tl.int64) * D * (K * R)
        part = partial_ptr + (s.to(tl.int64) * H + head) * D * (K * R)
        for b in range(s, tl.cdiv(N, BLOCK_N), splits):
            n = (b * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            n_ok = n < N
            tile_ok = n_ok[:, None] & (rho < R)[None, :]
            u_rows = u_ptr + (n * H + head) * D
            offs = (n * H + head)[:, None] * R + rho[None, :]
            signed = tl.load(grad_ptr + offs, mask=tile_ok, other=0.0).to(ACC)
            signed = signed * tl.load(sign_ptr + offs, mask=tile_ok, other=1).to(ACC)  # dLoss/dM * sign
            log_abs = tl.load(log_ptr + offs, mask=tile_ok, other=0.0)
            grad_m = signed * tl.exp(log_abs)  # dLoss/dM * M
            prod, size, bad = _group_start(
                u_rows, delta_l, j0, D, n_ok, rho, tile_ok, K, R, ACC, BLOCK_N, BLOCK_R
            )
            any_bad = tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0
            for jj in range(_GROUP):
                j = j0 + jj
                phi, row0, row1, row2, i0, i1, i2, w0, w1, w2, dw0, dw1, dw2 = _phi(
                    u_rows, delta_l, j, D, n_ok, rho, tile_ok, K, R, ACC
                )
                gphi = grad_m / tl.where(bad, 1.0, phi)  # M / phi_j: |phi_j| >= SAFE_FACTOR in plain groups
                if any_bad:
                    others = signed * tl.exp(log_abs - tl.log(tl.abs(phi) + _LOG_EPS))
                    gphi = tl.where(bad, tl.where(phi < 0, -others, others), gphi)
                if NEED_U:
                    gu = (
                        tl.sum(gphi * row0, axis=1) * dw0
                        + tl.sum(gphi * row1, axis=1) * dw1
                        + tl.sum(gphi * row2, axis=1) * dw2
                    )
                    tl.store(grad_u_ptr + (n * H + head) * D + j, gu, mask=n_ok & (n * 0 + j < D))
                if NEED_DELTA:
                    col = knots[None, :]
                    basis = (
                        tl.where(col == i0[:, None], w0[:, None], 0.0)
                        + tl.where(col == i1[:, None], w1[:, None], 0.0)
                        + tl.where(col == i2[:, None], w2[:, None], 0.0)
                    )  # (BLOCK_N, KP), dense
                    share = tl.dot(tl.trans(basis), gphi, input_precision="ieee")  # (KP, BLOCK_R)
                    ptrs = part + (j * K + knots)[:, None] * R + rho[None, :]
                    ok = (knots + K * j < K * D)[:, None] & (knots < K)[:, None] & (rho < R)[None, :]
                    tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + share, mask=ok)
            if NEED_DELTA:  # the next block re-reads partial: make this block's writes visible to all threads
                tl.debug_barrier()


def _blocks(r: int) -> tuple[int, int]:
    """BLOCK_N, BLOCK_R: all r modes in one tile (>= 16 each, as tl.dot needs), about TILE_ELEMENTS."""
    block_r = max(16, triton.next_power_of_2(r))
    return max(16, min(MAX_BLOCK_N, TILE_ELEMENTS // block_r)), block_r


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _tl_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _device(t: torch.Tensor):
    """Launch on the tensors' GPU, whichever is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check(u: torch.Tensor, delta: torch.Tensor) -> None:
    if not available():
        raise RuntimeError(
            f"the LEV Triton kernel needs triton >= {'.'.join(map(str, MIN_VERSION))} "
            f"and {ENV_SWITCH} not set to 0"
        )
    if u.device != delta.device:
        raise ValueError(f"u is on {u.device}, delta on {delta.device}")
    if not u.is_cuda and not interpreted():
        raise RuntimeError(
            "the LEV Triton kernel runs on CUDA tensors (on CPU only under TRITON_INTERPRET=1)"
        )
    for t in (u, delta):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"LEV Triton kernel: floating-point inputs only, got {t.dtype}")


def forward(u: torch.Tensor, delta: torch.Tensor, save: bool = True):
    """u (N,h,d) in [0,1] and delta (h,d,kappa,r), contiguous -> out (N,h,r) in the promoted input
    dtype and, if `save`, log|M| (fp32/fp64) and sign (int8), both (N,h,r), for `backward`."""
    _check(u, delta)
    n, h, d = u.shape
    kappa, r = delta.shape[2], delta.shape[3]
    acc = _acc_dtype(u, delta)
    out = u.new_empty((n, h, r), dtype=torch.promote_types(u.dtype, delta.dtype))
    log_abs = u.new_empty((n, h, r), dtype=acc) if save else None
    sign = u.new_empty((n, h, r), dtype=torch.int8) if save else None
    if n == 0 or h == 0 or r == 0:
        return out.fill_(1.0), log_abs, sign
    block_n, block_r = _blocks(r)
    with _device(u):
        _lev_forward[(triton.cdiv(n, block_n), h)](
            u,
            delta,
            out,
            log_abs if save else out,
            sign if save else out,
            n,
            h,
            d,
            K=kappa,
            R=r,
            BLOCK_N=block_n,
            BLOCK_R=block_r,
            ACC=_tl_dtype(acc),
            SAVE=save,
            num_warps=NUM_WARPS["forward"],
        )
    return out, log_abs, sign


def backward(
    u, delta, log_abs, sign, grad_out, need_u: bool = True, need_delta: bool = True, splits: int | None = None
):
    """Gradients for u (N,h,d) and delta (h,d,kappa,r), None where not needed. `splits`: how many
    partial grad-delta buffers the ids are spread over (default: enough programs for the GPU)."""
    n, h, d = u.shape
    kappa, r = delta.shape[2], delta.shape[3]
    if n == 0 or h == 0 or d == 0 or r == 0 or not (need_u or need_delta):
        return (torch.zeros_like(u) if need_u else None), (torch.zeros_like(delta) if need_delta else None)
    grad_u = torch.empty_like(u) if need_u else None  # every (id, head, coordinate) is written once
    block_n, block_r = _blocks(r)
    groups, n_blocks = triton.cdiv(d, GROUP), triton.cdiv(n, block_n)
    if splits is None:
        splits = 1
        if u.is_cuda:
            sms = torch.cuda.get_device_properties(u.device).multi_processor_count
            splits = -(-PROGRAMS_PER_SM * sms // (groups * h))
    splits = max(1, min(splits, n_blocks))
    acc = _acc_dtype(u, delta)
    partial = torch.zeros((splits, h, d, kappa, r), dtype=acc, device=u.device) if need_delta else None
    with _device(u):
        _lev_backward[(groups, h, splits)](
            u,
            delta,
            log_abs,
            sign,
            grad_out,
            grad_u if need_u else u,
            partial if need_delta else log_abs,
            n,
            h,
            d,
            K=kappa,
            R=r,
            KP=max(16, triton.next_power_of_2(kappa)),
            BLOCK_N=block_n,
            BLOCK_R=block_r,
            ACC=_tl_dtype(acc),
            NEED_U=need_u,
            NEED_DELTA=need_delta,
            num_warps=NUM_WARPS["backward"],
        )
    if not need_delta:
        return grad_u, None
    return grad_u, (partial[0] if splits == 1 else partial.sum(0)).to(delta.dtype)


class TritonProduct(torch.autograd.Function):
    """Basis and separable product in the Triton kernels. Saves u and delta (the inputs
    themselves where contiguous: no copy, no 1 + delta) and the (N, h, r) log-magnitude (fp32)
    and sign (int8): no basis or phi tensors."""

    @staticmethod
    def forward(ctx, u, delta):  # (N, h, d) in [0, 1], (h, d, kappa, r) -> (N, h, r)
        u, delta = u.contiguous(), delta.contiguous()
        out, log_abs, sign = forward(u, delta)
        ctx.save_for_backward(u, delta, log_abs, sign)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        u, delta, log_abs, sign = ctx.saved_tensors
        return backward(u, delta, log_abs, sign, grad_out.contiguous(), *ctx.needs_input_grad[:2])


def spline_product(u: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """`lev.spline_product` in the Triton kernels: u (N,h,d), delta (h,d,kappa,r) -> (N,h,r).
    Without autograd (eval, `materialize`) nothing is kept for backward."""
    if torch.is_grad_enabled() and (u.requires_grad or delta.requires_grad):
        return TritonProduct.apply(u, delta)
    return forward(u.contiguous(), delta.contiguous(), save=False)[0]
