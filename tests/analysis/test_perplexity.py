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
