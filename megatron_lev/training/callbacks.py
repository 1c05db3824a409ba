"""What the training loop does besides stepping, as callbacks (the hook points: `training.hooks`).

Each callback asks for work through the step's `Control` and does its own part. A run has, in
`order` (lower first), then in list order:

    NonFiniteGuard   (-10)  skip counting and limit, finite weights before every save
    Checkpointer      (10)  periodic saves, the final save (and `resume`, which `pretrain` calls)
    Validation              periodic and final validation
    MetricsLogger           log lines, `metrics.jsonl` / TensorBoard, the progress bar
    Preemption              SIGTERM/SIGUSR1: save and exit with status 75
    EmbeddingProbe          the input-embedding RMS at the first step
    WandbLogger             optional Weights & Biases mirror of the logged values

and then the callbacks `train.callbacks` names.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_lev.ckpt.io import PendingSave, begin_save, load_checkpoint
from megatron_lev.ckpt.layout import tag_for
from megatron_lev.log import get_logger
from megatron_lev.training.health import (
    AllStepsSkipped,
    NonFiniteWeights,
    SkipTracker,
    StoppedAtSkipLimit,
    TooManySkippedSteps,
    WeightsBlewUp,
)
from megatron_lev.training.hooks import Callback, Control, SkipSave, StepRecord, TrainResult, TrainState
from megatron_lev.training.metrics import MetricsWriter, memory_stats, throughput
from megatron_lev.training.resume import StartPoint
from megatron_lev.training.schedule import learning_rate
from megatron_lev.training.signals import PREEMPTED_EXIT_CODE, PreemptionWatcher
from megatron_lev.utils.progress import on_terminal

if TYPE_CHECKING:
    from megatron_lev.config import TrainConfig
    from megatron_lev.training.trainer import Trainer

SKIP_LIMIT_EXIT_CODE = 3

log = get_logger(__name__)


# ---------------------------------------------------------------------- the non-finite guard


def block_squares(engine):
    """The engine's weight sum of squares by block (`DeepSpeedEngine.block_weight_squares`,
    collective; `(names, device tensor)`, read only if an update is refused), or None."""
    measure = getattr(engine, "block_weight_squares", None)
    return measure() if measure is not None else None


def _as_dict(squares) -> dict[str, float]:
    if squares is None:
        return {}
    names, sums = squares
    return dict(zip(names, sums.tolist()))  # a host read, on a refused update only


def one_block_blew_up(before, after, limit: float) -> tuple[str, float, float] | None:
    """(block, its weight norm's growth, the rest of the model's) when the block whose norm grew most
    between `before` and `after` (`block_squares`) made the model's growth: without it the rest grew
    no more than `limit`. None when the rest grew past it too (the whole model: the learning rate)."""
    before, after = _as_dict(before), _as_dict(after)
    shared = [b for b in after if before.get(b)]
    if len(shared) < 2:
        return None
    growth = {b: (after[b] / before[b]) ** 0.5 for b in shared}
    name = max(growth, key=growth.get)
    rest_before = sum(before[b] for b in shared if b != name)
    rest = (sum(after[b] for b in shared if b != name) / rest_before) ** 0.5 if rest_before else float("inf")
    if rest <= limit < growth[name]:
        return name, growth[name], rest
    return None


def spike_line(trainer: Trainer, record: StepRecord) -> str:
    """The log line of a step held back as a spike, with the window it was judged against (one host
    read, on a spike step only)."""
    t = trainer.cfg.train
    window = getattr(trainer.engine, "last_spike", None)
    against = ""
    if window is not None:
        norm_mean, norm_sd, loss_mean, loss_sd = window.tolist()
        against = f" (window: gradient norm {norm_mean:.4g} +- {norm_sd:.3g}"
        against += f", loss {loss_mean:.4g} +- {loss_sd:.3g})" if loss_mean else ")"
    head = f"iteration {record.iteration}: loss {record.loss:.4g}, gradient norm {record.grad_norm:.4g}"
    return (
        f"{head}: a spike, more than train.spike_zscore={t.spike_zscore:g} standard deviations above "
        f"the mean of the last {t.spike_window} applied steps{against}; update skipped"
    )


class SpikeWindow(Callback):
    """Carries the spike detector's window (`engine.spikes`) in the checkpoint's train state, so a
    resumed run judges its next steps against the same window as the uninterrupted run."""

    state_key = "spike_window"

    def __init__(self) -> None:
        self._detector = None
        self._pending: dict = {}

    def on_train_begin(self, trainer: Trainer, control: Control) -> None:
        clipper = getattr(trainer.engine, "clipper", None)
        self._detector = getattr(clipper, "spikes", None)
        if self._detector is not None and self._pending:
            self._detector.load_state_dict(self._pending)

    def state_dict(self) -> dict:
        return self._detector.state_dict() if self._detector is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self._pending = dict(state)
        if self._detector is not None:
            self._detector.load_state_dict(self._pending)


class NonFiniteGuard(Callback):
    """Counts skipped updates (exit 3 at `max_consecutive_skips` in a row), stops at the first update
    that made a weight inf/NaN or grew the weight norm more than `max_update_ratio`-fold, refuses to
    start from or save non-finite weights, saves nothing while no update of the run was applied, and
    fails a run whose every step was skipped."""

    order = -10
    state_key = "skips"

    def __init__(self, max_consecutive_skips: int, max_update_ratio: float | None = None) -> None:
        self.skips = SkipTracker(max_consecutive_skips)
        self.max_update_ratio = max_update_ratio
        self._run = self._applied = self._scaler = 0
        self.spikes = 0  # updates of this process's run held back as spikes
        self._started_at = 0
        self._blocks = None  # the weights' sum of squares by block, on the device (one_block_blew_up)
        self._blocks_at = 0

    def on_train_begin(self, trainer: Trainer, control: Control) -> None:
        self._run = self._applied = self._scaler = 0
        self._started_at = trainer.state.iteration  # 0: this process trains from scratch
        if trainer.state.iteration < trainer.budget.train_iters:
            where = f" (loaded from {trainer.load_dir})" if trainer.state.iteration else ""
            self.check_weights(trainer, f"before the first step{where}")
        # each block's weights, to tell one block blowing up from the whole model (refreshed at saves)
        self._blocks, self._blocks_at = block_squares(trainer.engine), trainer.state.iteration

    def on_step_end(self, trainer: Trainer, iteration: int, skipped: bool, control: Control) -> None:
        if skipped:
            control.read = True  # the skip limit counts at once

    def on_step_values(self, trainer: Trainer, record: StepRecord, control: Control) -> None:
        if record.weights_bad:
            raise NonFiniteWeights(
                f"iteration {record.iteration}: the update made the weights non-finite (inf/NaN) "
                "although the gradients were finite; nothing was saved, so the newest checkpoint in "
                f"{trainer.save_dir} holds the last good weights: resume from it with a lower train.lr "
                "or a higher train.adam_eps, or use train.precision=fp32"
            )
        limit = self.max_update_ratio
        if limit and not record.skipped and record.weight_growth > limit:
            lr = learning_rate(record.iteration - 1, trainer.cfg.train, trainer.budget.train_iters)
            head = (
                f"iteration {record.iteration}: the update grew the weight norm {record.weight_growth:.3g}-"
                f"fold (more than train.max_update_ratio={limit:g})"
            )
            tail = (
                "the update is refused and nothing was saved from it, so the newest checkpoint in "
                f"{trainer.save_dir} (if any) holds the last good weights"
            )
            block = one_block_blew_up(self._blocks, block_squares(trainer.engine), limit)
            if block is not None:
                name, grew, rest = block
                raise WeightsBlewUp(
                    f"{head}: one block blew up, {name} (its weight norm grew {grew:.3g}-fold since "
                    f"iteration {self._blocks_at}, the rest of the model {rest:.3g}-fold), not the whole "
                    f"model; {tail}: look at {name} (its inputs, initialisation or a train.param_groups "
                    f"rule for it) before the learning rate ({lr:.3g} at this step)"
                )
            raise WeightsBlewUp(
                f"{head}: the learning rate ({lr:.3g} at this step) is far too high; {tail}: lower "
                "train.lr (with --allow-change train.lr to resume from a checkpoint)"
            )
        self._run += 1
        self._applied += int(not record.skipped)
        self._scaler += int(record.skipped and record.scaler_overflow and math.isfinite(record.loss))
        if record.skipped and record.spiked:
            self.spikes += 1
            log.warning("%s", spike_line(trainer, record))
        elif record.skipped:
            log.warning(
                "iteration %d: non-finite loss (%s) or gradient norm (%s): update skipped",
                record.iteration,
                record.loss,
                record.grad_norm,
            )
        nothing_learnt = self.nothing_learnt(record.iteration, self.skips.total + int(record.skipped))
        try:
            self.skips.update(record.skipped, record.iteration, nothing_learnt)
        except TooManySkippedSteps as exc:
            if nothing_learnt:  # nothing to save: stop at once, like a run whose every step was skipped
                raise AllStepsSkipped(str(exc)) from None
            if not control.stop:
                log.error("%s", exc)
            control.log = True
            control.request_stop(SKIP_LIMIT_EXIT_CODE, "too many skipped steps")

    def nothing_learnt(self, iteration: int, skipped_total: int | None = None) -> bool:
        """Whether no update up to `iteration` was applied: every iteration of this run, and of the runs
        whose checkpoint it resumed, was skipped (`skipped_total`, default the tally so far, counts
        them). A run whose only skips are the fp16 loss scaler's (lowering its scale at the start is its
        normal work) has learnt nothing yet but has not failed: not counted."""
        total = self.skips.total if skipped_total is None else skipped_total
        if iteration <= 0 or total < iteration:
            return False
        return self._started_at > 0 or self._run > self._scaler

    def metrics(self, trainer: Trainer, iteration: int) -> dict[str, Any]:
        return {"skipped_steps": self.skips.total, "spike_steps": self.spikes}

    def on_before_save(self, trainer: Trainer) -> None:
        if self.nothing_learnt(trainer.state.iteration):
            raise SkipSave(
                f"not saving a checkpoint of iteration {trainer.state.iteration} to {trainer.save_dir}: "
                "every update so far was skipped, so it would hold the initial weights as if trained"
            )
        self.check_weights(trainer, f"refusing to save a checkpoint to {trainer.save_dir}")
        self._blocks, self._blocks_at = block_squares(trainer.engine), trainer.state.iteration

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        result.skipped_steps = self.skips.total
        # a resumed run's short tail may be all skipped (the run before it learnt); and overflow
        # steps whose loss scale the fp16 scaler lowers are its normal work, not a failure
        it = trainer.state.iteration
        checkpointer = trainer.callback(Checkpointer)
        resumed = getattr(checkpointer, "resumed_from", None) or trainer.load_dir
        limit = self.skips.max_consecutive
        if result.exit_code == 0 and self._run == 0 and limit and self.skips.consecutive >= limit:
            raise StoppedAtSkipLimit(
                f"nothing left to train: the checkpoint this run resumed, {resumed} (iteration {it}), was "
                f"saved when the run stopped at the skip limit ({self.skips.consecutive} consecutive "
                f"non-finite steps up to iteration {it}, train.max_consecutive_skips={limit}), so the run "
                "did not complete; find the cause (check the data, lower train.lr, or use "
                "train.precision=fp32), then resume from an earlier checkpoint or start again"
            )
        if result.exit_code == 0 and self.nothing_learnt(it):
            if self._started_at == 0:
                raise AllStepsSkipped(
                    f"all {self._run} steps (iterations {it - self._run + 1}-{it}) had a non-finite loss or "
                    "gradients and were skipped: the run learnt nothing and saved nothing; check the data, "
                    "lower train.lr, or use train.precision=fp32 to find the cause"
                )
            raise AllStepsSkipped(
                f"every one of the {it} iterations up to {it} was skipped (non-finite loss or gradients), "
                f"{self._run} in this run and the others before the checkpoint it resumed, {resumed}: "
                "that checkpoint holds the initial weights, and the run learnt nothing; move it away to "
                "start from scratch, and check the data, lower train.lr, or use train.precision=fp32 to "
                "find the cause"
            )

    def check_weights(self, trainer: Trainer, what: str) -> None:
        """Raise NonFiniteWeights on every rank when any rank holds a non-finite weight (one all-reduce)."""
        if trainer.any_rank_flag(trainer.weights_bad()):
            raise NonFiniteWeights(
                f"{what}: the weights at iteration {trainer.state.iteration} are not finite "
                "(inf/NaN); use an earlier checkpoint, and lower train.lr or use "
                "train.precision=fp32 to find the cause"
            )

    def state_dict(self) -> dict:
        return self.skips.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.skips.load_state_dict(state)


# ---------------------------------------------------------------------- checkpoints


class Checkpointer(Callback):
    """Resumes from `load_dir` (`resume`, before `train()`), saves to `save_dir` every `save_interval`
    steps, when asked (`control.save`: before a stop) and at the end (never twice for one iteration),
    keeping the newest `keep_last`; with `save_initial` also the initial weights (iteration 0) before
    the first step. Every callback's `on_before_save` runs before it writes (the guard refuses
    non-finite weights there).

    With `async_save` a save returns once every rank's files are written; while the steps go on,
    every rank checksums its share of the files on a background thread and rank 0 merges the shares
    into the `complete` marker, points `latest` and prunes. The next save, and the end of training,
    wait for it (collective), so saves complete in order and a run never ends with a save incomplete.
    Until it completes the tag is not read: a run killed meanwhile resumes from the checkpoint before."""

    order = 10

    def __init__(
        self,
        save_dir: str | None,
        load_dir: str | None,
        save_interval: int,
        keep_last: int,
        save_initial: bool = False,
        async_save: bool = False,
    ):
        self.save_dir, self.load_dir = save_dir, load_dir
        self.save_interval, self.keep_last = save_interval, keep_last
        self.save_initial = save_initial  # also save before the first step (iteration 0)
        self.saved_at = -1
        self.provenance: dict | None = None  # `ckpt.provenance` record written with every save
        self.resumed_from: Path | None = None  # the checkpoint `resume` loaded
        self.async_save = async_save
        self.pending: PendingSave | None = None  # the last save, until its completion is waited for

    @classmethod
    def from_config(cls, train: TrainConfig, save_dir: str | None, load_dir: str | None) -> Checkpointer:
        """The run's checkpointer: `train.save_interval`, `train.keep_last`, `train.save_initial`,
        `train.async_save`."""
        return cls(
            save_dir, load_dir, train.save_interval, train.keep_last, train.save_initial, train.async_save
        )

    def resume(self, trainer: Trainer, start: StartPoint) -> None:
        """Load the checkpoint `start` names (`training.resume.choose_start`, chosen at the run's set-up)
        into `trainer`: the engine's model and optimizer, the loop's `TrainState` and the callbacks'
        states."""
        if start.tag is None:
            return
        client = load_checkpoint(trainer.engine, start.root, start.tag)
        st = client.get("train_state", {})
        trainer.state = TrainState.from_state_dict(st)
        for cb in trainer.callbacks:
            if cb.state_key is not None:
                cb.load_state_dict(st.get(cb.state_key, {}))
        self.saved_at = trainer.state.iteration  # a resumed state is already on disk
        self.resumed_from = Path(start.root) / start.tag

    def on_train_begin(self, trainer: Trainer, control: Control) -> None:
        if trainer.state.iteration == 0 and self.save_initial and not control.stop:
            trainer.save()  # the initial weights, as iter_0000000 (skipped if resumed from it)

    def on_step_end(self, trainer: Trainer, iteration: int, skipped: bool, control: Control) -> None:
        if self.save_interval and iteration % self.save_interval == 0:
            control.save = True

    def due(self, trainer: Trainer) -> bool:
        """Whether a save now would write anything (a save directory, and this iteration not saved)."""
        return bool(self.save_dir) and self.saved_at != trainer.state.iteration

    def on_save(self, trainer: Trainer) -> None:
        if not self.due(trainer):
            return
        try:
            for cb in trainer.callbacks:
                cb.on_before_save(trainer)
        except SkipSave as skip:
            if trainer.rank == 0:
                log.warning("%s", skip)
            return
        train_state = trainer.state.state_dict()
        for cb in trainer.callbacks:
            if cb.state_key is not None:
                train_state[cb.state_key] = cb.state_dict()
        client = {"train_state": train_state}  # the config is the tag's config.yaml (record), not a copy here
        tag = tag_for(trainer.state.iteration)
        self.wait_for_save(trainer)  # the last one completes first: `latest` and pruning stay in order
        trainer.set_phase(f"saving checkpoint {tag}")  # named if a peer times out
        self.pending = begin_save(
            trainer.engine,
            self.save_dir,
            trainer.state.iteration,
            client,
            self.keep_last,
            config_yaml=trainer.cfg.to_yaml(),
            provenance=self.provenance,
            phase=trainer.set_phase,
            background=self.async_save,
        )
        if not self.async_save:
            self.wait_for_save(trainer)
        trainer.set_phase(f"saved checkpoint {tag}")
        self.saved_at = trainer.state.iteration

    def wait_for_save(self, trainer: Trainer) -> None:
        """Collective: wait until the last save is complete (`PendingSave.wait`; raises on every rank if
        its completion failed)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            if not pending.done():
                trainer.set_phase(f"completing checkpoint {pending.path.name}")
            pending.wait()

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        if result.exit_code == 0:
            trainer.save()
        self.wait_for_save(trainer)

    def on_close(self, trainer: Trainer) -> None:
        # only after an exception is a save still pending: no collective here (peers may be gone); rank
        # 0 completes it if every share is already in, else the tag stays incomplete and is not read
        pending, self.pending = self.pending, None
        if pending is not None:
            error = pending.abandon()
            if error is not None:
                log.warning("checkpoint %s did not complete: %s", pending.path, error)


# ---------------------------------------------------------------------- validation


class Validation(Callback):
    """Validates every `eval_interval` steps and once more at the end (unless the last step did)."""

    def __init__(self, eval_interval: int) -> None:
        self.eval_interval = eval_interval

    def on_step_end(self, trainer: Trainer, iteration: int, skipped: bool, control: Control) -> None:
        if self.eval_interval and iteration % self.eval_interval == 0:
            control.evaluate = True

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        it = trainer.state.iteration
        if result.exit_code == 0 and self.eval_interval and it % self.eval_interval:
            trainer.validate(it)


# ---------------------------------------------------------------------- metrics and progress


@dataclass
class _Window:
    """Accumulates the iterations between two log lines."""

    loss_sum: float = 0.0
    finite: int = 0
    skipped_now: int = 0
    seconds: float = 0.0
    tokens: int = 0
    last_norm: float | None = None

    def add(self, record: StepRecord) -> None:
        if math.isfinite(record.loss) and not record.skipped:
            self.loss_sum += record.loss
            self.finite += 1
        self.skipped_now += int(record.skipped)
        if record.grad_norm is not None:
            self.last_norm = record.grad_norm

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.finite if self.finite else float("nan")


class MetricsLogger(Callback):
    """Log lines (rank 0), `metrics.jsonl` and TensorBoard (`MetricsWriter`), and the progress bar.

    Asks for a log line every `log_interval` steps and at the last one: the host reads the step
    values only then (and when another callback asks).
    """

    def __init__(
        self,
        writer: MetricsWriter,
        log_interval: int,
        progress_bar: bool = False,
        flops_per_token: float | None = None,
        peak_tflops: float = 989.0,
    ) -> None:
        self.writer, self.log_interval, self.progress_bar = writer, log_interval, progress_bar
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops
        self.window = _Window()
        self._bar = None
        self._redirect: contextlib.AbstractContextManager | None = None

    def on_train_begin(self, trainer: Trainer, control: Control) -> None:
        self.window = _Window()
        # on a terminal only: elsewhere the log lines already say how far the run is
        if trainer.rank == 0 and self.progress_bar and on_terminal():
            from tqdm.auto import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(
                total=trainer.budget.train_iters,
                initial=trainer.state.iteration,
                desc="train",
                unit="it",
                dynamic_ncols=True,
            )
            self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger("megatron_lev")])
            self._redirect.__enter__()  # log lines above the bar

    def on_step_end(self, trainer: Trainer, iteration: int, skipped: bool, control: Control) -> None:
        self.window.seconds += trainer.last_step_seconds
        self.window.tokens += trainer.budget.tokens_per_iter
        if self._bar is not None:
            self._bar.update(1)
        if iteration % self.log_interval == 0 or iteration == trainer.budget.train_iters:
            control.log = True

    def on_step_values(self, trainer: Trainer, record: StepRecord, control: Control) -> None:
        self.window.add(record)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record.loss:.4f}", refresh=False)

    def metrics(self, trainer: Trainer, iteration: int) -> dict[str, Any]:
        w, self.window = self.window, _Window()
        w.seconds += trainer.read_seconds  # the device work the host read waited for
        trainer.read_seconds = 0.0
        tp = throughput(w.tokens, w.seconds, self.flops_per_token, trainer.world_size, self.peak_tflops)
        return {
            "loss": w.mean_loss,
            "lr": learning_rate(iteration - 1, trainer.cfg.train, trainer.budget.train_iters),
            "grad_norm": w.last_norm if w.last_norm is not None else float("nan"),
            "skipped_in_window": w.skipped_now,
            **tp,
            **memory_stats(),
        }

    def on_log(self, trainer: Trainer, iteration: int, values: dict[str, Any]) -> None:
        self.writer.record("train", iteration, values, tokens=trainer.state.consumed_tokens)
        if trainer.rank != 0:
            return
        line = (
            f"iter {iteration}/{trainer.budget.train_iters} | loss {values['loss']:.4f} | "
            f"lr {values['lr']:.3e} | grad norm {values['grad_norm']:.3f} | "
            f"{values['tokens_per_s']:,.0f} tok/s"
        )
        if "tflops_per_device" in values:
            line += f" | {values['tflops_per_device']:.3g} TFLOP/s/dev"
        if "mfu" in values and trainer.device.type == "cuda":  # against a GPU's peak: meaningless on CPU
            line += f" | MFU {100 * values['mfu']:.2f}%"
        mem = values.get("mem_peak_gib", values.get("mem_rss_gib"))
        if mem is not None:
            line += f" | mem {mem:.1f} GiB"
        if "skipped_steps" in values:
            line += f" | skipped {values['skipped_steps']}"
        log.info(line)

    def on_validation(self, trainer: Trainer, iteration: int, metrics: dict[str, float]) -> None:
        self.writer.record("valid", iteration, metrics, tokens=trainer.state.consumed_tokens)
        if trainer.rank == 0:
            log.info(
                "validation at iteration %d: loss %.4f | perplexity %.2f",
                iteration,
                metrics["loss"],
                metrics["ppl"],
            )

    def on_close(self, trainer: Trainer) -> None:
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ---------------------------------------------------------------------- preemption


