"""The launch path of slurm/pretrain.sbatch on a real two-node Slurm, with a stand-in trainer.

`tests.slurm.allreduce_probe` joins the process group exactly as the trainer does,
so these tests show the rendezvous across nodes and the preempt-requeue-resume
cycle independently of the model code (tests/slurm/test_slurm.py runs the trainer).
"""

from __future__ import annotations

import re

import pytest

from tests.slurm.conftest import describe, run_logs, submit_pretrain, wait_for_log, wait_job

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]
PROBE = {"ENTRY": "-m tests.slurm.allreduce_probe"}


def test_two_nodes_two_tasks_each_rendezvous_and_all_reduce(slurm_cluster, tmp_path):
    job = submit_pretrain(slurm_cluster, tmp_path, ["--nodes=2", "--ntasks-per-node=2", "--time=10",
                                                    "--signal=USR1@30"],
                          ["--steps", "2", "--save", str(tmp_path / "ckpt")], env=PROBE)
    info = wait_job(slurm_cluster, tmp_path, job, timeout=90)
    report = describe(tmp_path, info)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", report
    log = run_logs(tmp_path, job)[0]
    tasks = re.findall(r"\[task\] rank (\d)/4 local_rank (\d)/2 node (n\d) \(node_id (\d)\)", log)
    # block distribution: ranks 0,1 on n1 and 2,3 on n2, local ranks 0/1 on each
    assert sorted(tasks) == [("0", "0", "n1", "0"), ("1", "1", "n1", "0"),
                             ("2", "0", "n2", "1"), ("3", "1", "n2", "1")], report
    sums = re.findall(r"\[probe\] rank (\d) node (n\d) step 1 allreduce_sum (\S+)", log)
    assert sorted(sums) == [("0", "n1", "10"), ("1", "n1", "10"), ("2", "n2", "10"), ("3", "n2", "10")], report
    batch = (tmp_path / f"slurm-{job}.out").read_text()
    port = 15000 + int(job) % 17000
    assert f"rendezvous 127.0.0.1:{port} (first node n1)" in batch, report


def test_preemption_signal_requeues_and_resumes(slurm_cluster, tmp_path):
    """SIGUSR1 to the job step (what --signal sends before the limit): save, exit 75, requeue, resume."""
    job = submit_pretrain(slurm_cluster, tmp_path, ["--nodes=2", "--ntasks-per-node=1", "--time=10",
                                                    "--signal=USR1@30"],
                          ["--until-signal", "--steps", "3", "--save", str(tmp_path / "ckpt")], env=PROBE)
    wait_for_log(slurm_cluster, tmp_path, job, "rank 1 node n2 step 3 ", timeout=60)
    slurm_cluster.run(["scancel", "--signal=USR1", job])
    info = wait_job(slurm_cluster, tmp_path, job, timeout=90)
    report = describe(tmp_path, info)
    assert info.state == "COMPLETED" and info.restarts == 1, report
    logs = run_logs(tmp_path, job)
    assert sorted(logs) == [0, 1], report
    stopped = re.findall(r"rank (\d) node (n\d) preempted at step (\d+) \(signal 10\)", logs[0])
    assert {(r, n) for r, n, _ in stopped} == {("0", "n1"), ("1", "n2")}, report
    step = int(stopped[0][2])
    assert step >= 3, report
    assert "restart 1" in logs[1] and f"rank 0/2 node n1 resumed from step {step}" in logs[1], report
    assert f"rank 1 node n2 finished at step {step + 3}" in logs[1], report
    batch = (tmp_path / f"slurm-{job}.out").read_text()
    assert "requeueing (next restart 1)" in batch, report
