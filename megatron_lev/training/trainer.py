"""The training loop: steps, and the callbacks that do everything else.

`Trainer` receives everything already built (engine, data, budget, callbacks) by
`training.run.pretrain`. The loop runs optimizer steps through the engine's
`train_batch`, keeps each step's values on the device, and reads them (one host sync)
only when a callback asks through the step's `Control`: to log, validate, save or stop.
Checkpoints, metrics and progress, validation, preemption, the non-finite guard and
probes are callbacks (`training.callbacks`); the loop knows them only through the hook points
of `training.hooks` (it names none of them), so a run may add its own (`train.callbacks`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lev.config import RunConfig
from megatron_lev.engine import Engine
from megatron_lev.log import get_logger
from megatron_lev.parallel.session import no_phase
from megatron_lev.training.health import NonFiniteWeights
from megatron_lev.training.hooks import Callback, Control, StepRecord, TrainResult, TrainState
from megatron_lev.training.metrics import perplexity
from megatron_lev.training.schedule import Budget, learning_rate

__all__ = ["TrainData", "Trainer"]

log = get_logger(__name__)


@dataclass
class TrainData:
    """The data side: `train(consumed_samples)` and `valid()` yield micro-batches in the order every
    rank must see them; `global_batch` sequences make one step."""

    train: Callable[[int], Iterator]
    valid: Callable[[], Iterator] | None
    global_batch: int


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        engine: Engine,
        budget: Budget,
        data: TrainData,
        callbacks: Sequence[Callback] = (),
        *,
        world_size: int,
        device: torch.device,
        save_dir: str | None = None,
        load_dir: str | None = None,
        phase: Callable[[str], None] = no_phase,
    ) -> None:
        self.cfg, self.engine, self.budget, self.data = cfg, engine, budget, data
        self.set_phase = phase  # what this rank is doing, for a peer's diagnosis (`parallel.session`)
        self.world_size, self.device = world_size, device
        self.save_dir, self.load_dir = save_dir, load_dir  # named in messages (the checkpointer has its own)
        self.callbacks = sorted(callbacks, key=lambda cb: cb.order)  # stable: list order within an order
        self.state = TrainState()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending: list[_Step] = []  # steps whose loss and flags are still on the device
        self.last_step_seconds = 0.0
        self.read_seconds = 0.0
        self.steps_run = 0
        self._norm_sq: torch.Tensor | None = None  # this rank's weights' sum of squares after the last step

    def callback(self, kind: type) -> Callback | None:
        """The first callback of class `kind`, if any."""
        return next((cb for cb in self.callbacks if isinstance(cb, kind)), None)

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        """Ask the callbacks to save now (`on_save`); the one that writes checkpoints saves each
        iteration once, after every callback's `on_before_save` (the guard refuses non-finite weights)."""
        self._call("on_save")

    # ------------------------------------------------------------------ one step

    def weights_bad(self) -> torch.Tensor:
        """This rank's flag (float 0/1 on the device): a weight it updates (ZeRO: its partition) is
        inf/NaN."""
        return (~self.engine.weights_finite()).to(device=self.device, dtype=torch.float32)

    def any_rank_flag(self, flag: torch.Tensor) -> bool:
        """Whether `flag` (a device scalar > 0) is set on any rank (one all-reduce MAX, one host read)."""
        flag = flag.reshape(1)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def train_step(self, batches: Iterator) -> tuple[float, float | None, bool]:
        """One optimizer step over `gas` micro-batches; returns (loss, grad norm, skipped) as numbers.

        Reads the step's values at once (a host sync); the training loop uses `device_step`
        and reads them only when a callback asks. Raises NonFiniteWeights when the update
        made any rank's weights inf/NaN.
        """
        step = self.device_step(batches)
        loss, norm, weights_bad, _, _ = _read([step])[0]
        if weights_bad:
            raise NonFiniteWeights(f"iteration {step.iteration}: the update made the weights non-finite")
        return loss, norm, step.skipped or not math.isfinite(loss)

    def device_step(self, batches: Iterator) -> _Step:
        """One optimizer step (the engine's `train_batch`), its loss and flags left on the device.

        One collective per step: the loss summed over ranks, "an update made a weight inf/NaN", and
        the weights' sum of squares before and after the update (summed over ranks: their ratio is
        how much the update grew the weight norm, `train.max_update_ratio`). The sum before is the
        one after the previous step (weights change only in steps), so an applied step measures
        its weights once.
        """
        it = self.state.iteration
        self.engine.set_lr(learning_rate(it, self.cfg.train, self.budget.train_iters))
        before = self._norm_sq
        if before is None:
            before = self.engine.weights_squared_norm().to(device=self.device, dtype=torch.float32)
        out = self.engine.train_batch(batches)
        if out.skipped:
            bad, after = torch.zeros((), device=self.device), before
        else:
            bad = self.weights_bad()
            after = self.engine.weights_squared_norm().to(device=self.device, dtype=torch.float32)
        self._norm_sq = after
        stats = torch.stack([out.loss.reshape(()), bad.reshape(()), before.reshape(()), after.reshape(())])
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(stats)
        clip = getattr(out, "clip", None)
        return _Step(
            it + 1,
            stats,
            max(self.world_size, 1),
            out.grad_norm,
            out.skipped,
            out.scaler_overflow,
            clip,
            getattr(out, "spiked", False),
        )

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Mean loss and perplexity over `train.eval_iters` validation batches (None without data)."""
        if self.data.valid is None:
            return None
        self.engine.eval()
        batches = self.data.valid()
        losses = []
        try:
            for _ in range(self.cfg.train.eval_iters):
                losses.append(self.engine.eval_batch(batches))
        except StopIteration:
            log.warning("validation data ran out after %d batches", len(losses))
        finally:
            self.engine.train()
        if not losses:
            return None
        loss = float(torch.stack(losses).mean())  # one host read for the whole validation
        return {"loss": loss, "ppl": perplexity(loss)}

    def validate(self, iteration: int) -> None:
        self.set_phase(f"validation at iteration {iteration}")
        metrics = self.evaluate()
        if metrics is not None:
            self._call("on_validation", iteration, metrics)

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        total_iters = self.budget.train_iters
        result = TrainResult(self.state.iteration, 0, "completed")
        self.steps_run, self.pending, self.read_seconds = 0, [], 0.0
        self._norm_sq = None  # the weights may have been loaded since the last step
        try:
            control = Control()
            self._call("on_train_begin", control)
            batches = self.data.train(self.state.consumed_samples) if not control.stop else None
            while not control.stop and self.state.iteration < total_iters:
                it = self.state.iteration + 1
                self.set_phase(f"training step {it}")  # named if a peer's collective times out
                self._call("on_step_begin", it)
                start = time.perf_counter()
                self.pending.append(self.device_step(batches))
                self.state.iteration = it
                self.state.consumed_samples += self.data.global_batch
                self.state.consumed_tokens += self.budget.tokens_per_iter
                self.steps_run += 1
                self.last_step_seconds = time.perf_counter() - start
                control = Control()
                self._call("on_step_end", it, self.pending[-1].skipped, control)
                if not control.any:
                    continue
                self._settle(control, result)
                if control.log:
                    values = {}
                    for cb in self.callbacks:
                        values.update(cb.metrics(self, it))
                    self._call("on_log", it, values)
                if control.evaluate and not control.stop:
                    self.validate(it)
                if control.save:
                    self.save()
            if self.pending:  # read what no callback asked for (e.g. without a MetricsLogger)
                self._settle(control, result)
            if control.stop:
                result.exit_code, result.reason = control.exit_code, control.reason
            result.iteration = self.state.iteration
            self._call("on_train_end", result)
            return result
        finally:
            self._call("on_close")

    def _settle(self, control: Control, result: TrainResult) -> None:
        """Read the pending steps' values (one host sync) and hand them to the callbacks in order."""
        start = time.perf_counter()
        values = _read(self.pending)
        self.read_seconds += time.perf_counter() - start
        for step, (loss, norm, weights_bad, growth, clip) in zip(self.pending, values):
            record = StepRecord(
                step.iteration,
                loss,
                norm,
                step.skipped or not math.isfinite(loss),
                step.scaler_overflow,
                weights_bad,
                growth,
                clip,
                step.spiked,
            )
            result.losses[step.iteration] = loss
            self._call("on_step_values", record, control)
        self.pending = []


