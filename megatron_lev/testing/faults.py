"""Fault injection for tests: NaN losses, NaN gradients and inf weights at chosen iterations, and a
SIGKILL at a chosen step of a checkpoint save (preprocess workers that fail:
`testing.preprocess_faults`).

`FaultInjection` is a trainer callback; production code never builds it. A test adds it to a
`megatron-lev train` run by naming it in the config, and says which faults through the
variables below (read when the callback is built with no arguments):

    train.callbacks=[megatron_lev.testing.faults:FaultInjection]

    MEGATRON_LEV_INJECT_NAN_AT_STEP=3,4          the model's output is NaN (the loss is NaN)
    MEGATRON_LEV_INJECT_NAN_GRAD_AT_STEP=2        the loss is finite, the gradients NaN
    MEGATRON_LEV_INJECT_INF_WEIGHTS_AT_STEP=2     the applied update writes inf into a weight
    MEGATRON_LEV_INJECT_GRAD_SPIKE_AT_STEP=8      the loss is unchanged, the gradients 1,000x (a spike)

`SaveKill` (`train.callbacks=[megatron_lev.testing.faults:SaveKill]`) kills its own process with
SIGKILL at one step of the save of one iteration (`ckpt.io.save_checkpoint`'s protocol):

    MEGATRON_LEV_KILL_SAVE=4:started.tmp          iteration 4, at the point named in SAVE_POINTS
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from megatron_lev.training.hooks import Callback, Control

INJECT_NAN_ENV = "MEGATRON_LEV_INJECT_NAN_AT_STEP"
INJECT_NAN_GRAD_ENV = "MEGATRON_LEV_INJECT_NAN_GRAD_AT_STEP"
INJECT_INF_WEIGHTS_ENV = "MEGATRON_LEV_INJECT_INF_WEIGHTS_AT_STEP"
INJECT_GRAD_SPIKE_ENV = "MEGATRON_LEV_INJECT_GRAD_SPIKE_AT_STEP"
GRAD_SPIKE = 1000.0  # what an injected spike multiplies the gradients by


def injected_nan_steps(environ: dict | None = None, name: str = INJECT_NAN_ENV) -> set[int]:
    """Testing aid: iterations (1-based, comma-separated) listed in the variable `name` (a fault each)."""
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return set()
    try:
        return {int(x) for x in raw.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be iteration numbers, e.g. 3 or 3,4") from None


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the gradient that flows back is multiplied by `factor` (NaN, or a spike)."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _poison(t, grad: bool | str):
    if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
        return t
    if grad == "spike":
        return _ScaledGradient.apply(t, GRAD_SPIKE)
    return _ScaledGradient.apply(t, float("nan")) if grad else t * float("nan")


class NaNInjector:
    """Forward hook that makes a module's output NaN while armed (testing aid).

    `grad=True` keeps the output (and the loss) finite and makes its gradient NaN instead;
    `grad="spike"` keeps them and makes the gradient GRAD_SPIKE times larger.
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

    def __init__(
        self, nan_steps=None, nan_grad_steps=None, inf_weight_steps=None, environ=None, spike_steps=None
    ) -> None:
        """The faults at the iterations given; with none given, those the variables (in `environ`,
        default `os.environ`) name."""
        if nan_steps is None and nan_grad_steps is None and inf_weight_steps is None and spike_steps is None:
            nan_steps, nan_grad_steps, inf_weight_steps, spike_steps = (
                injected_nan_steps(environ, name)
                for name in (
                    INJECT_NAN_ENV,
                    INJECT_NAN_GRAD_ENV,
                    INJECT_INF_WEIGHTS_ENV,
                    INJECT_GRAD_SPIKE_ENV,
                )
            )
        self.nan_steps, self.nan_grad_steps = set(nan_steps or ()), set(nan_grad_steps or ())
        self.inf_weight_steps = set(inf_weight_steps or ())
        self.spike_steps = set(spike_steps or ())
        self._injectors: list[tuple[NaNInjector, set[int]]] = []
        self._corrupt_armed = False
        self._hook = None

    def on_train_begin(self, trainer, control: Control) -> None:
        target = trainer.engine.module
        if self.nan_steps:
            self._injectors.append((NaNInjector(target), self.nan_steps))
        if self.nan_grad_steps:
            self._injectors.append((NaNInjector(target, grad=True), self.nan_grad_steps))
        if self.spike_steps:
            self._injectors.append((NaNInjector(target, grad="spike"), self.spike_steps))
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


# ---------------------------------------------------------------------- a kill inside a save

KILL_SAVE_ENV = "MEGATRON_LEV_KILL_SAVE"

# The steps of `ckpt.io.save_checkpoint`, in order, named by what is on disk when the process dies:
# "<file>.tmp" is that file's temp written and not yet renamed; "<file>" is it in place.
SAVE_POINTS = (
    "dir",  # the tag directory created, nothing in it (the `started` marker's write had begun)
    "started.tmp",
    "started",
    "engine.partial",  # DeepSpeed wrote the first of its files
    "engine",  # every file of DeepSpeed's
    "rng.tmp",
    "rng",
    "config.tmp",
    "config",
    "complete.tmp",
    "complete",
    "latest.tmp",
    "latest",  # `latest` moved, older checkpoints not pruned yet
    "pruned",
)


def kill_save_point(environ: dict | None = None) -> tuple[int, str] | None:
    """(iteration, point) from MEGATRON_LEV_KILL_SAVE (`4:started.tmp`), or None when unset."""
    raw = (os.environ if environ is None else environ).get(KILL_SAVE_ENV, "").strip()
    if not raw:
        return None
    it, _, point = raw.partition(":")
    if not it.isdigit() or point not in SAVE_POINTS:
        raise ValueError(
            f"{KILL_SAVE_ENV}={raw!r} must be ITERATION:POINT, POINT one of {', '.join(SAVE_POINTS)}"
        )
    return int(it), point


