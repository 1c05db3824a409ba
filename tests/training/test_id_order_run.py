"""`model.lev.id_order=frequency` through the trainer: the plan takes the counts from the training
data, the run records them and stores the order; a resume needs no counts file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lev.model.embeddings.id_order import frequency_ranks
from tests.training.conftest import run_train, tiny_overrides, train_losses

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

ID_RANK = "embedding.codebooks.id_rank"


def _stored_rank(tag_dir):
    state = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")
    return state["module"][ID_RANK]


def test_frequency_order_trains_records_its_counts_and_resumes_without_them(
    minipile_prefix, tokenizer_path, tmp_path
):
    out = tmp_path / "run"
    over = {"model.lev.id_order": "frequency", "train.train_iters": 4, "train.save_interval": 2}
    first = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, out, **over))
    assert first.returncode == 0, first.stderr[-3000:]
    counts_file = f"{minipile_prefix}.counts.npy"
    assert f"id_order_counts: {counts_file}" in (out / "config.yaml").read_text()  # filled by the plan
    assert f"id_order_counts: {counts_file}" in (out / "ckpt" / "iter_0000004" / "config.yaml").read_text()
    counts = np.load(counts_file)
    rank = _stored_rank(out / "ckpt" / "iter_0000004")
    assert torch.equal(rank, frequency_ranks(counts, len(rank)))
    assert int(rank[int(np.argmax(counts))]) == 0

    # the counts file is gone (another machine): a fresh start is refused, the resume is not
    gone = {**over, "model.lev.id_order_counts": str(tmp_path / "gone.counts.npy")}
    fresh = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, tmp_path / "fresh", **gone))
    assert fresh.returncode != 0
    assert "model.lev.id_order_counts=" in fresh.stderr and "it is not there" in fresh.stderr
    assert "Traceback" not in fresh.stderr
    more = {**gone, "train.train_iters": 6}
    resumed = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, out, **more))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "resumed from" in resumed.stderr + resumed.stdout
        and "(iteration 4)" in resumed.stderr + resumed.stdout
    )
    assert sorted(train_losses(out)) == [1, 2, 3, 4, 5, 6]
    assert torch.equal(_stored_rank(out / "ckpt" / "iter_0000006"), rank)
