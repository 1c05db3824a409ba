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


def _script(args: list[str], **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1", "RESTART_DELAY": "0", **env}
    return subprocess.run(
        [str(ROOT / "scripts" / "torchrun_local.sh"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.multiprocess
def test_torchrun_local_restarts_a_killed_rank_once_then_the_run_ends_well(tmp_path):
    marker = tmp_path / "killed"
    proc = _script(
        ["--steps", "2", "--kill-rank", "1", "--kill-once", str(marker)],
        ENTRY="-m tests.slurm.allreduce_probe",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and marker.exists(), out
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL", out), out
    assert "restart after a failure (1 of 3 within 3600 s): status 1; starting attempt 1" in out, out
    assert len(re.findall(r"\[probe\] rank 1 local_rank 1 node local step 1 allreduce_sum 3\b", out)) == 1, (
        out
    )


@pytest.mark.multiprocess
def test_torchrun_local_ends_a_crash_loop_at_the_limit(tmp_path):
    proc = _script(
        ["--steps", "2", "--kill-rank", "1"], ENTRY="-m tests.slurm.allreduce_probe", MAX_FAILURES="1"
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 75), out
    assert len(re.findall(r"rank 1 \(pid \d+\) was killed by SIGKILL", out)) == 2, out
    last = proc.stderr.strip().splitlines()[-1]
    assert "not restarting after status 1: failure 2 within 3600 s (MAX_FAILURES=1" in last, out


@pytest.mark.multiprocess
def test_torchrun_local_does_not_restart_a_config_error(tmp_path):
    proc = _script(
        ["--config", str(ROOT / "tests" / "configs" / "tiny.yaml"), "train.lr_decay_style=cosin"],
        DS_ACCELERATOR="cpu",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "train.lr_decay_style='cosin' is not one of" in out, out
    assert "not restarting: status 2 is an error a restart cannot cure" in out and "restart after" not in out


def _lib(command: str) -> str:
    """The output of `command` run in bash after sourcing slurm/lib.sh (the launchers' shared rules)."""
    proc = subprocess.run(
        ["bash", "-c", f'source "{ROOT / "slurm" / "lib.sh"}" && {command}'], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_failures_outside_the_window_do_not_count(tmp_path):
    """The limit ends a crash loop, never a long run that fails now and then: three failures a
    day ago and this one make 1 within the hour."""
    import time

    record = tmp_path / "failures"
    now = int(time.time())
    record.write_text("".join(f"{now - 86400 + i} status 1: old\n" for i in range(3)))
    assert _lib(f'mlev_count_failure "{record}" 3600 status 1: now') == "1"
    assert _lib(f'mlev_count_failure "{record}" 100000 status 1: again') == "5"
    assert len(record.read_text().splitlines()) == 5


@pytest.mark.parametrize(
    "reports,status,kind",
    [
        ({}, 137, "crash"),  # every rank killed outright
        ({0: "1 crash"}, 1, "crash"),  # rank 0 lost its peer, rank 1 killed
        ({0: "2 fatal", 1: "2 fatal"}, 2, "fatal"),  # a config error on every rank
        ({0: "1 crash", 1: "1 fatal"}, 1, "fatal"),  # a data error on one rank
        ({0: "3"}, 3, "fatal"),  # a report without a kind (an older trainer): the skip limit
        ({}, 2, "fatal"),  # nothing reported, a usage error
        ({0: "75 preempted", 1: "1 crash"}, 1, "crash"),
    ],
)
def test_failure_kind_from_the_ranks_reports(tmp_path, reports, status, kind):
    for rank, text in reports.items():
        (tmp_path / f"rank{rank}").write_text(text + "\n")
    assert _lib(f'mlev_failure_kind "{tmp_path}" {status}') == kind


def test_the_cause_of_a_restart_names_the_first_failed_task(tmp_path):
    log = tmp_path / "step.log"
    log.write_text(
        "0: before\nsrun: error: n2: tasks 1-2: Killed\nsrun: error: n1: task 0: Exited with exit code 1\n"
    )
    assert _lib(f'mlev_failure_cause "{log}" 0 137') == "rank 1-2 (node n2) was killed by SIGKILL"
    assert _lib(f'mlev_failure_cause "{log}" 99999 1') == "the step exited with status 1"
