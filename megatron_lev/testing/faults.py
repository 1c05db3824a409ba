"""Fault injection for tests: NaN losses, NaN gradients and inf weights at chosen iterations
(preprocess workers that fail: `testing.preprocess_faults`).

`FaultInjection` is a trainer callback; production code never builds it. A test adds it to a
`megatron-lev train` run by naming it in the config, and says which faults through the
variables below (read when the callback is built with no arguments):

    train.callbacks=[megatron_lev.testing.faults:FaultInjection]

    MEGATRON_LEV_INJECT_NAN_AT_STEP=3,4          the model's output is NaN (the loss is NaN)
    MEGATRON_LEV_INJECT_NAN_GRAD_AT_STEP=2        the loss is finite, the gradients NaN
    MEGATRON_LEV_INJECT_INF_WEIGHTS_AT_STEP=2     the applied update writes inf into a weight
"""

from __future__ import annotations

import os

import torch
from torch import nn

from megatron_lev.training.hooks import Callback, Control

INJECT_NAN_ENV = "MEGATRON_LEV_INJECT_NAN_AT_STEP"
INJECT_NAN_GRAD_ENV = "MEGATRON_LEV_INJECT_NAN_GRAD_AT_STEP"
INJECT_INF_WEIGHTS_ENV = "MEGATRON_LEV_INJECT_INF_WEIGHTS_AT_STEP"


def injected_nan_steps(environ: dict | None = None, name: str = INJECT_NAN_ENV) -> set[int]:
    """Testing aid: iterations (1-based, comma-separated) listed in the variable `name` (a fault each)."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return set()
    try:
        return {int(x) for x in raw.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be iteration numbers, e.g. 3 or 3,4") from None


class _NaNGradient(torch.autograd.Function):
    """Identity forward; the gradient that flows back is NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _poison(t, grad: bool):
    if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
        return t
    return _NaNGradient.apply(t) if grad else t * float("nan")


class NaNInjector:
    """Forward hook that makes a module's output NaN while armed (testing aid).

    `grad=True` keeps the output (and the loss) finite and makes its gradient NaN instead.
    """

    def __init__(self, module: nn.Module, grad: bool = False) -> None:
        self.armed, self.grad = False, grad
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if not self.armed:
            return None
        if isinstance(output, torch.Tensor):
            return _poison(output, self.grad)
        if isinstance(output, tuple):
            return tuple(_poison(o, self.grad) for o in output)
        return None

    def remove(self) -> None:
        self._handle.remove()


class FaultInjection(Callback):
    """Arms the injectors at the listed iterations (1-based) on this rank's model (`engine.module`:
    the whole model, or the stages a pipeline rank holds, so its output is what the rank passes on)
    and on the optimizer (`engine.optimizer`, `DeepSpeedEngine`'s `GuardedAdamW`)."""

    def __init__(self, nan_steps=None, nan_grad_steps=None, inf_weight_steps=None, environ=None) -> None:
        """The faults at the iterations given; with none given, those the variables (in `environ`,
        default `os.environ`) name."""
        if nan_steps is None and nan_grad_steps is None and inf_weight_steps is None:
            nan_steps, nan_grad_steps, inf_weight_steps = (
                injected_nan_steps(environ, name)
                for name in (INJECT_NAN_ENV, INJECT_NAN_GRAD_ENV, INJECT_INF_WEIGHTS_ENV)
            )
        self.nan_steps, self.nan_grad_steps = set(nan_steps or ()), set(nan_grad_steps or ())
        self.inf_weight_steps = set(inf_weight_steps or ())
        self._injectors: list[tuple[NaNInjector, set[int]]] = []
        self._corrupt_armed = False
        self._hook = None

    def on_train_begin(self, trainer, control: Control) -> None:
        target = trainer.engine.module
        if self.nan_steps:
            self._injectors.append((NaNInjector(target), self.nan_steps))
        if self.nan_grad_steps:
            self._injectors.append((NaNInjector(target, grad=True), self.nan_grad_steps))
        if self.inf_weight_steps:
            self._hook = trainer.engine.optimizer.register_step_post_hook(self._corrupt)

    def _corrupt(self, optimizer, args, kwargs) -> None:
        """After an applied update (the guard let it through) while armed: write inf into a weight."""
        if not self._corrupt_armed or getattr(optimizer, "skipped_calls", 0):
            return
        self._corrupt_armed = False
        target = next((p for g in optimizer.param_groups for p in g["params"] if p.numel()), None)
        if target is not None:
            with torch.no_grad():
                target.view(-1)[0] = float("inf")

    def on_step_begin(self, trainer, iteration: int) -> None:
        for injector, steps in self._injectors:
            injector.armed = iteration in steps
        self._corrupt_armed = iteration in self.inf_weight_steps

    def on_step_end(self, trainer, iteration: int, skipped: bool, control: Control) -> None:
        for injector, _ in self._injectors:
            injector.armed = False
        self._corrupt_armed = False

    def on_close(self, trainer) -> None:
        for injector, _ in self._injectors:
            injector.remove()
        self._injectors = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
