"""The README's main job, shrunk: every step runs for real (DeepSpeed on 2 gloo processes)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.multiprocess
def test_demo_runs_end_to_end_and_resumes(tmp_path):
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "megatron_lev",
        "demo",
        "--out",
        str(out),
        "--corpus-mb",
        "2",
        "--vocab-size",
        "1000",
        "--iters",
        "12",
        "--nproc",
        "2",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 12
    assert summary["train_loss_last"] < summary["train_loss_first"]
    ev = summary["evaluation"]
    assert ev["tokens"] > 0 and ev["perplexity"] > 1
    assert sum(b["tokens"] for b in ev["buckets"]) == ev["tokens"]
    assert {r["name"].split(":")[-1].split(" ")[0] for r in summary["capacity"]} == {"input", "output"}
    assert "megatron-lev demo: summary" in first.stdout
    # the input table's geometry beside the loss, from the run's last measured step
    table = summary["input_table"]
    assert table["iteration"] == summary["iterations"] and 0 <= table["mean_row_ratio"] <= 1
    assert table["effective_rank_centred"] >= 1
    assert f"input table        mean-row ratio {table['mean_row_ratio']:.3f}" in first.stdout
    assert (out / "run" / "tensorboard").is_dir() and (out / "hf" / "model.safetensors").exists()

    # a second run skips every finished step
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.count("already done, skipping") == 7

    # the checkpoint and its export give the same held-out perplexity
    evals = {}
    for name, model in (("ckpt", out / "checkpoints"), ("hf", out / "hf")):
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_lev",
                "evaluate",
                str(model),
                "--data",
                str(out / "data" / "corpus"),
                "--split",
                "valid",
                "--split-spec",
                "949,50,1",
                "--name",
                name,
                "--out",
                str(tmp_path / name),
                "--threads",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        evals[name] = json.loads((tmp_path / name / "eval.json").read_text())["results"][0]
    assert evals["ckpt"]["tokens"] == evals["hf"]["tokens"] == ev["tokens"]
    assert evals["ckpt"]["perplexity"] == pytest.approx(evals["hf"]["perplexity"], rel=1e-5)
