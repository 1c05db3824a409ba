"""`train.exit_interval`: the run saves and exits (status 0) at each multiple short of its end, and the
same command run again continues it; the stages together are the uninterrupted run, bit for bit."""

from __future__ import annotations

import pytest

from tests.tiny_run import tiny_overrides
from tests.training.conftest import run_train

pytestmark = pytest.mark.multiprocess


def _losses(out):
    from megatron_lev.training.metrics import read_metrics

    return {r["iteration"]: r["loss"] for r in read_metrics(out / "metrics.jsonl", kind="train")}


def test_stages_are_the_uninterrupted_run(minipile_prefix, tokenizer_path, tmp_path):
    extra = {"train.train_iters": 6, "train.save_interval": 100, "train.lr_decay_style": "cosine"}
    whole = tmp_path / "whole"
    res = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, whole, **extra))
    assert res.returncode == 0, res.stderr[-3000:]
    staged = tmp_path / "staged"
    over = tiny_overrides(minipile_prefix, tokenizer_path, staged, **extra, **{"train.exit_interval": 3})
    first = run_train(1, over)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in (staged / "ckpt").glob("iter_*")) == ["iter_0000003"]
    assert max(_losses(staged)) == 3
    second = run_train(1, over)  # the same command: resumes at 3, runs to the end (6), no stop at 6
    assert second.returncode == 0, second.stderr[-3000:]
    assert (staged / "ckpt" / "iter_0000006").is_dir()
    assert _losses(staged) == _losses(whole)  # bit for bit, the data order and schedule of one run
