"""Spike skipping (`train.spike_window`, `train.spike_zscore`; `engine.spikes`): a step whose gradient
norm or loss jumps above its recent window is not applied, the run goes on as one that never applied
that batch's update, the healthy run skips nothing, and spikes in a row stop the run."""

from __future__ import annotations

import pytest
import torch

from megatron_lev.engine.spikes import SpikeDetector
from megatron_lev.training.metrics import read_metrics
from tests.tiny_run import tiny_overrides
from tests.training.conftest import run_train

FAULTS = "[megatron_lev.testing.faults:FaultInjection]"
SPIKES = {
    "train.spike_window": 4,
    "train.spike_zscore": 6.0,
    "train.train_iters": 10,
    "train.save_interval": 0,
}


def test_the_detector_flags_a_rise_beyond_the_window_and_keeps_its_state():
    d = SpikeDetector(4, 6.0, torch.device("cpu"))
    t = torch.tensor
    assert not d.check(t(100.0), t(1.0))  # window not full: nothing is judged
    for norm in (1.0, 1.2, 0.9, 1.1):
        d.record(t(norm), t(3.0))
    assert not d.check(t(1.5), t(3.0))  # within 6 sd (sd 0.11: up to 1.72)
    assert d.check(t(5.0), t(3.0))  # the norm spikes
    assert d.check(t(1.0), t(9.0))  # the loss alone spikes (a window of equal losses: any rise)
    assert not d.check(t(0.1), t(1.0))  # a fall is no spike
    assert not d.check(t(float("inf")), None)  # non-finite is the guard's, not a spike
    other = SpikeDetector(4, 6.0, torch.device("cpu"))
    other.load_state_dict(d.state_dict())
    assert torch.equal(other.hist, d.hist) and (other.count, other.pos) == (d.count, d.pos)
    fresh = SpikeDetector(8, 6.0, torch.device("cpu"))
    fresh.load_state_dict(d.state_dict())  # another window size starts afresh
    assert fresh.count == 0


def _run(prefix, tok, out, env=None, **extra):
    over = tiny_overrides(prefix, tok, out, **{**SPIKES, "train.callbacks": FAULTS, **extra})
    res = run_train(1, over, **(env or {}))
    rows = {r["iteration"]: r for r in read_metrics(out / "metrics.jsonl", kind="train")}
    return res, rows


@pytest.mark.slow
def test_a_spike_is_skipped_as_if_its_update_never_happened(minipile_prefix, tokenizer_path, tmp_path):
    spike, rows = _run(
        minipile_prefix, tokenizer_path, tmp_path / "spike", {"MEGATRON_LEV_INJECT_GRAD_SPIKE_AT_STEP": "8"}
    )
    assert spike.returncode == 0, spike.stderr[-3000:]
    line = next(x for x in spike.stderr.splitlines() if "a spike" in x)
    assert "iteration 8:" in line and "train.spike_zscore=6" in line and "window: gradient norm" in line
    assert rows[10]["skipped_steps"] == 1 and rows[10]["spike_steps"] == 1
    # the same batch's update held back as a non-finite step: the run that never applied it
    held, held_rows = _run(
        minipile_prefix, tokenizer_path, tmp_path / "held", {"MEGATRON_LEV_INJECT_NAN_GRAD_AT_STEP": "8"}
    )
    assert held.returncode == 0, held.stderr[-3000:]
    for it in (9, 10):
        assert rows[it]["loss"] == held_rows[it]["loss"], it  # bit for bit
    assert rows[8]["grad_norm"] > 100 * rows[7]["grad_norm"]  # what was judged: the 1,000x gradient
    # the healthy twin: the same rule over the same run skips nothing
    healthy, healthy_rows = _run(minipile_prefix, tokenizer_path, tmp_path / "healthy")
    assert healthy.returncode == 0 and healthy_rows[10]["skipped_steps"] == 0
    assert healthy_rows[7]["loss"] == rows[7]["loss"]


@pytest.mark.slow
def test_spikes_in_a_row_stop_the_run_in_one_line(minipile_prefix, tokenizer_path, tmp_path):
    res, rows = _run(
        minipile_prefix,
        tokenizer_path,
        tmp_path / "run",
        {"MEGATRON_LEV_INJECT_GRAD_SPIKE_AT_STEP": "6,7"},
        **{"train.max_consecutive_skips": 2},
    )
    assert res.returncode == 3, res.stderr[-3000:]
    assert max(rows) == 7 and rows[7]["spike_steps"] == 2
