"""The training loop: steps, validation, logging, checkpoints, preemption and the skip guard.

`Trainer` receives everything already built (engine, optimizer, data, budget) by
`training.run.pretrain`, so the loop itself is short and reads top to bottom.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lev.config import RunConfig
from megatron_lev.logging import get_logger
from megatron_lev.training import checkpointing
from megatron_lev.training.batches import micro_batch_loss
from megatron_lev.training.health import (
    INJECT_INF_WEIGHTS_ENV,
    INJECT_NAN_GRAD_ENV,
    AllStepsSkipped,
    NaNInjector,
    NonFiniteWeights,
    SkipTracker,
    TooManySkippedSteps,
    all_finite,
    injected_nan_steps,
)
from megatron_lev.training.metrics import MetricsWriter, memory_stats, perplexity, throughput
from megatron_lev.training.schedule import Budget, learning_rate
from megatron_lev.training.signals import PREEMPTED_EXIT_CODE, PreemptionWatcher

SKIP_LIMIT_EXIT_CODE = 3

log = get_logger(__name__)


@dataclass
class TrainResult:
    iteration: int
    exit_code: int  # 0 done, PREEMPTED_EXIT_CODE, SKIP_LIMIT_EXIT_CODE
    reason: str  # "completed", "preempted", "too many skipped steps"
    skipped_steps: int = 0
    losses: dict[int, float] = field(default_factory=dict)  # iteration -> train loss (this process's run)


@dataclass
class TrainState:
    """What a checkpoint must carry besides model and optimizer to resume exactly."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    skips: dict = field(default_factory=dict)


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        engine,
        optimizer,
        budget: Budget,
        *,
        pipeline: bool,
        world_size: int,
        device: torch.device,
        train_batches: Callable[[int], Iterator],
        valid_batches: Callable[[], Iterator] | None,
        flops_per_token: float | None,
        writer: MetricsWriter,
        gas: int,
        global_batch: int,
        save_dir: str | None,
        load_dir: str | None,
        nan_steps: set[int] = frozenset(),
        embedding_probe=None,
        watcher: PreemptionWatcher | None = None,
        nan_grad_steps: set[int] | None = None,
        inf_weight_steps: set[int] | None = None,
    ) -> None:
        self.cfg, self.engine, self.optimizer, self.budget = cfg, engine, optimizer, budget
        self.pipeline, self.world_size, self.device = pipeline, world_size, device
        self.make_train_batches, self.make_valid_batches = train_batches, valid_batches
        self.flops_per_token, self.writer = flops_per_token, writer
        self.gas, self.global_batch = gas, global_batch
        self.save_dir, self.load_dir = save_dir, load_dir
        self.nan_steps = set(nan_steps)
        # testing aids (default: from the environment): NaN gradients with a finite loss; an inf weight
        self.nan_grad_steps = (
            injected_nan_steps(name=INJECT_NAN_GRAD_ENV) if nan_grad_steps is None else set(nan_grad_steps)
        )
        self.inf_weight_steps = (
            injected_nan_steps(name=INJECT_INF_WEIGHTS_ENV)
            if inf_weight_steps is None
            else set(inf_weight_steps)
        )
        self.embedding_probe = embedding_probe  # .value: input-embedding RMS at the first forward
        self.watcher = watcher  # installed by the caller before start-up (a notice may come early); else here
        self.state = TrainState()
        self.skips = SkipTracker(cfg.train.max_consecutive_skips)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._injector = NaNInjector(self._nan_target()) if self.nan_steps else None
        self._grad_injector = NaNInjector(self._nan_target(), grad=True) if self.nan_grad_steps else None
        self._counts = [0, 0, 0]  # by the current `train()`: run, applied, held back by the fp16 scaler

    # ------------------------------------------------------------------ setup helpers

    def _nan_target(self) -> torch.nn.Module:
        """Where the NaN test hook goes: the model (PP=1) or the last layer of a pipeline stage."""
        module = self.engine.module
        if self.pipeline:
            layers = [f for f in module.forward_funcs if isinstance(f, torch.nn.Module)]
            return layers[-1] if layers else module
        return module

    def resume(self, plan: checkpointing.ResumePlan | None = None, allow_changes=()) -> None:
        """Load the checkpoint `plan` names (by default the newest one that verifies, see
        `checkpointing.plan_resume`); config keys in `allow_changes` may differ from the checkpoint's."""
        if not self.load_dir and not self.save_dir:
            return
        if plan is None:
            plan = checkpointing.plan_resume(self.load_dir, self.save_dir, self.cfg, allow_changes)
        if plan.tag is None:
            return
        client = checkpointing.load_checkpoint(self.engine, plan.root, plan.tag)
        st = client.get("train_state", {})
        self.state = TrainState(
            iteration=int(st["iteration"]),
            consumed_samples=int(st["consumed_samples"]),
            consumed_tokens=int(st.get("consumed_tokens", 0)),
        )
        self.skips.load_state_dict(st.get("skips", {}))

    def save(self) -> None:
        if not self.save_dir:
            return
        self._check_weights(f"refusing to save a checkpoint to {self.save_dir}")  # "last good" must be finite
        self.state.skips = self.skips.state_dict()
        client = {"train_state": vars(self.state).copy(), "config": self.cfg.to_dict()}
        checkpointing.save_checkpoint(
            self.engine,
            self.save_dir,
            self.state.iteration,
            client,
            self.cfg.train.keep_last,
            config_yaml=self.cfg.to_yaml(),
        )

    # ------------------------------------------------------------------ one step

    def _mean_over_world(self, value: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.world_size > 1:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.world_size
        return value.detach().reshape(())

    def _weights_bad(self) -> torch.Tensor:
        """This rank's flag (float 0/1 on the device): a weight it updates (ZeRO: its partition) is
        inf/NaN."""
        weights = (p for g in self.optimizer.param_groups for p in g["params"])
        return (~all_finite(weights)).to(device=self.device, dtype=torch.float32)

    def _check_weights(self, what: str) -> None:
        """Raise NonFiniteWeights on every rank when any rank holds a non-finite weight (one all-reduce)."""
        bad = self._weights_bad().reshape(1)
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            raise NonFiniteWeights(
                f"{what}: the weights at iteration {self.state.iteration} are not finite "
                "(inf/NaN); use an earlier checkpoint, and lower train.lr or use "
                "train.precision=fp32 to find the cause"
            )

    def train_step(self, batches: Iterator) -> tuple[float, float | None, bool]:
        """One optimizer step over `gas` micro-batches; returns (loss, grad norm, skipped) as numbers.

        Reads the step's values at once (a host sync); the training loop uses `device_step`
        and reads them only at logging intervals. Raises NonFiniteWeights when the update
        made any rank's weights inf/NaN.
        """
        step = self.device_step(batches)
        loss, norm, weights_bad = _read([step])[0]
        if weights_bad:
            raise self._non_finite_weights(self.state.iteration + 1)
        return loss, norm, step.skipped or not math.isfinite(loss)

    def device_step(self, batches: Iterator) -> _Step:
        """One optimizer step over `gas` micro-batches, its loss and flags left on the device.

        The only host reads are the guard's finiteness flag (one per `optimizer.step()` call)
        and, for LEV and the other per-unique-id embeddings, `torch.unique`'s output size.
        """
        it = self.state.iteration
        lr = learning_rate(it, self.cfg.train, self.budget.train_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self._injector is not None:
            self._injector.armed = (it + 1) in self.nan_steps
        if self._grad_injector is not None:
            self._grad_injector.armed = (it + 1) in self.nan_grad_steps
        if hasattr(self.optimizer, "corrupt_update"):
            self.optimizer.corrupt_update = (it + 1) in self.inf_weight_steps
        if self.pipeline:
            self.optimizer.begin_iteration()
            local_loss = self.engine.train_batch(data_iter=batches)  # DP-mean, the same on every stage
            local_loss = torch.as_tensor(local_loss).detach().float().reshape(()).to(self.device)
        else:
            total = torch.zeros((), device=self.device)
            for micro in range(self.gas):
                loss_mb = micro_batch_loss(self.engine, next(batches))  # (B, S) per-token -> () mean
                total += loss_mb.detach()
                self.engine.backward(loss_mb)
                if micro == self.gas - 1:  # a non-finite loss skips the update: decided on the device
                    self.optimizer.begin_iteration(force_skip=~torch.isfinite(total))
                self.engine.step()
            local_loss = total / self.gas
        for injector in (self._injector, self._grad_injector):
            if injector is not None:
                injector.armed = False
        if hasattr(self.optimizer, "corrupt_update"):
            self.optimizer.corrupt_update = False
        skipped_update = self.optimizer.iteration_skipped  # the same on every rank (the guard agrees)
        scaler_overflow = skipped_update and self._loss_scaler_overflow()
        # one collective per step: the loss (summed over ranks) and "an update made a weight inf/NaN"
        bad = torch.zeros((), device=self.device) if skipped_update else self._weights_bad()
        stats = torch.stack([local_loss, bad.reshape(())])
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(stats)
        norm = self.engine.get_global_grad_norm()  # a device tensor, a float (inf when skipped), or None
        if isinstance(norm, torch.Tensor):
            norm = norm.detach().to(torch.float32, copy=True).reshape(())  # the engine may reuse its buffer
        elif norm is not None:
            norm = torch.tensor(float(norm))
        return _Step(it + 1, stats, max(self.world_size, 1), norm, skipped_update, scaler_overflow)

    def _loss_scaler_overflow(self) -> bool:
        """Whether DeepSpeed's fp16 loss scaler held this step back (gradient overflow: it lowers the
        scale and never calls our optimizer). Its optimizers (FP16, ZeRO) flag that as `.overflow`."""
        if self.cfg.train.precision != "fp16" or getattr(self.optimizer, "calls", 0):
            return False
        return bool(getattr(getattr(self.engine, "optimizer", None), "overflow", False))

    def _non_finite_weights(self, iteration: int) -> NonFiniteWeights:
        return NonFiniteWeights(
            f"iteration {iteration}: the update made the weights non-finite (inf/NaN) "
            "although the gradients were finite; nothing was saved, so the newest checkpoint in "
            f"{self.save_dir} holds the last good weights: resume from it with a lower train.lr "
            "or a higher train.adam_eps, or use train.precision=fp32"
        )

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        if self.make_valid_batches is None:
            return None
        self.engine.eval()
        batches = self.make_valid_batches()
        losses = []
        try:
            for _ in range(self.cfg.train.eval_iters):
                if self.pipeline:
                    losses.append(float(self.engine.eval_batch(data_iter=batches)))
                else:
                    for _ in range(self.gas):
                        losses.append(self._mean_over_world(micro_batch_loss(self.engine, next(batches))))
        except StopIteration:
            log.warning("validation data ran out after %d batches", len(losses))
        finally:
            self.engine.train()
        if not losses:
            return None
        losses = torch.stack(
            [torch.as_tensor(x, dtype=torch.float32, device=self.device).reshape(()) for x in losses]
        ).tolist()  # one host read for the whole validation
        loss = sum(losses) / len(losses)
        return {"loss": loss, "ppl": perplexity(loss)}

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainResult:
        t, lg = self.cfg.train, self.cfg.logging
        total_iters = self.budget.train_iters
        result = TrainResult(self.state.iteration, 0, "completed")
        batches = self.make_train_batches(self.state.consumed_samples)
        bar, redirect = None, contextlib.nullcontext()
        if self.rank == 0 and lg.progress_bar:
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            bar = tqdm(
                total=total_iters, initial=self.state.iteration, desc="train", unit="it", dynamic_ncols=True
            )
            redirect = logging_redirect_tqdm(
                loggers=[logging.getLogger("megatron_lev")]
            )  # log lines above the bar
        window = _Window()
        saved_at = self.state.iteration if self.state.iteration else -1  # a resumed state is already on disk
        own_watcher = self.watcher is None
        watcher = PreemptionWatcher().install() if own_watcher else self.watcher
        redirect.__enter__()
        try:
            if watcher.should_stop(self.device):  # the notice came during start-up: nothing new to save
                log.warning("preempted before the first step: exiting with status %d", PREEMPTED_EXIT_CODE)
                return TrainResult(self.state.iteration, PREEMPTED_EXIT_CODE, "preempted", self.skips.total)
            if self.state.iteration < total_iters:
                self._check_weights(
                    f"before the first step (loaded from {self.load_dir})"
                    if self.state.iteration
                    else "before the first step"
                )
            self._counts = [0, 0, 0]  # steps run, applied, held back by the fp16 loss scaler
            started_at = self.state.iteration  # 0: this process trains from scratch
            pending: list[_Step] = []  # steps whose loss and flags are still on the device
            while self.state.iteration < total_iters:
                start = time.perf_counter()
                pending.append(self.device_step(batches))
                self.state.iteration += 1
                it = self.state.iteration
                self.state.consumed_samples += self.global_batch
                self.state.consumed_tokens += self.budget.tokens_per_iter
                window.add_time(time.perf_counter() - start, self.budget.tokens_per_iter)
                if bar is not None:
                    bar.update(1)
                stop = watcher.should_stop(self.device)
                evaluate = bool(t.eval_interval and it % t.eval_interval == 0)
                save = bool(t.save_interval and it % t.save_interval == 0)
                log_now = it % lg.log_interval == 0 or it == total_iters
                # the host reads the losses only here: at a log line, a skipped step (the skip limit
                # counts at once), and before anything that must see finite weights or every loss
                if not (log_now or pending[-1].skipped or evaluate or save or stop):
                    continue
                too_many = self._settle(pending, window, result, bar)
                pending = []
                if log_now or too_many:
                    self._log_window(window, it)
                    window = _Window()
                if too_many is not None:
                    log.error("%s", too_many)
                    self.save()
                    return TrainResult(
                        it, SKIP_LIMIT_EXIT_CODE, "too many skipped steps", self.skips.total, result.losses
                    )
                if evaluate:
                    self._log_validation(it)
                if save:
                    self.save()
                    saved_at = it
                if stop:
                    if saved_at != it:
                        self.save()
                    log.warning(
                        "preempted at iteration %d: checkpoint saved, exiting with status %d",
                        it,
                        PREEMPTED_EXIT_CODE,
                    )
                    return TrainResult(it, PREEMPTED_EXIT_CODE, "preempted", self.skips.total, result.losses)
            steps_run, steps_applied, scaler_skips = self._counts
            # a resumed run's short tail may be all skipped (the run before it learnt); and overflow
            # steps whose loss scale the fp16 scaler lowers are its normal work, not a failure
            if started_at == 0 and steps_run > scaler_skips and not steps_applied:
                raise AllStepsSkipped(
                    f"all {steps_run} steps (iterations {self.state.iteration - steps_run + 1}-"
                    f"{self.state.iteration}) had a non-finite loss or gradients and were skipped: the run "
                    "learnt nothing and saved nothing; check the data, lower train.lr, or use "
                    "train.precision=fp32 to find the cause"
                )
            if t.eval_interval and self.state.iteration % t.eval_interval:
                self._log_validation(self.state.iteration)
            if saved_at != self.state.iteration:
                self.save()
            result.iteration, result.skipped_steps = self.state.iteration, self.skips.total
            return result
        finally:
            if own_watcher:
                watcher.uninstall()
            redirect.__exit__(None, None, None)
            if bar is not None:
                bar.close()

    def _settle(
        self, pending: list[_Step], window: _Window, result: TrainResult, bar
    ) -> TooManySkippedSteps | None:
        """Read the pending steps' values (one host sync), record them, and apply the checks in order.

        Raises NonFiniteWeights at the first step whose update made a weight inf/NaN; returns the
        skip-limit error if a step reached it (the caller logs, saves and stops).
        """
        start = time.perf_counter()
        values = _read(pending)
        window.add_time(time.perf_counter() - start, 0)  # the device work the read waited for
        too_many = None
        for step, (loss, norm, weights_bad) in zip(pending, values):
            if weights_bad:
                raise self._non_finite_weights(step.iteration)
            skipped = step.skipped or not math.isfinite(loss)
            result.losses[step.iteration] = loss
            window.add(loss, norm, skipped)
            self._counts[0] += 1
            self._counts[1] += int(not skipped)
            self._counts[2] += int(skipped and step.scaler_overflow and math.isfinite(loss))
            if skipped:
                log.warning(
                    "iteration %d: non-finite loss (%s) or gradient norm (%s): update skipped",
                    step.iteration,
                    loss,
                    norm,
                )
            try:
                self.skips.update(skipped, step.iteration)
            except TooManySkippedSteps as exc:
                too_many = too_many or exc
        if bar is not None and values:
            bar.set_postfix(loss=f"{values[-1][0]:.4f}", refresh=False)
        return too_many

    def _log_window(self, w: _Window, it: int) -> None:
        tp = throughput(
            w.tokens, w.seconds, self.flops_per_token, self.world_size, self.cfg.logging.peak_tflops
        )
        values = {
            "loss": w.mean_loss,
            "lr": learning_rate(it - 1, self.cfg.train, self.budget.train_iters),
            "grad_norm": w.last_norm if w.last_norm is not None else float("nan"),
            "skipped_steps": self.skips.total,
            "skipped_in_window": w.skipped_now,
            **tp,
            **memory_stats(),
        }
        probe = self.embedding_probe
        if probe is not None and probe.value is not None:
            values["input_embedding_rms"] = probe.value
            if self.rank == 0:
                log.info("input-embedding RMS at the first step: %.4f", probe.value)
            self.embedding_probe = None
        self.writer.record("train", it, values, tokens=self.state.consumed_tokens)
        if self.rank == 0:
            line = (
                f"iter {it}/{self.budget.train_iters} | loss {w.mean_loss:.4f} | lr {values['lr']:.3e} | "
                f"grad norm {values['grad_norm']:.3f} | {tp['tokens_per_s']:,.0f} tok/s"
            )
            if "mfu" in tp:
                line += f" | {tp['tflops_per_device']:.3g} TFLOP/s/dev | MFU {100 * tp['mfu']:.2f}%"
            mem = values.get("mem_peak_gib", values.get("mem_rss_gib"))
            if mem is not None:
                line += f" | mem {mem:.1f} GiB"
            line += f" | skipped {values['skipped_steps']}"
            log.info(line)

    def _log_validation(self, it: int) -> None:
        metrics = self.evaluate()
        if metrics is None:
            return
        self.writer.record("valid", it, metrics, tokens=self.state.consumed_tokens)
        if self.rank == 0:
            log.info(
                "validation at iteration %d: loss %.4f | perplexity %.2f", it, metrics["loss"], metrics["ppl"]
            )


@dataclass
class _Step:
    """One optimizer step's results, still on the device until `_read`."""

    iteration: int
    stats: torch.Tensor  # (2,): loss summed over ranks, "weights non-finite" flag (> 0)
    world_size: int
    norm: torch.Tensor | None  # global gradient norm, or None when the engine has none
    skipped: bool  # the guard held the update back (a host value: the guard read its flag)
    scaler_overflow: bool = False  # the fp16 loss scaler held it back (gradient overflow)


def _read(steps: list[_Step]) -> list[tuple[float, float | None, bool]]:
    """(loss, grad norm, weights non-finite) of each step, with one host read for all of them."""
    if not steps:
        return []
    device = steps[0].stats.device
    nan = torch.full((), float("nan"), device=device)
    rows = torch.stack(
        [
            torch.stack(
                [
                    s.stats[0],
                    s.stats[1],
                    nan if s.norm is None else s.norm.to(device=device, dtype=torch.float32),
                ]
            )
            for s in steps
        ]
    )  # (steps, 3)
    return [
        (loss / s.world_size, None if s.norm is None else norm, bad > 0)
        for s, (loss, bad, norm) in zip(steps, rows.tolist())
    ]


@dataclass
class _Window:
    """Accumulates the iterations between two log lines."""

    loss_sum: float = 0.0
    finite: int = 0
    skipped_now: int = 0
    seconds: float = 0.0
    tokens: int = 0
    last_norm: float | None = None

    def add(self, loss: float, norm: float | None, skipped: bool) -> None:
        if math.isfinite(loss) and not skipped:
            self.loss_sum += loss
            self.finite += 1
        self.skipped_now += int(skipped)
        if norm is not None:
            self.last_norm = norm

    def add_time(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.finite if self.finite else float("nan")
