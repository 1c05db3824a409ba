"""The loop's `TrainState` in a checkpoint: one place says what is saved and restored."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_lev.training.hooks import TrainState


def test_every_field_goes_into_the_checkpoint_and_comes_back():
    state = TrainState(iteration=7, consumed_samples=56, consumed_tokens=14336)
    saved = state.state_dict()
    assert set(saved) == {f.name for f in dataclasses.fields(TrainState)}
    assert TrainState.from_state_dict(saved) == state


def test_a_field_added_later_is_saved_and_an_older_checkpoint_restores_its_default():
    @dataclasses.dataclass
    class Grown(TrainState):
        spikes_seen: int = 5

    assert Grown(iteration=3, consumed_samples=1, spikes_seen=2).state_dict()["spikes_seen"] == 2
    old = {"iteration": 3, "consumed_samples": 24}  # saved before consumed_tokens and spikes_seen
    assert Grown.from_state_dict(old) == Grown(
        iteration=3, consumed_samples=24, consumed_tokens=0, spikes_seen=5
    )


def test_a_checkpoint_without_its_iteration_is_refused():
    with pytest.raises(KeyError, match="no iteration"):
        TrainState.from_state_dict({"consumed_samples": 8})
