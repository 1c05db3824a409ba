"""`megatron-lev evaluate` on a tiny random Llama: MMIDIDX shard and Pile-format text, checked
independently."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_lev.analysis.corpora import text_documents
from megatron_lev.cli import main as cli
from megatron_lev.data.indexed import IndexedDatasetBuilder
from megatron_lev.data.manifest import write_manifest


def _reference_nll(model_dir, stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows of S+1 tokens with stride S through the concatenated stream, scored by F.cross_entropy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    out = []
    with torch.no_grad():
        for s in range(0, len(stream) - 1, seq_len):
            win = torch.from_numpy(stream[s : s + seq_len + 1])[None]
            logits = model(input_ids=win[:, :-1]).logits
            out.append(F.cross_entropy(logits[0], win[0, 1:], reduction="none").numpy())
    return np.concatenate(out).astype(np.float64)


def test_evaluate_mmidx_shard_with_buckets(tiny_llama, tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 300, size=n) for n in (40, 7, 55, 23)]
    builder = IndexedDatasetBuilder(tmp_path / "heldout_text_document", dtype=np.uint16)
    for d in docs:
        builder.add_document(d)
    builder.finalize()
    write_manifest(tmp_path / "heldout_text_document", [str(tmp_path / "heldout_text_document")], {}, 299)
    counts = np.zeros(50277, dtype=np.int64)
    counts[:300] = rng.integers(0, 1_000_000, size=300)
    counts[300:] = 1
    np.save(tmp_path / "train.counts.npy", counts)
    rc = cli(
        [
            "evaluate",
            str(tiny_llama),
            "--data",
            str(tmp_path / "heldout_text_document"),
            "--counts",
            str(tmp_path / "train.counts.npy"),
            "--seq-len",
            "16",
            "--batch-size",
            "3",
            "--out",
            str(tmp_path / "out"),
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "out" / "eval.json").read_text())["results"][0]
    ref = _reference_nll(tiny_llama, np.concatenate(docs), 16)
    assert res["tokens"] == len(ref) == sum(map(len, docs)) - 1
    assert res["perplexity"] == pytest.approx(math.exp(ref.mean()), rel=1e-5)
    assert sum(b["tokens"] for b in res["buckets"]) == res["tokens"]
    assert sum(b["vocab_ids"] for b in res["buckets"]) == 50277
    assert "perplexity" in (tmp_path / "out" / "eval.md").read_text()


def test_evaluate_pile_jsonl_zst_reports_bits_per_byte(tiny_llama, shared_data, tmp_path):
    corpus = shared_data / "minipile" / "Fortunes.jsonl.zst"
    tok = shared_data / "tokenizers" / "gpt-neox-20b.json"
    rc = cli(
        [
            "evaluate",
            str(tiny_llama),
            "--text",
            str(corpus),
            "--tokenizer",
            str(tok),
            "--max-docs",
            "3",
            "--seq-len",
            "32",
            "--out",
            str(tmp_path),
            "--threads",
            "1",
        ]
    )
    assert rc == 0
    res = json.loads((tmp_path / "eval.json").read_text())["results"][0]
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(tok))
    texts = [x for _, x in zip(range(3), text_documents(corpus))]
    stream = np.concatenate(
        [t.encode(x, add_special_tokens=False).ids + [t.token_to_id("<|endoftext|>")] for x in texts]
    )
    ref = _reference_nll(tiny_llama, stream, 32)
    assert res["tokens"] == len(stream) - 1 and res["documents"] == 3
    assert res["bytes"] == sum(len(x.encode("utf-8")) for x in texts)
    assert res["bits_per_byte"] == pytest.approx(ref.sum() / math.log(2) / res["bytes"], rel=1e-5)
    assert "gpt-neox-20b.json" in res["normalisation"] and "bits_per_byte" in res["normalisation"]


def test_split_selects_the_trainers_validation_documents(tmp_path):
    from megatron_lev.analysis.corpora import indexed_documents
    from megatron_lev.data.indexed import IndexedDatasetBuilder
    from megatron_lev.data.indices import split_documents

    builder = IndexedDatasetBuilder(tmp_path / "docs")
    for i in range(100):
        builder.add_document([i, i + 1])
    builder.finalize()
    start, end = split_documents(100, "90,8,2")[1]
    valid = [int(d[0]) for d in indexed_documents(tmp_path / "docs", split=("valid", "90,8,2"))]
    assert valid == list(range(start, end)) and len(valid) == 8
    assert [
        int(d[0]) for d in indexed_documents(tmp_path / "docs", max_docs=3, split=("test", "90,8,2"))
    ] == [98, 99]
    with pytest.raises(ValueError, match="holds no documents"):
        list(indexed_documents(tmp_path / "docs", split=("test", "100,0,0")))
