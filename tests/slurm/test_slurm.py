"""The real pipeline under a real two-node Slurm: preprocess job, multi-node pretraining,
preemption by signal, requeue, and resume from the checkpoint.

Each job is `sbatch slurm/<script>` unchanged; only #SBATCH values are overridden
on the command line (the test nodes have 2 CPUs and no GPUs).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
from pathlib import Path

import pytest
import zstandard

from tests.slurm.conftest import (
    ROOT,
    SMALL_JOB,
    attempt_logs,
    describe,
    run_logs,
    submit_pretrain,
    wait_for_log,
    wait_job,
)

pytestmark = [pytest.mark.slurm, pytest.mark.multiprocess]

TINY = [
    "--config",
    str(ROOT / "tests" / "configs" / "tiny.yaml"),
    "model.seq_length=64",
    "train.micro_batch_size=2",
    "train.lr_warmup_iters=2",
    "logging.log_interval=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="module")
def tiny_data(slurm_cluster, shared_data, tmp_path_factory) -> tuple[Path, Path]:
    """400 Fortunes documents tokenised by `slurm/preprocess.sbatch`; returns (prefix, tokenizer)."""
    work = tmp_path_factory.mktemp("preprocess")
    lines = []
    with (shared_data / "minipile" / "Fortunes.jsonl.zst").open("rb") as fh:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(fh), encoding="utf-8")
        for line in text:
            lines.append(line)
            if len(lines) == 400:
                break
    source = work / "fortunes_400.jsonl"
    source.write_text("".join(lines))
    tokenizer = shared_data / "tokenizers" / "gpt-neox-20b.json"
    prefix = work / "fortunes"
    job = slurm_cluster.sbatch(
        [
            *SMALL_JOB,
            "--mem=1G",
            "--time=5",
            f"--output={work}/slurm-%j.out",
            str(ROOT / "slurm" / "preprocess.sbatch"),
            "--input",
            str(source),
            "--output-prefix",
            str(prefix),
            "--tokenizer",
            str(tokenizer),
            "--no-progress",
        ],
        env={"LOG_DIR": str(work / "logs")},
        cwd=work,
    )
    info = slurm_cluster.wait(job, timeout=120)
    logs = "\n".join(p.read_text() for p in [work / f"slurm-{job}.out", *(work / "logs").glob("*.log")])
    assert info.state == "COMPLETED", f"preprocess job {job}: {info.state} {info.exit_code}\n{logs}"
    assert "--workers 1" in logs, logs  # the task's CPU count, since the test passed none
    stats = json.loads(prefix.with_suffix(".stats.json").read_text())
    assert stats["documents"] == 400 and prefix.with_suffix(".bin").stat().st_size > 0, stats
    return prefix, tokenizer


def _train_args(prefix: Path, tokenizer: Path, run: Path, iters: int) -> list[str]:
    return [
        *TINY,
        f"data.data_path=[{prefix}]",
        f"data.tokenizer_path={tokenizer}",
        f"train.save={run / 'ckpt'}",
        f"logging.output_dir={run / 'out'}",
        f"train.train_iters={iters}",
    ]


def test_pretrain_two_nodes_then_preempt_requeue_resume(slurm_cluster, tiny_data, tmp_path):
    prefix, tokenizer = tiny_data
    run = tmp_path / "run"
    nodes = ["--nodes=2", "--ntasks-per-node=1", "--time=10", "--signal=USR1@30"]

    # 1. a two-node run of 3 iterations that writes a checkpoint
    job = submit_pretrain(slurm_cluster, tmp_path, nodes, _train_args(prefix, tokenizer, run, 3))
    info = wait_job(slurm_cluster, tmp_path, job, timeout=150)
    report = describe(tmp_path, info)
    assert info.state == "COMPLETED" and info.exit_code == "0:0", report
    log = run_logs(tmp_path, job)[0]
    assert "0: [task] rank 0/2 local_rank 0/1 node n1" in log, report
    assert "1: [task] rank 1/2 local_rank 0/1 node n2" in log, report
    assert "world 2 = TP 1 x PP 1 x DP 2" in log and "iter 3/3 | loss" in log, report
    assert "no checkpoint under" in log and "saved checkpoint" in log, report
    assert (run / "ckpt" / "latest").read_text().strip() == "iter_0000003", report

    # 2. the same run continued to 12 iterations, preempted by SIGUSR1 to its ranks
    #    (what --signal sends before the time limit): save, exit 75, requeue, resume, finish
    job = submit_pretrain(slurm_cluster, tmp_path, nodes, _train_args(prefix, tokenizer, run, 12))
    wait_for_log(slurm_cluster, tmp_path, job, "iter 5/12 | loss", timeout=150)
    slurm_cluster.run(["scancel", "--signal=USR1", job])
    info = wait_job(slurm_cluster, tmp_path, job, timeout=180)
    report = describe(tmp_path, info)
    assert info.state == "COMPLETED" and info.restarts == 1, report
    logs = run_logs(tmp_path, job)
    assert sorted(logs) == [0, 1], report
    assert "(iteration 3)" in logs[0] and "resumed from" in logs[0], report
    stopped = re.search(r"preempted at iteration (\d+): checkpoint saved, exiting with status 75", logs[0])
    assert stopped, report
    step = int(stopped.group(1))
    assert 5 <= step < 12, report
    assert "1: [task] rank 1/2 local_rank 0/1 node n2 (node_id 1) restart 1" in logs[1], report
    assert f"iter_{step:07d} (iteration {step})" in logs[1], report  # resumed, not from step 0
    assert f"iter {step + 1}/12 | loss" in logs[1] and "iter 12/12 | loss" in logs[1], report
    assert "iter 1/12 |" not in logs[1], report
    assert (run / "ckpt" / "latest").read_text().strip() == "iter_0000012", report
    batch = (tmp_path / f"slurm-{job}.out").read_text()
    assert "requeueing (next restart 1)" in batch, report


def _model_states(ckpt: Path, iteration: int) -> dict:
    import torch

    state = torch.load(ckpt / f"iter_{iteration:07d}" / "mp_rank_00_model_states.pt", weights_only=False)
    return state["module"]


def test_a_killed_rank_is_restarted_and_ends_with_the_weights_of_an_uninterrupted_run(
    slurm_cluster, tiny_data, tmp_path
):
    """Rank 1 of a two-node run is killed by SIGKILL mid-run (as the out-of-memory killer would): the
    job starts a new step in its allocation, which resumes from the last checkpoint and ends with
    the same weights, bit for bit, as the same run never interrupted."""
    import torch

    prefix, tokenizer = tiny_data
    nodes = ["--nodes=2", "--ntasks-per-node=1", "--time=10", "--signal=USR1@30"]
    env = {"RESTART_DELAY": "1", "TASK_EXIT_GRACE": "20"}
    runs = {}
    for name in ("uninterrupted", "killed"):
        run = tmp_path / name
        args = [*_train_args(prefix, tokenizer, run, 10), "train.save_interval=3"]
        job = submit_pretrain(slurm_cluster, tmp_path / f"{name}-job", nodes, args, env=env)
        if name == "killed":
            wait_for_log(slurm_cluster, tmp_path / f"{name}-job", job, "iter 5/10 | loss", timeout=150)
            log = run_logs(tmp_path / f"{name}-job", job)[0]
            pid = int(re.search(r"1: \[task\] rank 1/2 .* pid (\d+)", log).group(1))
            os.kill(pid, signal.SIGKILL)  # both test nodes are this machine
        info = wait_job(slurm_cluster, tmp_path / f"{name}-job", job, timeout=300)
        report = describe(tmp_path / f"{name}-job", info)
        assert info.state == "COMPLETED" and info.exit_code == "0:0", report
        runs[name] = (run, job, report)

    run, job, report = runs["killed"]
    batch = (tmp_path / "killed-job" / f"slurm-{job}.out").read_text()
    assert re.search(
        r"restart after a failure \(1 of 3 within 3600 s\): rank 1 \(node n2\) was killed by SIGKILL", batch
    ), report
    logs = attempt_logs(tmp_path / "killed-job", job)
    assert sorted(logs) == [(0, 0), (0, 1)], report
    resumed = re.search(r"iter_(\d{7}) \(iteration (\d+)\)", logs[0, 1])
    assert resumed and int(resumed.group(2)) in (3, 6), report  # from a checkpoint, not from step 0
    assert "iter 10/10 | loss" in logs[0, 1] and "iter 1/10 |" not in logs[0, 1], report
    reference = _model_states(runs["uninterrupted"][0] / "ckpt", 10)
    restarted = _model_states(run / "ckpt", 10)
    assert reference.keys() == restarted.keys()
    differ = [k for k in reference if not torch.equal(reference[k], restarted[k])]
    assert not differ, f"weights differ from the uninterrupted run's: {differ[:5]}\n{report}"


def test_a_config_error_ends_the_job_at_once_without_a_restart(slurm_cluster, tiny_data, tmp_path):
    """Its healthy twin: an error a restart cannot cure (here a config value) is not retried."""
    prefix, tokenizer = tiny_data
    args = [*_train_args(prefix, tokenizer, tmp_path / "run", 4), "train.lr_decay_style=cosin"]
    job = submit_pretrain(
        slurm_cluster,
        tmp_path,
        ["--nodes=1", "--ntasks-per-node=2", "--time=5", "--signal=USR1@30"],
        args,
        env={"RESTART_DELAY": "0"},
    )
    info = wait_job(slurm_cluster, tmp_path, job, timeout=120)
    report = describe(tmp_path, info)
    assert info.state == "FAILED" and info.exit_code == "2:0", report
    batch = (tmp_path / f"slurm-{job}.out").read_text()
    assert "not restarting: the run failed with status 2 for a reason a restart cannot cure" in batch, report
    assert "restart after a failure" not in batch and sorted(attempt_logs(tmp_path, job)) == [(0, 0)], report
    assert "train.lr_decay_style='cosin' is not one of" in attempt_logs(tmp_path, job)[0, 0], report
