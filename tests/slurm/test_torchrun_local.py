"""scripts/torchrun_local.sh: the same entry point on one machine without Slurm."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.slurm.conftest import ROOT


@pytest.mark.multiprocess
def test_torchrun_local_starts_a_process_group_of_nproc():
    env = {**os.environ, "NPROC": "2", "ENTRY": "-m tests.slurm.allreduce_probe", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(ROOT / "scripts" / "torchrun_local.sh"), "--steps", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    sums = re.findall(r"\[probe\] rank (\d) local_rank (\d) node local step 0 allreduce_sum (\d+)\b", out)
    assert sorted(sums) == [("0", "0", "3"), ("1", "1", "3")], out


def test_torchrun_local_without_arguments_prints_usage():
    proc = subprocess.run(
        [str(ROOT / "scripts" / "torchrun_local.sh")], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and "usage:" in proc.stderr
