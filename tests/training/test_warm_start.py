"""`train.init_from`: a fresh run starts from a checkpoint's or a Hugging Face model's weights, with a
fresh optimizer, iteration 0 and its own schedule; its provenance says so; a requeue resumes its own
checkpoint; another shape or vocabulary is refused in one line. HF -> train -> export round trip."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_lev.training.metrics import read_metrics
from tests.tiny_run import tiny_overrides
from tests.training.conftest import run_train

pytestmark = pytest.mark.slow
TIED = {"model.embedding": "tied", "train.save_interval": 0}
STILL = {"train.lr": 1e-12, "train.min_lr": 1e-12}  # an update too small to move a weight: the loaded ones


def _canonical(save_dir):
    from megatron_lev.convert.source import load_canonical_state, open_checkpoint

    return load_canonical_state(open_checkpoint(save_dir), progress=False)


def _train(prefix, tok, out, **extra):
    res = run_train(1, tiny_overrides(prefix, tok, out, **extra))
    return res, [
        r["iteration"] for r in read_metrics(out / "metrics.jsonl", kind="train")
    ] if res.returncode == 0 else []


def test_a_run_starts_from_a_checkpoint_and_from_its_hugging_face_export(
    minipile_prefix, tokenizer_path, tmp_path
):
    from transformers import AutoModelForCausalLM

    from megatron_lev.cli import main

    base = tmp_path / "base"
    res, _ = _train(minipile_prefix, tokenizer_path, base, **{**TIED, "train.train_iters": 3})
    assert res.returncode == 0, res.stderr[-3000:]
    trained = _canonical(base / "ckpt")

    # from the checkpoint's tag: weights only, iteration 0, its own schedule
    warm = tmp_path / "warm"
    over = {**TIED, **STILL, "train.train_iters": 2, "train.init_from": str(base / "ckpt" / "iter_0000003")}
    res, iterations = _train(minipile_prefix, tokenizer_path, warm, **over)
    assert res.returncode == 0, res.stderr[-3000:]
    assert iterations == [1, 2] and "warm start: weights from the checkpoint" in res.stderr
    got = _canonical(warm / "ckpt")
    assert set(got) == set(trained)
    for name, tensor in trained.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)
    record = json.loads((warm / "ckpt" / "iter_0000002" / "provenance.json").read_text())
    assert record["init_from"]["kind"] == "checkpoint" and record["init_from"]["tag"] == "iter_0000003"
    # a requeue of the warm-started run resumes its own checkpoint, not the source
    res, _ = _train(minipile_prefix, tokenizer_path, warm, **{**over, "train.train_iters": 3})
    assert res.returncode == 0 and "applies to a fresh start only" in res.stderr, res.stderr[-2000:]

    # HF -> train -> export: the export of a run started from an export computes the same logits
    hf = tmp_path / "hf"
    assert main(["convert", str(base / "ckpt"), str(hf), "--no-progress"]) == 0
    again = tmp_path / "again"
    res, _ = _train(minipile_prefix, tokenizer_path, again, **{**over, "train.init_from": str(hf)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warm start: weights from the huggingface" in res.stderr
    hf2 = tmp_path / "hf2"
    assert main(["convert", str(again / "ckpt"), str(hf2), "--no-progress"]) == 0
    ids = torch.tensor([[5, 50276, 17, 5, 1000, 3]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(hf2).eval()(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_another_shape_or_variant_is_refused_in_one_line(minipile_prefix, tokenizer_path, tmp_path):
    base = tmp_path / "base"
    res, _ = _train(minipile_prefix, tokenizer_path, base, **{**TIED, "train.train_iters": 1})
    assert res.returncode == 0, res.stderr[-3000:]
    source = str(base / "ckpt")
    for change, fragment in (
        ({"model.hidden_size": 64}, "model.hidden_size"),
        ({"model.embedding": "lev"}, "model.embedding"),
        ({"train.init_from": str(tmp_path / "nowhere")}, "no such file or directory"),
    ):
        out = tmp_path / f"bad-{len(fragment)}"
        res, _ = _train(minipile_prefix, tokenizer_path, out, **{**TIED, "train.init_from": source, **change})
        assert res.returncode != 0 and fragment in res.stderr and "Traceback" not in res.stderr, res.stderr[
            -2000:
        ]
        assert "train.init_from" in res.stderr.strip().splitlines()[-1]
