"""End-to-end `pretrain(cfg)` on real data, in spawned gloo processes (one start-up for many runs).

Every embedding variant learns; DP=2 with ZeRO-1/2/3 and PP=2 (ZeRO-1, bf16) train,
save and resume, where the resume skips a checkpoint whose save was cut short.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_lev.config import EMBEDDINGS, load_config
from megatron_lev.testing.distributed import run_distributed
from tests.training.conftest import ROOT, tiny_overrides, train_losses

TINY = ROOT / "pretrain" / "configs" / "tiny.yaml"


def _pretrain(overrides: list[str]):
    from megatron_lev.training.run import pretrain

    return pretrain(load_config([TINY], overrides))


def _variants(prefix: str, tok: str, out: str) -> dict:
    results = {}
    for emb in EMBEDDINGS:
        run = Path(out) / emb
        res = _pretrain(tiny_overrides(prefix, tok, run, **{"model.embedding": emb, "train.train_iters": 12,
                                                            "train.lr": 1e-2, "train.lr_warmup_iters": 1}))
        results[emb] = (res.exit_code, res.losses)
    return results


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_every_embedding_variant_learns(minipile_prefix, tokenizer_path, tmp_path):
    (results,) = run_distributed(_variants, world_size=1, args=(minipile_prefix, tokenizer_path, str(tmp_path)),
                                 timeout=180)
    for emb, (code, losses) in results.items():
        first, last = losses[1], sum(losses[i] for i in (10, 11, 12)) / 3
        assert code == 0 and last < first - 0.3, (emb, losses)
    rows = [json.loads(line) for line in (tmp_path / "lev" / "metrics.jsonl").read_text().splitlines()]
    first_train = next(r for r in rows if r["kind"] == "train")
    assert first_train["input_embedding_rms"] > 0 and "tokens_per_s" in first_train


def _save_and_resume(prefix: str, tok: str, out: str, layouts: dict) -> dict:
    results = {}
    for name, extra in layouts.items():
        run = Path(out) / name
        over = tiny_overrides(prefix, tok, run, **{"train.train_iters": 4, "train.save_interval": 2,
                                                   "train.global_batch_size": 8, "train.eval_interval": 2,
                                                   "train.eval_iters": 1, **extra})
        full = _pretrain(over)
        ckpt = run / "ckpt"
        # pretend the save at iteration 4 was killed half-way: no completion marker
        if dist.get_rank() == 0:
            (ckpt / "iter_0000004" / "complete").unlink()
        dist.barrier()
        resumed = _pretrain(over)
        results[name] = {"full": full.losses, "resumed": resumed.losses, "codes": (full.exit_code, resumed.exit_code),
                         "logged": train_losses(run) if (run / "metrics.jsonl").exists() else None,
                         "latest": (ckpt / "latest").read_text().strip()}
        dist.barrier()
    return results


LAYOUTS = {
    "zero1": {"parallel.zero_stage": 1},
    "zero2": {"parallel.zero_stage": 2},
    "zero3": {"parallel.zero_stage": 3},
    "pp2_bf16": {"parallel.pipeline_model_parallel_size": 2, "parallel.zero_stage": 1, "train.precision": "bf16"},
}


@pytest.mark.multiprocess
@pytest.mark.timeout(280)
def test_dp2_zero_1_2_3_and_pp2_bf16_train_save_resume(minipile_prefix, tokenizer_path, tmp_path):
    results = run_distributed(_save_and_resume, world_size=2,
                              args=(minipile_prefix, tokenizer_path, str(tmp_path), LAYOUTS), timeout=260)
    for name in LAYOUTS:
        r = results[0][name]
        assert r["codes"] == (0, 0), name
        assert sorted(r["resumed"]) == [3, 4], (name, r["resumed"])  # resumed from iteration 2
        tol = 1e-2 if "bf16" in name else 1e-6
        for it in (3, 4):
            assert r["resumed"][it] == pytest.approx(r["full"][it], abs=tol), (name, it, r)
        assert r["latest"] == "iter_0000004"
        assert results[1][name]["resumed"] == r["resumed"]  # both ranks log the same mean loss
