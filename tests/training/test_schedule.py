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


# ------------------------------------------------------------------ warmup-stable-decay


@pytest.mark.parametrize("style", ["linear", "cosine", "minus_sqrt"])
def test_wsd_warms_up_holds_then_decays_to_min_lr(style):
    t = _train(lr_decay_style="wsd", lr_wsd_decay_iters=20, lr_wsd_decay_style=style)
    lrs = [learning_rate(i, t, 100) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0  # warm-up, as every style
    assert all(lr == 1.0 for lr in lrs[10:80])  # stable: the peak rate exactly
    assert lrs[80] < 1.0 and lrs[99] == pytest.approx(0.1)  # the decay's last update is at min_lr
    assert all(a > b for a, b in zip(lrs[79:], lrs[80:]))
    halfway = {"linear": 0.55, "cosine": 0.55, "minus_sqrt": 0.1 + 0.9 * (1 - 0.5**0.5)}[style]
    assert lrs[89] == pytest.approx(halfway)  # 10 of its 20 updates done
    assert learning_rate(150, t, 100) == pytest.approx(0.1)


def test_wsd_decay_length_from_the_fraction_and_never_before_the_warmup():
    t = _train(lr_decay_style="wsd", lr_wsd_decay_fraction=0.25)
    lrs = [learning_rate(i, t, 200) for i in range(200)]
    assert lrs[149] == 1.0 and lrs[150] < 1.0  # the last 50 updates decay
    short = _train(lr_decay_style="wsd", lr_wsd_decay_iters=500)  # longer than the run: starts after warm-up
    assert learning_rate(9, short, 100) == 1.0 and learning_rate(10, short, 100) < 1.0


def test_wsd_is_refused_with_an_unknown_decay_shape():
    from megatron_lev.config import load_config
    from megatron_lev.errors import ConfigError

    with pytest.raises(ConfigError, match="train.lr_wsd_decay_style"):
        load_config(None, ["train.lr_decay_style=wsd", "train.lr_wsd_decay_style=exp"])


def _stored_run(tmp_path, iteration, **train):
    """A checkpoint tag directory at `iteration` with a config stored beside its files."""
    from megatron_lev.config import load_config

    tag = tmp_path / f"iter_{iteration:07d}"
    tag.mkdir()
    load_config(None, [f"train.{k}={v}" for k, v in train.items()]).save(tag)
    return tag


# a constant-rate stage (wsd with its decay at the end of a 4,000-step run), checkpointed at 1,000
STAGE = {"train_iters": 4000, "lr_decay_style": "wsd", "lr_wsd_decay_iters": 400, "lr_warmup_iters": 20}


@pytest.mark.parametrize(
    "branch, allowed",
    [
        ({"train_iters": 1100, "lr_wsd_decay_iters": 100}, True),  # decay from the checkpoint on: a branch
        ({"train_iters": 1100, "lr_wsd_decay_iters": 100, "lr_wsd_decay_style": "minus_sqrt"}, True),
        ({"train_iters": 1100, "lr_wsd_decay_iters": 150}, False),  # decay starts at 950: the past moves
        ({"train_iters": 1100, "lr_decay_style": "cosine"}, False),
        ({"lr": 2e-3}, False),
        ({"train_iters": 1100, "lr_wsd_decay_iters": 100, "lr_warmup_iters": None}, False),  # 1% of 1100
    ],
)
def test_a_resume_that_changes_only_the_future_rates_is_a_branch(tmp_path, caplog, branch, allowed):
    from megatron_lev.ckpt.record import SavedBatch
    from megatron_lev.config import load_config
    from megatron_lev.errors import CheckpointDataError
    from megatron_lev.training.resume_checks import check_resume_config

    tag = _stored_run(tmp_path, 1000, **STAGE)
    cfg = load_config(
        None, [f"train.{k}={'null' if v is None else v}" for k, v in {**STAGE, **branch}.items()]
    )
    saved = SavedBatch(1, 4, 4)
    caplog.set_level("WARNING", logger="megatron_lev")
    if allowed:
        check_resume_config(tag, cfg, (), saved)
        assert "a branch: the 1,000 updates before the checkpoint" in caplog.text
    else:
        with pytest.raises(CheckpointDataError, match="--allow-change"):
            check_resume_config(tag, cfg, (), saved)
        changed = [k for k in branch if k != "train_iters"]
        check_resume_config(tag, cfg, [f"train.{k}" for k in changed], saved)  # the flag still accepts it
