"""End-to-end `pretrain(cfg)` on real minipile data with the GPT-NeoX tokenizer.

Every embedding variant learns in a short single-process run; with 2 ranks, DP=2
under ZeRO-1/2/3 and PP=2 (ZeRO-1, bf16) train, save and resume, where the resume
must skip a checkpoint whose save was cut short (no completion marker).
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_lev.model.embeddings import REGISTRY
from tests.training.suites import LAYOUTS

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.mark.parametrize("embedding", tuple(REGISTRY))
def test_every_embedding_variant_learns(single_rank_results, embedding):
    code, losses = single_rank_results["variants"][embedding]
    first, last = losses[1], sum(losses[i] for i in (8, 9, 10)) / 3
    assert code == 0 and last < first - 0.3, losses


def test_metrics_and_config_are_written(single_rank_results):
    run = single_rank_results["out"] / "lev"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == list(range(1, 11))
    assert train[0]["input_embedding_rms"] > 0
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops_per_device",
        "mfu",
        "skipped_steps",
        "tokens",
    ):
        assert key in train[-1], key
    assert train[-1]["tokens"] == 10 * 2 * 32
    assert (run / "config.yaml").is_file() and "embedding: lev" in (run / "config.yaml").read_text()
    assert (run / "ckpt" / "iter_0000010" / "complete").is_file()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_train_save_and_resume(two_rank_results, layout):
    r = two_rank_results[0]["layouts"][layout]
    assert r["codes"] == (0, 0)
    assert sorted(r["resumed"]) == [3, 4], "did not resume from the last complete checkpoint (iteration 2)"
    tol = 1e-2 if "bf16" in layout else 1e-6
    for it in (3, 4):
        assert r["resumed"][it] == pytest.approx(r["full"][it], abs=tol), (it, r)
        assert r["logged"][it] == pytest.approx(
            r["resumed"][it], abs=1e-9
        )  # metrics.jsonl: the resumed line wins
    assert r["latest"] == "iter_0000004"
    assert two_rank_results[1]["layouts"][layout]["resumed"] == r["resumed"]  # both ranks log the mean loss


def test_validation_loss_and_perplexity_are_logged(two_rank_results):
    valid = two_rank_results[0]["layouts"]["zero1"]["valid"]
    assert [v["iteration"] for v in valid] == [2, 4, 4]  # full run at 2 and 4, the resumed run at 4
    for v in valid:
        assert v["ppl"] == pytest.approx(math.exp(v["loss"]), rel=1e-9)
    assert valid[1]["loss"] < valid[0]["loss"]
    assert valid[2]["loss"] == pytest.approx(valid[1]["loss"], abs=1e-6)
