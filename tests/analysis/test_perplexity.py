"""Per-token losses and perplexity by token frequency on hand-built data with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_lev.analysis.corpora import sequence_batches
from megatron_lev.analysis.perplexity import (
    TokenLosses,
    count_bands,
    evaluation_result,
    frequency_buckets,
    load_counts,
    per_token_losses,
)

# relative frequencies out of 1e8 tokens: 5e-8, 5e-7, 5e-6, 5e-5, the rest (~1.0), 0
COUNTS = np.array([5, 50, 500, 5000, 100_000_000 - 5555, 0], dtype=np.int64)


def test_frequency_buckets_on_known_counts():
    targets = np.array([0, 1, 1, 2, 3, 3, 3, 4, 5, 9])  # 9 is beyond the counts: frequency 0
    nll = np.array([5.0, 4.0, 2.0, 3.0, 1.0, 2.0, 3.0, 0.5, 6.0, 7.0])
    buckets = frequency_buckets(TokenLosses(nll, targets), COUNTS)
    assert [b["bucket"] for b in buckets] == [
        "< 1e-07",
        "[1e-07, 1e-06)",
        "[1e-06, 1e-05)",
        "[1e-05, 1e-04)",
        ">= 1e-04",
    ]
    assert [b["tokens"] for b in buckets] == [3, 2, 1, 3, 1]
    assert [b["vocab_ids"] for b in buckets] == [2, 1, 1, 1, 1]
    expected = [(5 + 6 + 7) / 3, 3.0, 3.0, 2.0, 0.5]
    for b, mean in zip(buckets, expected):
        assert b["perplexity"] == pytest.approx(math.exp(mean))
    edges = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3)  # [1e-4, 1e-3) holds nothing
    empty = frequency_buckets(TokenLosses(nll, targets), COUNTS, edges)[4]
    assert empty["bucket"] == "[1e-04, 1e-03)" and empty["tokens"] == 0 and empty["perplexity"] is None
    with pytest.raises(ValueError, match="increasing"):
        frequency_buckets(TokenLosses(nll, targets), COUNTS, (1e-4, 1e-5))


def test_counts_file_is_validated(tmp_path):
    np.save(tmp_path / "ok.counts.npy", COUNTS)
    assert load_counts(tmp_path / "ok.counts.npy").dtype == np.int64
    np.save(tmp_path / "bad.counts.npy", np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="bad.counts.npy"):
        load_counts(tmp_path / "bad.counts.npy")


def test_sequence_batches_predict_every_token_once():
    docs = [np.arange(0, 7), np.arange(7, 10), np.arange(10, 23)]  # 23 tokens
    batches = list(sequence_batches(docs, seq_len=4, batch_size=2))
    targets = np.concatenate([b[:, 1:].reshape(-1).numpy() for b in batches])
    assert targets.tolist() == list(range(1, 23))
    assert [tuple(b.shape) for b in batches] == [(2, 5), (2, 5), (1, 5), (1, 3)]


def test_perplexity_is_exp_mean_nll_of_logits_and_loss_callables():
    torch.manual_seed(0)
    table = torch.randn(11, 11)
    model_fn = lambda ids: table[ids]  # noqa: E731  (B, S) -> (B, S, V)
    batch = torch.randint(0, 11, (3, 9))
    losses = per_token_losses([batch], model_fn, progress=False)
    ref = F.cross_entropy(table[batch[:, :-1]].reshape(-1, 11), batch[:, 1:].reshape(-1))
    assert losses.perplexity == pytest.approx(math.exp(ref.item()), rel=1e-6)
    loss_fn = lambda ids, tgt: F.cross_entropy(table[ids].transpose(1, 2), tgt, reduction="none")  # noqa: E731
    same = per_token_losses([batch], loss_fn, returns_loss=True, progress=False)
    np.testing.assert_allclose(same.nll, losses.nll, rtol=1e-6)
    res = evaluation_result(losses, "toy", n_bytes=100, tokenizer="toy-tok")
    assert res["bits_per_byte"] == pytest.approx(losses.nll.sum() / math.log(2) / 100)
    assert "per token of the tokenizer toy-tok" in res["normalisation"]
    with pytest.raises(ValueError, match="expected"):
        per_token_losses([batch], lambda ids: table[ids][:, :2], progress=False)


def test_count_bands_of_targets_and_inputs_on_known_counts():
    """Bands by absolute training count (0, 1-9, 10-99, 100-999, >= 1000) of the predicted token and of
    the token before it, and their per-document sums for the bootstrap."""
    counts = np.array([0, 3, 9, 10, 99, 500, 1000, 7], dtype=np.int64)  # bands 0 1 1 2 2 3 4 1
    inputs = np.array([0, 1, 3, 5, 6, 6, 9])  # id 9 is beyond the counts: never seen
    targets = np.array([1, 2, 4, 6, 0, 7, 5])
    nll = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    bands = count_bands(TokenLosses(nll, targets, inputs), counts)
    labels = ["0", "1-9", "10-99", "100-999", ">= 1000"]
    assert [b["band"] for b in bands["target"]] == labels == [b["band"] for b in bands["input"]]
    assert [b["vocab_ids"] for b in bands["target"]] == [1, 3, 2, 1, 1]
    # targets 1,2,7 -> band 1 (nll 1,2,6); 4 -> 2 (3); 6 -> 4 (4); 0 -> 0 (5); 5 -> 3 (7)
    assert [b["tokens"] for b in bands["target"]] == [1, 3, 1, 1, 1]
    assert bands["target"][1]["mean_nll"] == pytest.approx(3.0)
    # inputs 0 -> 0 (1), 1 -> 1 (2), 3 -> 2 (3), 5 -> 3 (4), 6,6 -> 4 (5, 6), 9 -> 0 (7)
    assert [b["tokens"] for b in bands["input"]] == [2, 1, 1, 1, 2]
    assert bands["input"][0]["mean_nll"] == pytest.approx(4.0)
    assert bands["input"][4]["perplexity"] == pytest.approx(math.exp(5.5))
    res = evaluation_result(TokenLosses(nll, targets, inputs), "x", counts=counts, doc_lengths=[3, 5])
    doc = res["per_document"]
    assert res["count_bands"] == bands and res["count_band_edges"] == [1, 10, 100, 1000]
    # predicted tokens 0-1 belong to document 0 (stream positions 1, 2), 2-6 to document 1
    assert doc["input_band_tokens"] == [[1, 1], [1, 0], [0, 1], [0, 1], [0, 2]]
    assert doc["target_band_nll_sum"][1] == [3.0, 6.0]
    with pytest.raises(ValueError, match="count band edges"):
        count_bands(TokenLosses(nll, targets, inputs), counts, (0, 10))