class SaveKill(Callback):
    """SIGKILLs this process at one step of the save of one iteration (`MEGATRON_LEV_KILL_SAVE`), as a
    kill by the scheduler or the kernel would land there: the real save runs up to that step.

    It wraps, for the duration of the run, the functions `ckpt.io.save_checkpoint` calls (the atomic
    writes, pruning) and the engine's `save` and DeepSpeed's file writer; production code has no
    hook for it."""

    def __init__(self, iteration: int | None = None, point: str | None = None, environ=None) -> None:
        if iteration is None:
            iteration, point = kill_save_point(environ) or (None, None)
        self.iteration, self.point = iteration, point
        self.armed = False
        self._restore: list[tuple[object, str, object]] = []

    def _die(self, where: str) -> None:
        print(f"SaveKill: SIGKILL at save point {self.point} ({where})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _patch(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, original))
        setattr(owner, name, make(original))

    def on_train_begin(self, trainer, control: Control) -> None:
        if self.iteration is None:
            return
        from megatron_lev.ckpt import io as ckio
        from megatron_lev.ckpt.layout import COMPLETE_MARKER, CONFIG_FILE, LATEST_FILE, STARTED_MARKER
        from megatron_lev.utils.io import temp_path

        names = {
            STARTED_MARKER: "started",
            COMPLETE_MARKER: "complete",
            CONFIG_FILE: "config",
            LATEST_FILE: "latest",
        }

        def point_of(path: Path) -> str:
            return "rng" if path.name.startswith("rng_state_rank") else names.get(path.name, "")

        def before(path: Path, data: bytes) -> None:
            """At the start of an atomic write of `path`: die if this is the point."""
            if not self.armed:
                return
            point = point_of(path)
            if self.point == "dir" and point == "started":
                path.parent.mkdir(parents=True, exist_ok=True)
                self._die(str(path.parent))
            if self.point == point + ".tmp":
                path.parent.mkdir(parents=True, exist_ok=True)
                temp_path(path).write_bytes(data[: max(1, len(data) // 2)])  # a half-written temp
                self._die(str(temp_path(path)))

        def after(path: Path) -> None:
            if self.armed and self.point == point_of(path):
                self._die(str(path))

        def writer(original):
            def write(path, text_or_obj):
                path = Path(path)
                before(path, str(text_or_obj).encode())
                original(path, text_or_obj)
                after(path)

            return write

        def torch_writer(original):
            def save(obj, path):
                path = Path(path)
                before(path, b"\x80\x02half a torch file")
                original(obj, path)
                after(path)

            return save

        def engine_save(original):
            def save(root, tag, client_state):
                if self.armed and self.point == "engine.partial":
                    files = trainer.engine.ds_engine.checkpoint_engine
                    first = files.save

                    def save_one(*args, **kwargs):
                        first(*args, **kwargs)
                        self._die(str(kwargs.get("path", args[-1] if args else "")))

                    files.save = save_one
                original(root, tag, client_state)
                if self.armed and self.point == "engine":
                    self._die(f"{root}/{tag}")

            return save

        def pruner(original):
            def prune(root, keep_last, current=None):
                removed = original(root, keep_last, current=current)
                if self.armed and self.point == "pruned":
                    self._die(str(root))
                return removed

            return prune

        for name in ("atomic_write_json", "atomic_write_text"):
            self._patch(ckio, name, writer)
        self._patch(ckio, "atomic_save_torch", torch_writer)
        self._patch(ckio, "prune_checkpoints", pruner)
        self._patch(trainer.engine, "save", engine_save)

    def on_before_save(self, trainer) -> None:
        self.armed = trainer.state.iteration == self.iteration

    def on_close(self, trainer) -> None:
        for owner, name, original in reversed(self._restore):
            if owner is trainer.engine:
                del owner.save  # the method again
            else:
                setattr(owner, name, original)
        self._restore = []


SLOW_SAVE_ENV = "MEGATRON_LEV_SLOW_SAVE"  # RANK:SECONDS: that rank sleeps before writing each checkpoint


class SlowSave(Callback):
    """Makes one rank slow, not dead, in every save (`MEGATRON_LEV_SLOW_SAVE=RANK:SECONDS`): it sleeps
    before DeepSpeed writes its first file of each checkpoint, as on a slow file system, while its
    heartbeat goes on (the other ranks go on to the save's last barrier)."""

    def __init__(self, environ=None) -> None:
        raw = (os.environ if environ is None else environ).get(SLOW_SAVE_ENV, "").strip()
        rank, _, seconds = raw.partition(":")
        if not (rank.isdigit() and seconds.replace(".", "", 1).isdigit()):
            raise ValueError(f"{SLOW_SAVE_ENV}={raw!r} must be RANK:SECONDS, e.g. 1:30")
        self.rank, self.seconds = int(rank), float(seconds)

    def on_train_begin(self, trainer, control: Control) -> None:
        if trainer.rank != self.rank:
            return
        engine, seconds = trainer.engine, self.seconds
        writer = engine.ds_engine.checkpoint_engine
        save, write = engine.save, writer.save
        pending = []

        def slow_write(*args, **kwargs):
            if pending:  # the first file of this save
                pending.clear()
                time.sleep(seconds)
            return write(*args, **kwargs)

        def marked_save(*args, **kwargs):
            pending.append(True)
            return save(*args, **kwargs)

        writer.save, engine.save = slow_write, marked_save
