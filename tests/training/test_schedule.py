"""Warmup + decay learning rate and the token budget."""

from __future__ import annotations

import pytest

from megatron_lev.config import TrainConfig
from megatron_lev.training.schedule import learning_rate, training_budget, warmup_iters


def _train(**kw) -> TrainConfig:
    return TrainConfig(**{"lr": 1.0, "min_lr": 0.1, "lr_warmup_iters": 10, **kw})


def test_linear_warmup_then_cosine_to_min_lr():
    t = _train()
    assert learning_rate(0, t, 110) == pytest.approx(0.1)
    assert learning_rate(9, t, 110) == pytest.approx(1.0)
    assert learning_rate(10, t, 110) == pytest.approx(1.0)
    assert learning_rate(60, t, 110) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert learning_rate(110, t, 110) == pytest.approx(0.1)
    assert learning_rate(500, t, 110) == pytest.approx(0.1)
    lrs = [learning_rate(i, t, 110) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_linear_and_constant_decay():
    assert learning_rate(60, _train(lr_decay_style="linear"), 110) == pytest.approx(0.55)
    assert learning_rate(35, _train(lr_decay_style="linear"), 110) == pytest.approx(1.0 - 0.9 * 0.25)
    assert learning_rate(100, _train(lr_decay_style="constant"), 110) == 1.0


def test_warmup_fraction_when_iters_unset():
    assert warmup_iters(_train(lr_warmup_iters=None, lr_warmup_fraction=0.01), 1000) == 10


def test_budget_precedence_chinchilla_tokens_iters():
    assert training_budget(_train(train_iters=7), 8, 128, 10**6).train_iters == 7
    b = training_budget(_train(train_tokens=10_000), 8, 128, 10**6)
    assert b.train_iters == 10 and b.tokens_per_iter == 1024  # ceil(10000 / 1024)
    c = training_budget(_train(chinchilla=True), 8, 128, 10**6)
    assert c.train_iters == -(-20 * 10**6 // 1024) and "chinchilla" in c.source
    assert c.train_tokens >= 20 * 10**6
