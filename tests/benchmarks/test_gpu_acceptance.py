"""benchmarks/gpu_acceptance.py in its tiny CPU mode: the GPU run's code paths cannot rot unnoticed.

The script runs as a user would start it (a child process, gloo, Triton's interpreter),
writes its report to a temporary path (never the committed results/gpu.md), and must
exit 0 with every section present and none FAILED.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.py"
SECTIONS = (
    "LEV kernels: Triton and gather vs the fp64 spec formula",
    "flash-attn vs scaled_dot_product_attention",
    "bf16 training tracks fp32 (30 steps)",
    "Fused head + loss vs the logits path at V = 200,064",
    "2-process data-parallel run",
    "Throughput, MFU, peak memory and syncs per step",
)


def _env() -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TRITON_INTERPRET")
    }
    env.update(
        {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    )
    return env


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_tiny_cpu_mode_writes_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = out.read_text()
    for title in SECTIONS:
        assert f"## {title}: " in report, title
    assert ": FAILED" not in report and "| FAILED" not in report, report
    assert "| tiny | lev | none |" in report and "| tiny | tied | full |" in report
    assert "| tiny | lev | selective |" in report and "| tiny | lev | compiled |" in report
    assert "LEV/TIED step time" in report and "Python-side reads in one LEV step" in report
    assert "| triton |" in report or "triton kernel" in report  # checked, or the reason it was not


def _module():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failing_section_is_recorded_and_marks_correctness():
    mod = _module()
    report = mod.Report()

    def broken():
        raise RuntimeError("values differ")

    report.run("a check", broken, correctness=True)
    report.run("a benchmark", lambda: ("SKIPPED", ["no GPU"]))
    text = report.markdown(["# t"])
    assert report.correctness_failed
    assert "## a check: FAILED" in text and "RuntimeError: values differ" in text
    assert "## a benchmark: SKIPPED" in text and "no GPU" in text


def test_peak_table_names_the_h100_class_peak():
    mod = _module()
    assert mod.PEAK_TFLOPS["H100"] == mod.PEAK_TFLOPS["H200"] == 989.0
