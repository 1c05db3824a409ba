"""The output prefix each task of a `slurm/preprocess.sbatch` job array gets, without Slurm:
the script runs under bash with the environment Slurm would set and a stand-in `srun`
that records the command it was given."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT

SCRIPT = ROOT / "slurm" / "preprocess.sbatch"


def run_task(tmp: Path, names: list[str], task: int) -> subprocess.CompletedProcess:
    inputs = tmp / "in"
    inputs.mkdir(exist_ok=True)
    for name in names:
        (inputs / name).write_text("")
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text('#!/usr/bin/env bash\nprintf "arg:%s\\n" "$@"\n')
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "MEGATRON_LEV_ROOT": str(ROOT),
        "MEGATRON_LEV_PYTHON": sys.executable,
        "SLURM_JOB_ID": "7",
        "SLURM_ARRAY_TASK_ID": str(task),
        "INPUTS": f"{inputs}/*",
        "OUTPUT_PREFIX": str(tmp / "out" / "c4"),
        "TOKENIZER": "tok.json",
        "LOG_DIR": str(tmp / f"logs{task}"),
    }
    return subprocess.run(["bash", str(SCRIPT)], env=env, cwd=tmp, capture_output=True, text=True, timeout=60)


def prefix_of(tmp: Path, task: int) -> str:
    log = next((tmp / f"logs{task}").iterdir()).read_text().splitlines()
    args = [line.split("arg:", 1)[1] for line in log if "arg:" in line]
    return args[args.index("--output-prefix") + 1]


C4 = ["c4-train.00000-of-01024.json.gz", "c4-train.00001-of-01024.json.gz", "c4-train.00002-of-01024.json.gz"]


@pytest.mark.parametrize(
    "names, expected",
    [
        pytest.param(C4, [f"c4_{n[: -len('.json.gz')]}" for n in C4], id="dotted-names-keep-their-dots"),
        pytest.param(
            ["00.jsonl.zst", "01.jsonl.zst", "02.jsonl"], ["c4_00", "c4_01", "c4_02"], id="pile-names"
        ),
        pytest.param(
            ["a.parquet", "b.json", "v1.2.jsonl.gz"], ["c4_a", "c4_b", "c4_v1.2"], id="other-extensions"
        ),
    ],
)
def test_each_array_task_gets_its_own_prefix(names, expected, tmp_path):
    got = []
    for task in range(len(names)):
        res = run_task(tmp_path, names, task)
        assert res.returncode == 0, res.stderr
        got.append(Path(prefix_of(tmp_path, task)).name)
    assert got == expected and len(set(got)) == len(names)


def test_two_inputs_with_one_name_are_refused(tmp_path):
    res = run_task(tmp_path, ["part.jsonl", "part.jsonl.zst"], 0)
    assert res.returncode == 1
    assert "both give the output prefix" in res.stderr and "part.jsonl.zst" in res.stderr, res.stderr
