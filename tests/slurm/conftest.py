"""Fixtures for the Slurm launcher tests: one real two-node cluster per test session."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import JobInfo, SlurmCluster, SlurmError

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = ROOT / "slurm" / "pretrain.sbatch"
# Test nodes have 2 CPUs and no GPUs: the script's #SBATCH values are overridden here.
SMALL_JOB = ["--gpus-per-node=0", "--cpus-per-task=1"]


SLURM_COMMANDS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun")


def missing_slurm() -> list[str]:
    return [c for c in SLURM_COMMANDS if shutil.which(c) is None]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    """Start slurmctld + slurmd n1/n2 (fails with the daemon's log if they cannot start); stop after.

    Without Slurm installed the tests are reported as skipped with the reason, never as
    passed; in CI (CI=true) a missing Slurm is a failure, since CI installs it."""
    missing = missing_slurm()
    if missing:
        reason = (
            f"Slurm is not installed (missing {', '.join(missing)}): "
            "run `sudo .ci/install_system_packages.sh`, then rerun"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def submit_pretrain(
    cluster: SlurmCluster,
    workdir: Path,
    sbatch_args: list[str],
    script_args: list[str],
    env: dict[str, str] | None = None,
) -> str:
    """`sbatch <overrides> slurm/pretrain.sbatch <args>` from `workdir` (logs land there)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"LOG_DIR": str(workdir / "logs"), "OMP_NUM_THREADS": "1", **(env or {})}
    return cluster.sbatch(
        [*SMALL_JOB, *sbatch_args, f"--output={workdir}/slurm-%j.out", str(PRETRAIN), *script_args],
        env=env,
        cwd=workdir,
    )


def run_logs(workdir: Path, job_id: str) -> dict[int, str]:
    """Per-restart step logs of a job: {restart: text}."""
    logs = {}
    for path in (workdir / "logs").glob(f"*-{job_id}-restart*.log"):
        logs[int(re.search(r"restart(\d+)\.log$", path.name).group(1))] = path.read_text(errors="replace")
    return logs


def attempt_logs(workdir: Path, job_id: str) -> dict[tuple[int, int], str]:
    """Step logs of a job by (restart, attempt): a restart after a failure within the job is a new
    attempt with its own log (`...-restart0-attempt1.log`)."""
    logs = {}
    for path in (workdir / "logs").glob(f"*-{job_id}-restart*.log"):
        m = re.search(r"restart(\d+)(?:-attempt(\d+))?\.log$", path.name)
        logs[int(m.group(1)), int(m.group(2) or 0)] = path.read_text(errors="replace")
    return logs


def describe(workdir: Path, info: JobInfo) -> str:
    """Everything a failing assertion should show: the job state and all its logs."""
    parts = [f"job {info.job_id}: {info.state} exit {info.exit_code} restarts {info.restarts}"]
    batch = workdir / f"slurm-{info.job_id}.out"
    parts.append(
        f"--- {batch.name} ---\n" + (batch.read_text(errors="replace") if batch.exists() else "(none)")
    )
    for (restart, attempt), text in sorted(attempt_logs(workdir, info.job_id).items()):
        parts.append(f"--- restart {restart} attempt {attempt} ---\n{text[-4000:]}")
    return "\n".join(parts)


def wait_job(cluster: SlurmCluster, workdir: Path, job_id: str, timeout: float) -> JobInfo:
    """`cluster.wait`, but a timeout also shows the job's own logs."""
    try:
        return cluster.wait(job_id, timeout=timeout)
    except SlurmError as exc:
        info = JobInfo(job_id, "TIMED OUT", "?", -1, {})
        raise SlurmError(f"{exc}\n{describe(workdir, info)}") from None


def wait_for_log(
    cluster: SlurmCluster, workdir: Path, job_id: str, text: str, timeout: float, restart: int = 0
) -> None:
    """Wait until `text` appears in the job's step log of `restart` (fail if the job ends first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in run_logs(workdir, job_id).get(restart, ""):
            return
        if not cluster.queued(job_id):
            break
        time.sleep(0.3)
    info = cluster.wait(job_id, timeout=60)
    raise AssertionError(f"{text!r} never appeared in restart {restart}'s log\n{describe(workdir, info)}")
