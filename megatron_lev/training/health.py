"""Non-finite steps: count them, stop after too many in a row; plus a NaN injector for tests.

A step whose loss or gradient norm is inf/NaN is skipped by the optimizer guard
(`optim.GuardedAdamW`); this module keeps the tally the trainer logs and checkpoints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import nn
from megatron_lev.errors import UserError

INJECT_NAN_ENV = "MEGATRON_LEV_INJECT_NAN_AT_STEP"


class TooManySkippedSteps(UserError, RuntimeError):
    """`train.max_consecutive_skips` non-finite steps in a row."""


@dataclass
class SkipTracker:
    max_consecutive: int
    total: int = 0
    consecutive: int = 0

    def update(self, skipped: bool, iteration: int) -> None:
        """Record one iteration; raises TooManySkippedSteps when the limit is reached."""
        if not skipped:
            self.consecutive = 0
            return
        self.total += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise TooManySkippedSteps(
                f"{self.consecutive} consecutive steps up to iteration {iteration} had a non-finite loss or "
                f"gradient norm (train.max_consecutive_skips={self.max_consecutive}); the run stopped with a "
                "checkpoint of the last good weights. Lower train.lr, raise train.lr_warmup_iters, check "
                "the data, or use train.precision=fp32 to find the cause.")

    def state_dict(self) -> dict:
        return {"total": self.total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.total = int(state.get("total", 0))
        self.consecutive = int(state.get("consecutive", 0))


def is_finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def injected_nan_steps(environ: dict | None = None) -> set[int]:
    """Testing aid: iterations (1-based, comma-separated) at which the forward output is made NaN."""
    raw = (os.environ if environ is None else environ).get(INJECT_NAN_ENV, "").strip()
    if not raw:
        return set()
    try:
        return {int(x) for x in raw.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"{INJECT_NAN_ENV}={raw!r} must be iteration numbers, e.g. 3 or 3,4") from None


class NaNInjector:
    """Forward hook that multiplies a module's tensor output by NaN while armed (testing aid)."""

    def __init__(self, module: nn.Module) -> None:
        self.armed = False
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if not self.armed:
            return None
        if isinstance(output, torch.Tensor):
            return output * float("nan")
        if isinstance(output, tuple):
            return tuple(o * float("nan") if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                         for o in output)
        return None

    def remove(self) -> None:
        self._handle.remove()
