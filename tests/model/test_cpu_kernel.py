"""The fused CPU kernel for LEV's separable product: build, cache, fallback, threads, precision.

Its values and gradients against the spec formula (negative, tiny, underflowing and
overflowing factors) are covered with the other phi modes in test_lev.py.
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_lev.model.embeddings import cpu_kernel
from megatron_lev.model.embeddings.lev import default_phi_mode, spline_product


def test_a_c_compiler_is_on_the_path():
    # the kernel tests need one; .ci/install_system_packages.sh installs gcc where it is missing
    assert cpu_kernel._compiler() is not None, (
        "no C compiler (cc/gcc, or $CC): install gcc to build the LEV CPU kernel"
    )


def _inputs(n=37, h=3, d=40, kappa=7, r=10, dtype=torch.float64, spread=0.6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(n, h, d, generator=gen, dtype=dtype)
    delta = spread * torch.randn(h, d, kappa, r, generator=gen, dtype=dtype)
    return u, delta


def _value_and_grads(u, delta, mode):
    w, d = u.clone().requires_grad_(), delta.clone().requires_grad_()
    out = spline_product(w, d, d.shape[2], mode)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(
        out.dtype
    )
    (out * probe).sum().backward()
    return out.detach(), w.grad, d.grad


def test_build_is_cached_and_leaves_no_temporary_files(tmp_path):
    first = cpu_kernel.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    second = cpu_kernel.build(tmp_path)
    assert first == second and second.stat().st_mtime_ns == stamp  # not rebuilt
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no .lev_cpu-*.so left behind


def test_failing_compiler_is_reported_with_the_source_name(tmp_path, monkeypatch):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error: no input' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(RuntimeError, match="lev_cpu.c"):
        cpu_kernel.build(tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())  # the failed build left nothing a later load could pick up


def test_switched_off_kernel_falls_back_to_the_pytorch_path(tmp_path):
    code = (
        "import torch\n"
        "from megatron_lev.model.embeddings import cpu_kernel\n"
        "from megatron_lev.model.embeddings.lev import default_phi_mode, spline_product\n"
        "print(cpu_kernel.available(), default_phi_mode(torch.device('cpu')))\n"
        "try:\n    spline_product(torch.rand(2, 1, 3), torch.zeros(1, 3, 2, 2), 2, 'kernel')\n"
        "except RuntimeError as e:\n    print('refused:', e)\n"
    )
    env = dict(os.environ, **{cpu_kernel.ENV_SWITCH: "0", cpu_kernel.ENV_CACHE: str(tmp_path)})
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[0] == "False dense"
    assert "refused: phi mode 'kernel' needs" in out and cpu_kernel.ENV_SWITCH in out
    assert not any(tmp_path.iterdir())  # switched off means not even built


def test_kernel_is_the_cpu_default_where_it_builds():
    assert cpu_kernel.available()
    assert default_phi_mode(torch.device("cpu")) == "kernel"
    from megatron_lev.model.embeddings import triton_kernel

    # GPUs run the Triton kernel where Triton imports (test_triton_kernel.py), else the spec's sparse gather
    assert default_phi_mode(torch.device("cuda")) == ("triton" if triton_kernel.available() else "gather")


def test_threads_split_work_without_changing_a_bit():
    u, delta = _inputs(n=200, h=2, d=48)  # 200 x 2 forward tasks, 2 x 3 backward tasks
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _value_and_grads(u, delta, "kernel")
        torch.set_num_threads(3)
        many = _value_and_grads(u, delta, "kernel")
    finally:
        torch.set_num_threads(saved)
    for a, b in zip(one, many):
        assert torch.equal(a, b)  # tasks write disjoint outputs: no reduction order to differ


def test_float32_kernel_matches_float64_within_float32_precision():
    u, delta = _inputs(spread=0.1)  # factors near 1: a well-conditioned product
    ref = _value_and_grads(u, delta, "dense")
    got = _value_and_grads(u.float(), delta.float(), "kernel")
    for name, a, b in zip(("out", "grad u", "grad delta"), got, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=1e-6 * float(b.abs().max()), msg=name)


def test_non_contiguous_inputs_give_the_same_result():
    u, delta = _inputs()
    base = _value_and_grads(u, delta, "kernel")
    u_t = u.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    d_t = delta.transpose(2, 3).contiguous().transpose(2, 3)
    for a, b in zip(base, _value_and_grads(u_t, d_t, "kernel")):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_delta_gradient_alone_equals_delta_gradient_of_the_full_backward():
    u, delta = _inputs()
    alone = delta.clone().requires_grad_()
    spline_product(u, alone, delta.shape[2], "kernel").sum().backward()  # u needs no gradient
    both_u, both_d = u.clone().requires_grad_(), delta.clone().requires_grad_()
    spline_product(both_u, both_d, delta.shape[2], "kernel").sum().backward()
    torch.testing.assert_close(alone.grad, both_d.grad, rtol=0, atol=0)
    assert both_u.grad is not None and float(both_u.grad.abs().sum()) > 0


def test_forked_child_runs_the_kernel_on_its_own_threads():
    u, delta = _inputs(n=64)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parent = spline_product(u, delta, delta.shape[2], "kernel")  # the parent's pool now exists
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: would hang on the parent's (absent) pool threads without the at-fork reset
            ok = torch.equal(spline_product(u, delta, delta.shape[2], "kernel"), parent)
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert os.read(read, 1) == b"1" and status == 0
    finally:
        torch.set_num_threads(saved)


def test_unwritable_cache_falls_back_to_the_temp_dir(tmp_path):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the cache directory should be")
    env = dict(
        os.environ, **{cpu_kernel.ENV_CACHE: str(blocked / "kernels"), "TMPDIR": str(tmp_path / "tmp")}
    )
    (tmp_path / "tmp").mkdir()
    code = "from megatron_lev.model.embeddings import cpu_kernel\nprint(cpu_kernel.available())\n"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "True"
    assert any((tmp_path / "tmp").glob("megatron_lev-kernels-*/lev_cpu-*.so"))
