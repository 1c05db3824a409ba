"""The types between the training loop and its callbacks: `Callback`, `Control`, `StepRecord`,
`TrainState` and `TrainResult`.

The `Trainer` (`training/trainer.py`) runs steps and calls every callback at fixed points; each
callback asks for work through the step's `Control` (read the pending losses and log, validate,
save, stop) and does its own part. The loop knows no callback by name: the callbacks the run has
are in `training/callbacks.py`, and a run may add its own (`train.callbacks`). Callbacks run in
`order` (lower first), then in list order.

Hook points, in the order the loop reaches them:

    on_train_begin(trainer, control)      before the first step (control.stop: exit at once)
    on_step_begin(trainer, iteration)     before each step
    on_step_end(trainer, iteration, skipped, control)   after each step, its values still on the
                                          device (`skipped`: the update was held back, a host bool)
    on_step_values(trainer, record, control)   each step's values, once the host has read them
    metrics(trainer, iteration) -> dict   values for a log line (merged over callbacks)
    on_log(trainer, iteration, values)
    on_validation(trainer, iteration, metrics)
    on_save(trainer)                      save now (`control.save`, or `trainer.save()`); the
                                          callback that writes checkpoints does, once per iteration
    on_before_save(trainer)               a checkpoint of this iteration is about to be written
                                          (called by the callback that writes; raise to refuse,
                                          or raise `SkipSave` to write nothing and go on)
    on_train_end(trainer, result)         after the loop (also after a stop)
    on_close(trainer)                     always, also on an exception

A callback with a `state_key` has `state_dict()`/`load_state_dict()`: its state travels in
the checkpoint's `train_state[state_key]`.

A run adds its own callbacks by naming them in `train.callbacks` as `"module:Class"`
(`callbacks_from_specs` imports and builds each with no arguments), or by passing them to
`pretrain(plan, extra_callbacks=...)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from megatron_lev.errors import ConfigError

if TYPE_CHECKING:
    from megatron_lev.training.trainer import Trainer


class SkipSave(Exception):
    """Raised by `on_before_save` to skip this save without failing the run: the callback that writes
    checkpoints logs the message as a warning and writes nothing."""


@dataclass
class TrainResult:
    iteration: int
    exit_code: int  # 0 done, PREEMPTED_EXIT_CODE, SKIP_LIMIT_EXIT_CODE, or a callback's own
    reason: str  # "completed", "preempted", "too many skipped steps"
    skipped_steps: int = 0
    losses: dict[int, float] = field(default_factory=dict)  # iteration -> train loss (this process's run)


@dataclass
class TrainState:
    """What a checkpoint must carry besides model, optimizer and callback states to resume exactly.
    A new field is saved and restored with no other change (`state_dict` / `from_state_dict`); a
    checkpoint saved before the field existed restores its default."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0

    REQUIRED = ("iteration", "consumed_samples")  # every checkpoint has these: a missing one is damage

    def state_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict) -> TrainState:
        """The state a checkpoint's `train_state` records (a KeyError where a required field is
        missing); fields an older checkpoint lacks take their defaults."""
        missing = [k for k in cls.REQUIRED if k not in state]
        if missing:
            raise KeyError(f"the checkpoint's train_state has no {', '.join(missing)}")
        return cls(**{f.name: int(state[f.name]) for f in fields(cls) if f.name in state})


@dataclass
class Control:
    """What the loop does after a step (callbacks set these in `on_step_end` / `on_step_values`)."""

    read: bool = False  # read the pending steps' values now (every other flag implies it)
    log: bool = False
    evaluate: bool = False
    save: bool = False
    stop: bool = False
    exit_code: int = 0
    reason: str = ""

    def request_stop(self, exit_code: int, reason: str, save: bool = True) -> None:
        if not self.stop:  # the first reason wins
            self.stop, self.exit_code, self.reason = True, exit_code, reason
        self.save = self.save or save

    @property
    def any(self) -> bool:
        return self.read or self.log or self.evaluate or self.save or self.stop


@dataclass
class StepRecord:
    """One step's values as numbers (after the host read)."""

    iteration: int
    loss: float  # mean over the step's micro-batches and the data-parallel ranks
    grad_norm: float | None
    skipped: bool  # the update was held back (non-finite loss or gradients, or the fp16 scaler)
    scaler_overflow: bool  # the fp16 loss scaler held it back
    weights_bad: bool  # the update made a weight inf/NaN on some rank
    weight_growth: float = 1.0  # the global weight norm after the update / before it (1: skipped)
    clip: tuple[float, ...] | None = None  # the clip groups' norms, then their factors (engine.clipping)
    spiked: bool = False  # skipped as a loss or gradient-norm spike (engine.spikes), not a non-finite step


class Callback:
    """Does nothing at every hook point; a callback overrides the hooks it needs (see the module doc)."""

    order = 0
    state_key: str | None = None

    def on_train_begin(self, trainer: Trainer, control: Control) -> None:
        pass

    def on_step_begin(self, trainer: Trainer, iteration: int) -> None:
        pass

    def on_step_end(self, trainer: Trainer, iteration: int, skipped: bool, control: Control) -> None:
        pass

    def on_step_values(self, trainer: Trainer, record: StepRecord, control: Control) -> None:
        pass

    def metrics(self, trainer: Trainer, iteration: int) -> dict[str, Any]:
        return {}

    def on_log(self, trainer: Trainer, iteration: int, values: dict[str, Any]) -> None:
        pass

    def on_validation(self, trainer: Trainer, iteration: int, metrics: dict[str, float]) -> None:
        pass

    def on_save(self, trainer: Trainer) -> None:
        pass

    def on_before_save(self, trainer: Trainer) -> None:
        pass

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        pass

    def on_close(self, trainer: Trainer) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def callbacks_from_specs(specs: Sequence[str], key: str = "train.callbacks") -> list[Callback]:
    """Import and build (with no arguments) the callback class each `"module:Class"` spec names.

    A module that does not import, a missing class, or something that is not a `Callback` is a
    one-line ConfigError naming `key` and the spec.
    """
    out = []
    for spec in specs:
        module_name, _, qualname = spec.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - anything the user's module raises while importing
            raise ConfigError(
                f"{key}: cannot import {module_name!r} for {spec!r} ({_first_line(exc)})"
            ) from exc
        for part in qualname.split("."):
            if not hasattr(target, part):
                raise ConfigError(f"{key}: {module_name!r} has no {qualname!r} (in {spec!r})")
            target = getattr(target, part)
        if not (isinstance(target, type) and issubclass(target, Callback)):
            raise ConfigError(
                f"{key}: {spec!r} is not a Callback class (subclass megatron_lev.training.hooks.Callback)"
            )
        try:
            out.append(target())
        except Exception as exc:  # noqa: BLE001 - the user's constructor
            raise ConfigError(
                f"{key}: building {spec!r} failed ({_first_line(exc)}); a callback class is built with "
                "no arguments"
            ) from exc
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


__all__ = [
    "Callback",
    "Control",
    "SkipSave",
    "StepRecord",
    "TrainResult",
    "TrainState",
    "callbacks_from_specs",
]
