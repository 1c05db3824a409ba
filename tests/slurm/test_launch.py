"""The launch path of slurm/pretrain.sbatch on a real two-node Slurm, with a stand-in trainer.

`tests.slurm.allreduce_probe` joins the process group exactly as the trainer does,
so this shows the rank layout and the rendezvous across nodes independently of the
model code (tests/slurm/test_slurm.py runs the trainer, preemption included).
"""

from __future__ import annotations

import re

import pytest

from tests.slurm.conftest import ROOT, SMALL_JOB, describe, run_logs, submit_pretrain, wait_job

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]
PROBE = {"ENTRY": "-m tests.slurm.allreduce_probe"}


def test_two_nodes_two_tasks_each_rendezvous_and_all_reduce(slurm_cluster, tmp_path):
    job = submit_pretrain(
        slurm_cluster,
        tmp_path,
        ["--nodes=2", "--ntasks-per-node=2", "--time=10", "--signal=USR1@30"],
        ["--steps", "2"],
        env=PROBE,
    )
    info = wait_job(slurm_cluster, tmp_path, job, timeout=90)
    report = describe(tmp_path, info)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", report
    log = run_logs(tmp_path, job)[0]
    tasks = re.findall(r"\[task\] rank (\d)/4 local_rank (\d)/2 node (n\d) \(node_id (\d)\)", log)
    # block distribution: ranks 0,1 on n1 and 2,3 on n2, local ranks 0/1 on each
    assert sorted(tasks) == [
        ("0", "0", "n1", "0"),
        ("1", "1", "n1", "0"),
        ("2", "0", "n2", "1"),
        ("3", "1", "n2", "1"),
    ], report
    sums = re.findall(r"\[probe\] rank (\d) local_rank (\d) node (n\d) step 1 allreduce_sum (\d+)\b", log)
    assert sorted(sums) == [
        ("0", "0", "n1", "10"),
        ("1", "1", "n1", "10"),
        ("2", "0", "n2", "10"),
        ("3", "1", "n2", "10"),
    ], report
    batch = (tmp_path / f"slurm-{job}.out").read_text()
    port = 15000 + int(job) % 17000
    assert f"rendezvous 127.0.0.1:{port} (first node n1)" in batch, report


def test_job_scripts_refuse_missing_inputs_with_a_clear_message(slurm_cluster, tmp_path):
    """A job submitted without its inputs fails at once and says which variable or argument is missing."""
    cases = {
        "convert_eval.sbatch": "set CHECKPOINT to a train.save directory",
        "pretrain.sbatch": "no run config: pass '--config FILE",
        "preprocess.sbatch": "or set INPUTS, OUTPUT_PREFIX and TOKENIZER",
    }
    jobs = {
        script: slurm_cluster.sbatch(
            [
                *SMALL_JOB,
                "--ntasks-per-node=1",
                "--mem=1G",
                "--time=5",
                f"--output={tmp_path}/{script}.out",
                str(ROOT / "slurm" / script),
            ],
            cwd=tmp_path,
        )
        for script in cases
    }
    for script, job in jobs.items():
        info = slurm_cluster.wait(job, timeout=60)
        out = (tmp_path / f"{script}.out").read_text()
        assert info.state == "FAILED" and info.exit_code == "1:0", (
            f"{script}: {info.state} {info.exit_code}\n{out}"
        )
        assert cases[script] in out, out
