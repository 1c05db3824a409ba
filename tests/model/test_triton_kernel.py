"""The fused Triton kernel for LEV's separable product, run by Triton's interpreter on CPU tensors.

Triton decides at `import triton` whether `@triton.jit` functions (its own library's too) are
compiled or interpreted: `TRITON_INTERPRET=1` must be set before the first import. Run alone,
this file sets it before importing triton; in a full session transformers or torch._dynamo have
imported triton already, so the file's tests run in a child process that sets it
(`test_kernel_tests_pass_under_the_interpreter`). The interpreter runs every program in Python,
so the sizes are small; they still cover ragged groups, ragged id blocks, several id splits,
padded knots and modes, every fallback case and every input dtype.
"""

import os
import subprocess
import sys

import pytest
import torch

if "triton" not in sys.modules:  # (triton reads it again at launch time: it stays set)
    os.environ["TRITON_INTERPRET"] = "1"
import megatron_lev.model.embeddings.lev as lev_module  # noqa: E402
from megatron_lev.config import LevConfig  # noqa: E402
from megatron_lev.model.embeddings import triton_kernel as tk  # noqa: E402
from megatron_lev.model.embeddings.lev import LevEmbedding, default_phi_mode, spline_product  # noqa: E402
from megatron_lev.model.embeddings.spline import spline_basis  # noqa: E402

CHILD_TIMEOUT_S = 300


@pytest.fixture
def small_blocks(monkeypatch):
    """16 ids per program, so that a few dozen ids make several blocks, the last one ragged."""
    monkeypatch.setattr(tk, "MAX_BLOCK_N", 16)


def test_triton_is_installed_and_the_interpreter_runs_the_kernels_on_cpu():
    # the `dev` extra installs triton; without it these tests must fail, not skip
    assert tk.triton is not None, "triton is not importable: install the dev extra (pip install -e '.[dev]')"
    assert tk.available() and tk.interpreted()
    assert type(tk._lev_forward).__name__ == type(tk._lev_backward).__name__ == "InterpretedFunction"
    u = torch.rand(3, 1, 4, generator=torch.Generator().manual_seed(0))
    out = tk.spline_product(u, torch.full((1, 4, 5, 2), 0.5))  # every phi is 1.5
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, torch.full((3, 1, 2), 1.5**4))


def _spec(u, delta):
    """LEV.md steps 4-6 written out in fp64: the dense normalised basis, phi = B @ (1 + delta),
    M = sign * exp(sum_j log(|phi_j| + 1e-9))."""
    basis = spline_basis(u.double(), delta.shape[2])  # (N, h, d, kappa)
    phi = torch.einsum("nhjm,hjmr->nhjr", basis, 1 + delta.double())
    sign = 1.0 - 2.0 * ((phi < 0).sum(2) % 2).double()
    return sign * torch.exp(torch.log(phi.abs() + 1e-9).sum(2))