class ExitInterval(Callback):
    """`train.exit_interval`: save and stop (exit status 0, reason "exit_interval") when the iteration
    reaches a multiple of `interval` short of the run's end, so the same command, run again, trains
    the next stretch of the same run (its data order and schedule are the full run's)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def on_step_end(self, trainer: Trainer, iteration: int, skipped: bool, control: Control) -> None:
        if self.interval and iteration % self.interval == 0 and iteration < trainer.budget.train_iters:
            control.request_stop(0, "exit_interval")


class Preemption(Callback):
    """On SIGTERM/SIGUSR1 (Slurm's notice) on any rank: save at the next step boundary and exit 75.

    `watcher` may be installed by the caller before the slow start-up (a notice may come early);
    without one, this callback installs its own for the duration of `train()`.
    """

    def __init__(self, watcher: PreemptionWatcher | None = None) -> None:
        self.watcher, self._own = watcher, watcher is None

    def on_train_begin(self, trainer: Trainer, control: Control) -> None:
        if self._own:
            self.watcher = PreemptionWatcher().install()
        if self.watcher.should_stop(trainer.device):  # the notice came during start-up: nothing to save
            log.warning("preempted before the first step: exiting with status %d", PREEMPTED_EXIT_CODE)
            control.request_stop(PREEMPTED_EXIT_CODE, "preempted", save=False)

    def on_step_end(self, trainer: Trainer, iteration: int, skipped: bool, control: Control) -> None:
        if self.watcher.should_stop(trainer.device):
            control.request_stop(PREEMPTED_EXIT_CODE, "preempted")

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        if result.reason == "preempted" and result.iteration > 0 and trainer.steps_run:
            checkpointer = trainer.callback(Checkpointer)
            if checkpointer is not None:
                checkpointer.wait_for_save(trainer)  # an async_save is complete before it is called saved
            saved = checkpointer is None or checkpointer.saved_at == result.iteration
            log.warning(
                "preempted at iteration %d: %s, exiting with status %d",
                result.iteration,
                "checkpoint saved" if saved else "no checkpoint saved",
                PREEMPTED_EXIT_CODE,
            )

    def on_close(self, trainer: Trainer) -> None:
        if self._own and self.watcher is not None:
            self.watcher.uninstall()
            self.watcher = None


# ---------------------------------------------------------------------- probes


class EmbeddingProbe(Callback):
    """Logs the RMS of `module`'s output at its first forward (the input-embedding scale, LEV.md):
    over the first batch (`input_embedding_rms`) and, for an `InputEmbedding`, over the vocabulary
    as `model.input_init_rms` measures it (`input_embedding_table_rms`, `InputEmbedding.output_rms`).

    The vocabulary RMS runs the embedding again inside the hook (collective under TP, where every
    rank runs the same hook); it is skipped where ZeRO-3 partitions the parameters (`ds_id`).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.value: float | None = None
        self.table_value: float | None = None
        self._logged = False
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if self.value is None and isinstance(output, torch.Tensor):
            self.value = float(output.detach().float().pow(2).mean().sqrt())
            self._handle.remove()
            if hasattr(module, "output_rms") and not any(hasattr(p, "ds_id") for p in module.parameters()):
                self.table_value = module.output_rms()

    def metrics(self, trainer: Trainer, iteration: int) -> dict[str, Any]:
        if self._logged or self.value is None:
            return {}
        self._logged = True
        out = {"input_embedding_rms": self.value}
        if self.table_value is not None:
            out["input_embedding_table_rms"] = self.table_value
        if trainer.rank == 0:
            table = f" (over the vocabulary: {self.table_value:.4f})" if self.table_value is not None else ""
            log.info("input-embedding RMS at the first step: %.4f%s", self.value, table)
        return out

    def on_close(self, trainer: Trainer) -> None:
        self._handle.remove()
