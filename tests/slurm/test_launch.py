"""The launch path of slurm/pretrain.sbatch on a real two-node Slurm, with a stand-in trainer.

`tests.slurm.allreduce_probe` joins the process group exactly as the trainer does,
so this shows the rank layout and the rendezvous across nodes independently of the
model code (tests/slurm/test_slurm.py runs the trainer, preemption included).
"""

from __future__ import annotations

import re
import sys
import time

import pytest

from tests.slurm.conftest import ROOT, SMALL_JOB, attempt_logs, describe, run_logs, submit_pretrain, wait_job

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


def test_a_killed_task_is_named_restarted_and_a_crash_loop_ends_at_the_limit(slurm_cluster, tmp_path):
    """Rank 1 is killed by SIGKILL after the first all-reduce, at every attempt: the batch output
    names the rank, its node and signal, and quotes the end of its output; the job starts a new
    step once (MAX_FAILURES=1) with the cause and count logged, then ends at the limit."""
    job = submit_pretrain(
        slurm_cluster,
        tmp_path,
        ["--nodes=1", "--ntasks-per-node=2", "--time=5", "--signal=USR1@30"],
        ["--steps", "3", "--kill-rank", "1"],
        env={**PROBE, "TASK_EXIT_GRACE": "5", "MAX_FAILURES": "1", "RESTART_DELAY": "0"},
    )
    info = wait_job(slurm_cluster, tmp_path, job, timeout=120)
    report = describe(tmp_path, info)
    assert info.state == "FAILED" and info.restarts == 0, report
    batch = (tmp_path / f"slurm-{job}.out").read_text()
    named = re.findall(r"rank 1 \(node n1\) was killed by SIGKILL; its last lines in \S+\.log:", batch)
    assert len(named) == 2, report  # once per attempt
    assert re.search(r"\n {4}1: \[probe\] rank 1 is about to be killed\n", batch), report
    assert re.search(
        r"restart after a failure \(1 of 1 within 3600 s\): rank 1 \(node n1\) was killed by SIGKILL; "
        r"starting attempt 1 in 0 s from the last checkpoint",
        batch,
    ), report
    assert re.search(
        r"not restarting after rank 1 \(node n1\) was killed by SIGKILL: "
        r"failure 2 within 3600 s \(MAX_FAILURES=1",
        batch,
    ), report
    assert sorted(attempt_logs(tmp_path, job)) == [(0, 0), (0, 1)], report
    assert "attempt 1" in batch.split("starting attempt 1")[1].split("\n", 2)[1], report  # its own rendezvous
    failures = (tmp_path / "logs" / f"megatron-lev-{job}.failures").read_text().splitlines()
    assert len(failures) == 2 and all("was killed by SIGKILL" in line for line in failures), failures


@pytest.fixture(scope="module")
def shard(tmp_path_factory, shared_data) -> tuple[str, str]:
    """100 Wikipedia documents preprocessed with the GPT-NeoX tokenizer: (prefix, tokenizer)."""
    import io
    import itertools

    import zstandard

    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    work = tmp_path_factory.mktemp("launch-data")
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8")
        (work / "docs.jsonl").write_text("".join(itertools.islice(reader, 100)))
    tok = str(shared_data / "tokenizers" / "gpt-neox-20b.json")
    prefix = str(work / "wiki_text_document")
    preprocess(PreprocessOptions([str(work / "docs.jsonl")], prefix, "hf", tok, workers=1, progress=False))
    return prefix, tok


def test_the_trainer_in_a_batch_shell_of_two_tasks_refuses_at_once(slurm_cluster, shard, tmp_path):
    """`python -m megatron_lev train` run by the batch script itself (no srun) sees
    SLURM_NTASKS=2 and SLURM_PROCID=0: before, it waited forever for a rank 1 nobody starts."""
    prefix, tok = shard
    script = tmp_path / "direct.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"cd {ROOT}\n"
        f"export PYTHONPATH={ROOT} OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu\n"
        f"exec {sys.executable} -m megatron_lev train --config tests/configs/tiny.yaml "
        f"data.data_path=[{prefix}] data.tokenizer_path={tok} data.split=98,2,0 train.train_iters=2 "
        f"model.num_layers=2 logging.output_dir={tmp_path / 'run'}\n"
    )
    job = slurm_cluster.sbatch(
        [*SMALL_JOB, "--nodes=1", "--ntasks=2", "--time=5", f"--output={tmp_path}/direct.out", str(script)],
        cwd=tmp_path,
    )
    start = time.monotonic()
    info = slurm_cluster.wait(job, timeout=120)
    out = (tmp_path / "direct.out").read_text()
    assert info.state == "FAILED" and info.exit_code == "2:0", f"{info.state} {info.exit_code}\n{out}"
    last = out.strip().splitlines()[-1]
    assert re.search(r"SLURM_NTASKS=2 and SLURM_PROCID=0 .* not started by srun", last), out
    assert time.monotonic() - start < 90