def _case(case, n=21, h=1, d=20, kappa=6, r=3, spread=1.5, seed=7):
    """u and a delta whose factors take one path of the grouped product. d = 20: one full group and
    one of 4; n = 21 ids; both signs of phi at spread 1.5."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, h, d, generator=gen, dtype=torch.float64)
    u[0, 0, :3] = torch.tensor([0.0, 1.0, 0.5])  # the ends of [0, 1] and a knot
    delta = spread * torch.randn(h, d, kappa, r, generator=gen, dtype=torch.float64)
    if case == "tiny":  # |phi| = 1e-5 at two (coordinate, mode): below SAFE_FACTOR
        delta[0, 3, :, 1] = -1 + 1e-5
        delta[-1, 17, :, 0] = -1 - 1e-5
    elif case == "zero":  # phi exactly 0 at one (coordinate, mode): the spec's eps keeps the log finite
        delta[0, 5, :, 2] = -1.0
    elif case == "underflow":  # every factor about 0.01: a group of 16 multiplies to about 1e-32
        delta.mul_(1e-3).add_(-0.99)
    elif case == "overflow":  # every factor about 100: a group of 16 multiplies to about 1e32
        delta.mul_(1.0).add_(99.0)
    return u, delta


def _value_and_grads(fn, u, delta, seed=1):
    a, b = u.clone().requires_grad_(), delta.clone().requires_grad_()
    out = fn(a, b)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (out * probe.to(out.dtype)).sum().backward()
    return out.detach(), a.grad, b.grad


def _triton(u, delta):
    return spline_product(u, delta, delta.shape[2], "triton")


@pytest.mark.parametrize("case", ["mixed", "tiny", "underflow", "overflow"])
def test_values_and_gradients_match_the_spec_formula(case):
    u, delta = _case(case)
    out, gu, gd = _value_and_grads(_triton, u, delta)
    ref, ru, rd = _value_and_grads(_spec, u, delta)
    # plain groups use the exact product (the eps moves a factor >= 1e-3 by < 1e-6 relative)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0.0)
    u_scale = float(ru.abs().max())  # d/du terms cancel where delta is flat over the knots
    torch.testing.assert_close(gu, ru, rtol=1e-5, atol=1e-8 * u_scale)
    torch.testing.assert_close(gd, rd, rtol=1e-5, atol=1e-8 * float(rd.abs().max()))
    with torch.no_grad():  # the no-grad path (eval, materialize) saves nothing and gives the same values
        torch.testing.assert_close(_triton(u, delta), out, rtol=0, atol=0)


@pytest.mark.parametrize("case,h", [("mixed", 2), ("zero", 1), ("underflow", 1)])
def test_float64_matches_the_c_kernel_and_the_gather_path(case, h):
    """Same arithmetic as the C kernel, down to the fallback's gradient at an exact zero factor
    (+others, where autograd of |phi| would give 0)."""
    u, delta = _case(case, h=h, d=18)
    got = _value_and_grads(_triton, u, delta)
    for mode in ("kernel", "gather"):
        ref = _value_and_grads(lambda a, b, mode=mode: spline_product(a, b, b.shape[2], mode), u, delta)
        for name, a, b in zip(("out", "grad u", "grad delta"), got, ref):
            torch.testing.assert_close(
                a, b, rtol=1e-10, atol=1e-12 * float(b.abs().max()), msg=f"{mode} {name}"
            )
    if case == "zero":
        assert float(_spec(u, delta).abs().min()) > 0  # 1e-9 times the other factors, as the spec writes


def test_ragged_sizes_several_blocks_and_splits_agree(small_blocks):
    """37 ids in 3 blocks of 16 (the last ragged), d = 5 (one short group), kappa = 2 and r = 1
    (both padded to 16 in the tiles), grad delta reduced over 1 or 3 id splits."""
    u, delta = _case("mixed", n=37, h=2, d=5, kappa=2, r=1, spread=0.8)
    ref = _value_and_grads(lambda a, b: spline_product(a, b, 2, "gather"), u, delta)
    out, log_abs, sign = tk.forward(u, delta)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    one = tk.backward(u, delta, log_abs, sign, probe, splits=1)
    for name, a, b in zip(("out", "grad u", "grad delta"), (out, *one), ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13 * float(b.abs().max()), msg=name)
    three = tk.backward(u, delta, log_abs, sign, probe, splits=3)
    assert torch.equal(one[0], three[0])  # grad u: each coordinate written by one program
    torch.testing.assert_close(one[1], three[1], rtol=1e-13, atol=1e-14 * float(one[1].abs().max()))


def test_each_gradient_alone_equals_the_full_backward():
    u, delta = _case("tiny", d=18)
    both = _value_and_grads(_triton, u, delta)
    d_only = delta.clone().requires_grad_()
    u_only = u.clone().requires_grad_()
    probe = torch.randn(both[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (_triton(u, d_only) * probe).sum().backward()
    (_triton(u_only, delta) * probe).sum().backward()
    assert torch.equal(d_only.grad, both[2]) and torch.equal(u_only.grad, both[1])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
def test_low_precision_inputs_accumulate_in_float32(dtype, tol):
    """bf16/fp16/fp32 in, the same dtype out; against the fp64 spec on the same (rounded) inputs,
    the error is the output's rounding, not that of a product taken in the input dtype."""
    u, delta = _case("mixed", d=18, spread=0.3)
    u, delta = u.to(dtype), delta.to(dtype)
    out, gu, gd = _value_and_grads(_triton, u, delta)
    ref, ru, rd = _value_and_grads(_spec, u.double(), delta.double())
    assert out.dtype == gu.dtype == gd.dtype == dtype
    errors = {}
    for name, a, b in zip(("out", "grad u", "grad delta"), (out, gu, gd), (ref, ru, rd)):
        errors[name] = float((a.double() - b).abs().max() / b.abs().max())
        assert errors[name] < tol, (name, errors)
    if dtype != torch.float32:  # the gather path computes in the input dtype: less accurate
        gather = spline_product(u, delta, delta.shape[2], "gather")
        assert errors["out"] <= float((gather.double() - ref).abs().max() / ref.abs().max())


