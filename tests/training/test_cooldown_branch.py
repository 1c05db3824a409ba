"""A cool-down branch from one checkpoint of a constant-rate (WSD) run: `train.load` names the tag, the
schedule changes only after it, the branch continues from that checkpoint's exact state."""

from __future__ import annotations

import pytest

from megatron_lev.training.metrics import read_metrics
from tests.tiny_run import tiny_overrides
from tests.training.conftest import run_train

pytestmark = pytest.mark.slow

STAGE = {  # 8 iterations: warm-up 2, constant, decay over the last 4; a checkpoint every 2
    "train.train_iters": 8,
    "train.lr_decay_style": "wsd",
    "train.lr_warmup_iters": 2,
    "train.lr_wsd_decay_iters": 4,
    "train.save_interval": 2,
    "train.keep_last": 10,
}
BRANCH = {"train.train_iters": 4, "train.lr_wsd_decay_iters": 2}  # from iteration 2: decay over 2..3


def _rows(out):
    return {r["iteration"]: r for r in read_metrics(out / "metrics.jsonl", kind="train")}


def test_a_branch_from_a_constant_stage_checkpoint_decays_from_there(
    minipile_prefix, tokenizer_path, tmp_path
):
    stage = tmp_path / "stage"
    res = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, stage, **STAGE))
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = stage / "ckpt"
    branch = tmp_path / "branch"
    over = {**STAGE, **BRANCH, "train.load": str(ckpt / "iter_0000002"), "train.save": str(branch / "ckpt")}
    res = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, branch, **over))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "a branch: the 2 updates before the checkpoint" in res.stderr
    before, after = _rows(stage), _rows(branch)
    assert sorted(after) == [3, 4]  # from the named checkpoint, not the stage's latest (8)
    assert after[3]["loss"] == before[3]["loss"]  # the same weights and batch at iteration 3
    assert before[3]["lr"] == before[4]["lr"] == 3e-3  # the stage is still constant there (tiny_run: 3e-3)
    assert after[3]["lr"] < 3e-3 and after[4]["lr"] == pytest.approx(3e-4)  # the decay, to min_lr
    # a requeued branch continues its own checkpoints (its save directory first)
    res = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, branch, **over))
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"{branch / 'ckpt' / 'iter_0000004'}" in res.stderr and sorted(_rows(branch)) == [3, 4]
    # refused in one line: a tag of the run's own save directory, a tag that does not exist
    for load, fragment in (
        (ckpt / "iter_0000002", "saves into a directory of its own"),
        (ckpt / "iter_0000005", "does not exist"),
    ):
        save = ckpt if "own" in fragment else tmp_path / "other"
        bad = tiny_overrides(
            minipile_prefix,
            tokenizer_path,
            tmp_path / "bad",
            **{**over, "train.load": str(load), "train.save": str(save)},
        )
        res = run_train(1, bad)
        assert res.returncode != 0 and fragment in res.stderr, res.stderr[-2000:]
