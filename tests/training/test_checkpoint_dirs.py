"""Checkpoint directory bookkeeping: completion markers, the `latest` pointer, pruning, RNG capture."""

from __future__ import annotations

import random

import numpy as np
import torch

from megatron_lev.ckpt import io as ckio
from megatron_lev.ckpt import layout as ck


def _resume_tag(root):
    tags, notes = ck.resume_candidates(root)
    return (tags[0] if tags else None), " ".join(notes)


def _make(root, iteration, complete=True):
    d = root / ck.tag_for(iteration)
    d.mkdir(parents=True)
    (d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (d / ck.STARTED_MARKER).write_text("{}")  # written by our save: a partial one is ours to prune
    if complete:
        (d / ck.COMPLETE_MARKER).write_text("{}")
    return d


def test_tags_round_trip():
    assert ck.iteration_of(ck.tag_for(42)) == 42
    assert ck.iteration_of("global_step42") is None


def test_resume_uses_latest_when_complete(tmp_path):
    _make(tmp_path, 10)
    _make(tmp_path, 20)
    (tmp_path / ck.LATEST_FILE).write_text(ck.tag_for(10) + "\n")
    assert _resume_tag(tmp_path)[0] == ck.tag_for(10)


def test_a_partial_checkpoint_is_never_chosen(tmp_path):
    _make(tmp_path, 10)
    _make(tmp_path, 20, complete=False)  # killed while saving
    (tmp_path / ck.LATEST_FILE).write_text(ck.tag_for(20))  # even if a pointer names it
    tag, notes = _resume_tag(tmp_path)
    assert tag == ck.tag_for(10)
    assert "incomplete" in notes and "instead" in notes


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert _resume_tag(tmp_path / "missing")[0] is None
    _make(tmp_path, 5, complete=False)
    assert _resume_tag(tmp_path)[0] is None


def test_prune_keeps_the_newest_complete_and_newer_partials(tmp_path):
    for it in (10, 20, 30):
        _make(tmp_path, it)
    _make(tmp_path, 15, complete=False)
    _make(tmp_path, 40, complete=False)
    removed = ck.prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(removed) == [ck.tag_for(10), ck.tag_for(15)]
    assert [c.iteration for c in ck.list_checkpoints(tmp_path)] == [20, 30, 40]


def test_rng_state_round_trip():
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.parallel.random import tp_rng_tracker

    tracker = tp_rng_tracker(7, SINGLE)  # a model's
    saved = ckio.capture_rng_state(tracker)

    def draws():
        with tracker.fork():
            tp = torch.rand(3)
        return random.random(), np.random.rand(), torch.rand(3), tp

    a = draws()
    ckio.restore_rng_state(saved, tracker)
    b = draws()
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])
    other = tp_rng_tracker(8, SINGLE)  # another model's tracker takes the saved stream
    ckio.restore_rng_state(saved, other)
    with other.fork():
        assert torch.equal(torch.rand(3), a[3])