def test_mixed_input_dtypes_give_the_promoted_dtype():
    u, delta = _case("mixed", d=16, spread=0.3)
    out, gu, gd = _value_and_grads(_triton, u.bfloat16(), delta.float())
    assert (out.dtype, gu.dtype, gd.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    torch.testing.assert_close(out.double(), _spec(u.bfloat16(), delta.float()), rtol=2e-6, atol=0)


def test_empty_batch():
    out = tk.spline_product(torch.rand(0, 2, 5), torch.zeros(2, 5, 4, 3))
    assert out.shape == (0, 2, 3)


def test_lev_layer_runs_the_triton_mode_with_the_same_values_and_gradients(monkeypatch):
    cfg = LevConfig(k=2, d_seed=18, heads=2, kappa=5, rank=3, chunk_size=1000, recompute=True)
    ids = torch.tensor([[0, 5, 39, 17, 5, 22]])
    results = {}
    for mode in ("gather", "triton"):
        torch.manual_seed(0)
        emb = LevEmbedding(40, 8, cfg).double()
        with torch.no_grad():
            emb.delta.normal_(0.0, 1.0)
        monkeypatch.setattr(lev_module, "default_phi_mode", lambda device, mode=mode: mode)
        out = emb(ids)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results[mode] = out.detach(), {n: p.grad for n, p in emb.named_parameters()}
    torch.testing.assert_close(results["triton"][0], results["gather"][0], rtol=1e-10, atol=1e-12)
    for name, grad in results["gather"][1].items():
        torch.testing.assert_close(results["triton"][1][name], grad, rtol=1e-10, atol=1e-12, msg=name)


def test_default_on_cuda_and_switched_off_by_the_environment(monkeypatch):
    assert default_phi_mode(torch.device("cuda")) == "triton"
    assert default_phi_mode(torch.device("cpu")) != "triton"  # CPUs run the C kernel
    monkeypatch.setenv(tk.ENV_SWITCH, "0")
    assert default_phi_mode(torch.device("cuda")) == "gather"
    with pytest.raises(RuntimeError, match=tk.ENV_SWITCH):
        tk.spline_product(torch.rand(2, 1, 3), torch.zeros(1, 3, 4, 2))


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(tk, "interpreted", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        tk.spline_product(torch.rand(2, 1, 3), torch.zeros(1, 3, 4, 2))
    with pytest.raises(ValueError, match="knots"):
        spline_product(torch.rand(2, 1, 3), torch.zeros(1, 3, 4, 2), 5, "triton")


COMPILE_FOR_SM90 = """
import os, subprocess, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_lev.model.embeddings import triton_kernel as tk

block_n, block_r = tk._blocks(64)
common = dict(K=16, R=64, BLOCK_N=block_n, BLOCK_R=block_r, ACC=tl.float32)
kernels = [
    (tk._lev_forward, dict(common, SAVE=True), "forward",
     dict(u_ptr="*bf16", delta_ptr="*bf16", out_ptr="*bf16", log_ptr="*fp32", sign_ptr="*i8")),
    (tk._lev_backward, dict(common, KP=16, NEED_U=True, NEED_DELTA=True), "backward",
     dict(u_ptr="*bf16", delta_ptr="*bf16", log_ptr="*fp32", sign_ptr="*i8", grad_ptr="*bf16",
          grad_u_ptr="*bf16", partial_ptr="*fp32")),
]
cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for fn, consts, name, pointers in kernels:
    types = dict(pointers, N="i32", H="i32", D="i32")
    signature = {arg: "constexpr" if arg in consts else types[arg] for arg in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=tk.NUM_WARPS[name]))
    path = os.path.join(os.environ["TRITON_CACHE_DIR"], name + ".cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    print(name, [line.strip() for line in usage.splitlines() if "REG:" in line][0])
"""


def test_kernels_compile_for_a_gpu_without_register_spills(tmp_path):
    """The interpreter runs the Python of the kernels; this runs Triton's compiler on them (no GPU
    needed, ptxas comes with triton), for an H100/H200 target and LEV's default kappa = 16, r = 64."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["forward", "backward"], proc.stdout
    for line in lines:
        assert "STACK:0 " in line and "LOCAL:0 " in line, line  # nothing spilled to local memory


if not tk.interpreted():  # triton was imported before this module: run the tests above in a child process
    for _name in [name for name in globals() if name.startswith("test_")]:
        del globals()[_name]

    def test_kernel_tests_pass_under_the_interpreter():
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
        assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
