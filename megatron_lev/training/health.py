"""Non-finite steps: count them, stop after too many in a row (fault injectors: `testing.faults`).

A step whose loss or gradients are inf/NaN is skipped by the optimizer guard
(`optim.GuardedAdamW`); this module keeps the tally the trainer logs and checkpoints,
and the errors for runs whose steps or weights went non-finite.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lev.errors import UserError


class TooManySkippedSteps(UserError, RuntimeError):
    """`train.max_consecutive_skips` non-finite steps in a row."""


@dataclass
class SkipTracker:
    max_consecutive: int
    total: int = 0
    consecutive: int = 0

    def update(self, skipped: bool, iteration: int, nothing_learnt: bool = False) -> None:
        """Record one iteration; raises TooManySkippedSteps when the limit is reached (`nothing_learnt`:
        no update of the run was applied, so the stop saves nothing)."""
        if not skipped:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            outcome = (
                "no update of the run was applied, so it stopped and saved nothing"
                if nothing_learnt
                else "the run stopped with a checkpoint of the last good weights"
            )
            raise TooManySkippedSteps(
                f"{self.consecutive} consecutive steps up to iteration {iteration} had a non-finite loss or "
                f"gradient norm (train.max_consecutive_skips={self.max_consecutive}); {outcome}. Lower "
                "train.lr, raise train.lr_warmup_iters, check the data, or use train.precision=fp32 to find "
                "the cause."
            )

    def state_dict(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("total", 0))
        self.consecutive = int(state.get("consecutive", 0))


class StoppedAtSkipLimit(UserError, RuntimeError):
    """A rerun resumed a checkpoint saved when the run stopped at the skip limit, with nothing left to
    train: it must not look like a completed run."""

    exit_code = 3


class AllStepsSkipped(UserError, RuntimeError):
    """Every step of a run was skipped as non-finite: it learnt nothing and must not look successful."""

    exit_code = 3


class WeightsBlewUp(UserError, RuntimeError):
    """An update grew the weight norm by more than `train.max_update_ratio` (a learning rate far too
    high): treated like an update that made the weights non-finite."""

    exit_code = 3


class NonFiniteWeights(UserError, RuntimeError):
    """An update made the weights inf/NaN, or weights about to be saved or resumed are not finite."""

    exit_code = 3  # like a run stopped by too many skipped steps
