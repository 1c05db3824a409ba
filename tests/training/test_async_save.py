"""`train.async_save` in a training run: the same numbers, and the same complete checkpoints, as saving
synchronously (2 ranks: the completion's wait is collective)."""

from __future__ import annotations

import pytest

from megatron_lev.ckpt import layout as ck
from tests.tiny_run import tiny_overrides
from tests.training.conftest import run_train, train_losses


@pytest.mark.multiprocess
def test_training_with_async_save_gives_the_synchronous_run(minipile_prefix, tokenizer_path, tmp_path):
    extra = {"train.train_iters": 6, "train.save_interval": 2, "train.keep_last": 2}
    runs = {}
    for name, background in (("sync", False), ("async", True)):
        out = tmp_path / name
        extra["train.async_save"] = background
        over = tiny_overrides(minipile_prefix, tokenizer_path, out, **extra)
        res = run_train(2, over)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = (out, res)
    (sync, _), (background, res) = runs["sync"], runs["async"]
    assert train_losses(background) == train_losses(sync)  # bit for bit
    tags = sorted(p.name for p in (background / "ckpt").glob("iter_*"))
    assert tags == sorted(p.name for p in (sync / "ckpt").glob("iter_*")) == ["iter_0000004", "iter_0000006"]
    for tag in tags:
        assert ck.verify_checkpoint(background / "ckpt" / tag) == []
    assert ck.read_latest(background / "ckpt")[0] == "iter_0000006"
    assert "completed (checksums, latest)" in res.stderr, res.stderr[-3000:]