@dataclass
class _Step:
    """One optimizer step's results, still on the device until `_read`."""

    iteration: int
    stats: torch.Tensor  # (4,) summed over ranks: loss, "weights non-finite" flag (> 0), the weights'
    # sum of squares before and after the update
    world_size: int
    norm: torch.Tensor | None  # global gradient norm, or None when the engine has none
    skipped: bool  # the guard held the update back (a host value: the guard read its flag)
    scaler_overflow: bool = False  # the fp16 loss scaler held it back (gradient overflow)
    clip: torch.Tensor | None = None  # the clip groups' norms then factors (`StepOutput.clip`)
    spiked: bool = False  # held back as a loss or gradient-norm spike (a host value, as `skipped`)


def _read(steps: list[_Step]) -> list[tuple[float, float | None, bool, float, tuple | None]]:
    """(loss, grad norm, weights non-finite, weight-norm growth, clip norms and factors) of each step,
    with one host read for all of them."""
    if not steps:
        return []
    device = steps[0].stats.device
    nan = torch.full((), float("nan"), device=device, dtype=torch.float64)
    width = max(0 if s.clip is None else s.clip.numel() for s in steps)  # the same for every step of a run
    none = torch.full((width,), float("nan"), device=device, dtype=torch.float64)
    rows = torch.stack(
        [
            torch.cat(
                [
                    s.stats.to(torch.float64),  # float32 values, widened exactly: the norm keeps its digits
                    (nan if s.norm is None else s.norm.to(device=device, dtype=torch.float64)).reshape(1),
                    none if s.clip is None else s.clip.to(device=device, dtype=torch.float64).reshape(-1),
                ]
            )
            for s in steps
        ]
    )  # (steps, 5 + clip groups x 2)
    return [
        (
            loss / s.world_size,
            None if s.norm is None else norm,
            bad > 0,
            growth(before, after),
            None if s.clip is None else tuple(clip),
        )
        for s, (loss, bad, before, after, norm, *clip) in zip(steps, rows.tolist())
    ]


def growth(before: float, after: float) -> float:
    """The factor by which a step changed the weight norm, from the sums of squares before and after
    (inf when the sum after overflowed; 1 when nothing can be said, e.g. both overflowed)."""
    if before > 0 and math.isfinite(before):
        return math.sqrt(after / before) if after >= 0 else math.nan
    return math.inf if before == 0 and after > 0 else 1.0
