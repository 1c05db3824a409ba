"""`pretrain(plan)`, the run's composition root, in three parts (LitGPT's setup -> main -> fit):

    setup(plan, held)  -> RunSetup   environment, process group, directory locks, logging, the
                                     `ParallelLayout` (`parallel.state.initialize_model_parallel`),
                                     the tokenizer and the start point: the final plan (its
                                     vocabulary, the batch a resume keeps)
    build(setup, ...)  -> RunParts   model, engine, data, callbacks, trainer: each given the layout
    fit(parts)         -> TrainResult  resume, the loop (`Trainer.train`), the start/end records

Order matters for users: everything that can be checked from the config and the
tokenizer is checked before the model or the data indices are built. The checks run
once, in `plan` (`validate_run`, then `RunPlan.with_vocab`); what they derive (padded
vocabulary, batch layout, DeepSpeed JSON) is taken from the plan, not computed again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megatron_lev.ckpt.io import check_save_dir
from megatron_lev.ckpt.provenance import run_provenance
from megatron_lev.ckpt.record import read_stored_config
from megatron_lev.config import RunConfig
from megatron_lev.data.batches import make_loader, token_batches
from megatron_lev.engine.build import build_model
from megatron_lev.engine.deepspeed_engine import DeepSpeedEngine, build_engine, disable_cpu_shm_comm
from megatron_lev.errors import ConfigError, DataError, LockedError, UserError
from megatron_lev.log import get_logger, setup_logging
from megatron_lev.model.embeddings.base import find_input_embedding
from megatron_lev.parallel import state
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.session import phase_reporter
from megatron_lev.plan import RunPlan
from megatron_lev.training.callbacks import (
    Checkpointer,
    EmbeddingProbe,
    ExitInterval,
    MetricsLogger,
    NonFiniteGuard,
    Preemption,
    SpikeWindow,
    Validation,
)
from megatron_lev.training.dynamics import ClipMetrics, TrainingDynamics
from megatron_lev.training.hooks import Callback, TrainResult, callbacks_from_specs
from megatron_lev.training.metrics import MetricsWriter
from megatron_lev.training.profiler import profiler_callback
from megatron_lev.training.rendezvous import device as current_device
from megatron_lev.training.rendezvous import init_distributed
from megatron_lev.training.resume import TOKENIZER, StartPoint, choose_start
from megatron_lev.training.schedule import training_budget
from megatron_lev.training.signals import PreemptionWatcher
from megatron_lev.training.trainer import TrainData, Trainer
from megatron_lev.utils import dist as ranks
from megatron_lev.utils.lock import DIR_LOCK_NAME, exclusive_lock

log = get_logger(__name__)


def pretrain(
    plan: RunPlan,
    allow_changes=(),
    extra_callbacks: Sequence[Callback] = (),
    init_weights: InitWeights = None,
) -> TrainResult:
    """Run (or resume) the pretraining `plan` describes on the launcher's processes; config keys in
    `allow_changes` may differ from the resumed checkpoint's (see `training.resume`).

    `plan` is the `RunPlan` the caller validated (`plan.validate_run`, as `megatron-lev train`
    does before anything heavy). The run has the default callbacks, then those `train.callbacks`
    names (built here, at start), then `extra_callbacks`. `init_weights(model, cfg, layout, vocab) ->
    record` loads `train.init_from` into a fresh run's model before the engine is built (`megatron-lev
    train` passes `convert.warm_start.warm_start`); the record goes into the checkpoints' provenance.
    """
    if not isinstance(plan, RunPlan):
        raise TypeError(
            f"pretrain() takes a RunPlan, not {type(plan).__name__}: "
            "validate first with plan.validate_run(cfg, world_size, cuda=...)"
        )
    extra = [*callbacks_from_specs(plan.cfg.train.callbacks), *extra_callbacks]
    watcher = PreemptionWatcher().install()  # before the slow start-up: Slurm's notice may come early
    try:
        with contextlib.ExitStack() as held:  # the locks of the run's directories
            run = setup(plan, held, allow_changes)
            return fit(build(run, watcher, extra, init_weights))
    finally:
        watcher.uninstall()


def lock_run_dirs(held: contextlib.ExitStack, cfg: RunConfig, save_dir: str) -> None:
    """Collective: rank 0 takes the lock (`utils.lock`) of the output directory and of the save
    directory, held until `held` closes; a second run writing into either is refused on every rank.
    Only rank 0 locks: the lock keeps other jobs out, not this job's own ranks (on a shared file
    system every job's rank 0 meets the same lock file)."""
    failure: list[tuple[str, str]] = []  # (kind, message) of rank 0's failure
    if ranks.rank() == 0:
        seen = set()
        for key, d in (("logging.output_dir", cfg.logging.output_dir), ("train.save", save_dir)):
            path = Path(d)
            try:
                path.mkdir(parents=True, exist_ok=True)
                if path.resolve() in seen:
                    continue
                seen.add(path.resolve())
                held.enter_context(exclusive_lock(path / DIR_LOCK_NAME, f"{key}={d}", "megatron-lev train"))
            except LockedError as exc:
                failure.append(("locked", str(exc)))
            except OSError as exc:
                unwritable = exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
                what = "is not writable" if unwritable else "cannot be created or locked"
                why = exc.strerror or exc
                failure.append(
                    ("other", f"{key}={d}: the directory {what} ({why}); choose a writable directory")
                )
            if failure:
                break
    failure = ranks.gather_lists(failure)  # every rank learns rank 0's outcome
    if failure:
        kind, message = failure[0]
        raise (LockedError if kind == "locked" else UserError)(message)


# (model, run config, layout, tokenizer vocabulary) -> the record of what was loaded
InitWeights = Callable[[nn.Module, RunConfig, ParallelLayout, int], dict] | None


@dataclass(frozen=True)
class RunSetup:
    """What `setup` produced: the final plan (the tokenizer's vocabulary, the batch a resume keeps),
    this rank's layout, where the run writes, the tokenizer, and where the run starts."""

    plan: RunPlan
    layout: ParallelLayout
    rank: int
    device: torch.device
    out: Path
    save_dir: str
    tokenizer: Any = None  # set once the process group is up (`setup`)
    start: _Start | None = None
    load_dir: str = ""
    allow_changes: tuple[str, ...] = ()  # config keys a resume may change (`--allow-change`)

    @property
    def world(self) -> int:
        return self.plan.world_size


def setup(plan: RunPlan, held: contextlib.ExitStack, allow_changes=()) -> RunSetup:
    """Environment, process group, directory locks (held until `held` closes), logging, the parallel
    layout (collective: every rank creates the process groups), then the tokenizer and the start
    point, which settle the plan: its vocabulary and, on a resume with another DP size, the batch.
    The plan `setup` returns is final; `build` only builds."""
    from megatron_lev.resources import checkout_root

    root = checkout_root()
    if root is not None:  # a checkout builds its kernels beside it; an install uses torch's cache
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".torch_extensions"))
    disable_cpu_shm_comm()
    cfg = plan.cfg
    env = init_distributed(
        cfg.parallel.distributed_backend,
        collective_timeout_s=cfg.parallel.collective_timeout_s,
        heartbeat_timeout_s=cfg.parallel.heartbeat_timeout_s,
    )
    out = Path(cfg.logging.output_dir)
    save_dir = plan.save_dir
    lock_run_dirs(held, cfg, save_dir)  # one run at a time writes metrics, logs and checkpoints here
    setup_logging(log_dir=out / "logs" if cfg.logging.log_all_ranks else None)
    if plan.world_size != env.world_size:  # validated by the caller: nothing is checked twice
        raise ConfigError(
            f"the run was validated for {plan.world_size} processes but the launcher started {env.world_size}"
        )
    p, dev = cfg.parallel, current_device()
    layout = state.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    log.info(
        "world %d = TP %d x PP %d x DP %d (%s launch, %s)",
        env.world_size,
        layout.tp,
        layout.pp,
        layout.dp,
        env.source,
        dev,
    )
    from megatron_lev.data.tokenizers import build_tokenizer

    run = RunSetup(plan, layout, env.rank, dev, out, save_dir)
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_path)
    # model.vocab_size against the tokenizer, the padding, the variant's rules at that vocabulary
    plan, start, load_dir = resolve_start(run, tokenizer, allow_changes)
    return dataclasses.replace(
        run,
        plan=plan,
        tokenizer=tokenizer,
        start=start,
        load_dir=load_dir,
        allow_changes=tuple(allow_changes),
    )


@dataclass
class RunParts:
    """What `build` produced and `fit` runs."""

    trainer: Trainer
    checkpointer: Checkpointer
    resume: StartPoint
    writer: MetricsWriter
    n_params: int


def build(
    run: RunSetup,
    watcher: PreemptionWatcher,
    extra_callbacks: Sequence[Callback] = (),
    init_weights: InitWeights = None,
) -> RunParts:
    """Model (warm-started where asked), engine, data, callbacks, trainer, from `setup`'s final plan."""
    from megatron_lev.model.flops import flops_per_token, parameter_count
    from megatron_lev.parallel.random import manual_seed

    plan, start, load_dir, tokenizer = run.plan, run.start, run.load_dir, run.tokenizer
    cfg = plan.cfg
    manual_seed(cfg.train.seed)  # the default streams; the model makes its own TP stream (`model.rng`)
    model = build_model(plan.model_spec, run.layout)
    if cfg.train.init_from:
        warm_start(model, plan, run, start, init_weights)
    n_params = parameter_count(cfg.model, plan.padded_vocab)["total"]
    budget = training_budget(cfg.train, plan.global_batch, cfg.model.seq_length, n_params)
    log_model(plan, n_params, budget)
    embedding = find_input_embedding(model)
    probe = EmbeddingProbe(embedding) if embedding is not None else None
    phase = phase_reporter()  # the session's: what this rank is doing, for a peer's diagnosis
    engine = build_engine(plan, model, run.layout, phase)
    data = build_data(run, plan, budget, start, tokenizer, run.allow_changes, n_params)
    writer = MetricsWriter(run.out, enabled=run.rank == 0, tensorboard=cfg.logging.tensorboard)
    checkpointer = Checkpointer.from_config(cfg.train, run.save_dir, load_dir)
    checkpointer.provenance = start.provenance
    flops = flops_per_token(cfg.model, plan.padded_vocab)
    callbacks = default_callbacks(
        cfg, writer, checkpointer, flops, watcher, vocab_size=plan.true_vocab, layout=run.layout
    )
    callbacks += [cb for cb in (probe, wandb_callback(cfg, run.rank)) if cb is not None]
    callbacks += extra_callbacks
    trainer = Trainer(
        cfg,
        engine,
        budget,
        data,
        callbacks,
        world_size=run.world,
        device=run.device,
        save_dir=run.save_dir,
        load_dir=load_dir,
        phase=phase,
    )
    return RunParts(trainer, checkpointer, start.resume, writer, n_params)


@dataclass(frozen=True)
class _Start:
    """Where the run starts: the start point, and the data and tokenizer record checkpoints carry."""

    resume: StartPoint
    provenance: dict

    @property
    def tokenizer_fingerprint(self) -> dict | None:
        """The run's tokenizer fingerprint, from its record (None when the file could not be read:
        the data checks then make their own, and refuse it in their words)."""
        record = self.provenance.get("tokenizer")
        return {k: v for k, v in record.items() if k != "path"} if record else None


def resolve_start(run: RunSetup, tokenizer, allow_changes=()) -> tuple[RunPlan, _Start, str]:
    """The plan with the tokenizer's vocabulary and (on a resume with another DP size) the checkpoint's
    batch, and which checkpoint to start from (verified, config compared): before the model."""
    plan = run.plan.with_vocab(tokenizer.vocab_size)
    cfg = plan.cfg
    load_dir = cfg.train.load or run.save_dir
    # what the checkpoints record they were trained on (shard sets, blend, tokenizer); a resume compares it
    provenance = run_provenance(cfg.data, tokenizer)
    resume = choose_start(
        load_dir, run.save_dir, cfg, allow_changes, DeepSpeedEngine.owned_files(), provenance
    )
    check_save_dir(run.save_dir)
    if resume.global_batch is not None and resume.global_batch != plan.global_batch:
        plan = plan.with_global_batch(resume.global_batch)  # another DP size: keep the checkpoint's batch
        cfg = plan.cfg
    batch_line = resume.batch_line(cfg, run.world)
    if batch_line and run.rank == 0:
        log.warning("%s", batch_line)
    if run.rank == 0:
        log.info("resolved config saved to %s", cfg.save(run.out))
    return plan, _Start(resume, provenance), load_dir


def warm_start(
    model: nn.Module, plan: RunPlan, run: RunSetup, start: _Start, init_weights: InitWeights
) -> None:
    """`train.init_from` into a fresh run's model, before the engine copies the weights; a run that
    resumes keeps its checkpoint's weights (a requeued warm-started run continues, never restarts)."""
    source = plan.cfg.train.init_from
    if start.resume.tag is not None:
        if run.rank == 0:
            log.info(
                "resuming from %s: train.init_from=%s applies to a fresh start only",
                start.resume.root,
                source,
            )
        return
    if init_weights is None:
        raise UserError(
            f"train.init_from={source} needs a loader: pretrain(..., init_weights=convert.warm_start."
            "warm_start), as `megatron-lev train` passes"
        )
    record = init_weights(model, plan.cfg, run.layout, plan.true_vocab)
    start.provenance["init_from"] = record
    if run.rank == 0:
        log.info("warm start: %s", describe_init(record))


def describe_init(record: dict) -> str:
    """One line: what a warm start's weights came from."""
    return f"weights from the {record['kind']} {record['path']}; optimizer, iteration and schedule fresh"


def log_model(plan: RunPlan, n_params: int, budget) -> None:
    cfg = plan.cfg
    log.info(
        "%s: %s parameters, vocabulary %d (padded), %d iterations x %d sequences x %d tokens (%s tokens; %s)",
        cfg.model.name,
        f"{n_params:,}",
        plan.padded_vocab,
        budget.train_iters,
        plan.global_batch,
        cfg.model.seq_length,
        f"{budget.train_tokens:,}",
        budget.source,
    )


def checkpoint_samples(resume: StartPoint, seq_length: int, n_params: int) -> int:
    """Training samples the checkpoint's own run built its data order for (its config's length x its
    global batch), 0 when unknown: a resume with a shorter `train.train_iters` (a cool-down branch)
    builds at least as many, so it draws the batches that run would have drawn, not a reshuffle."""
    from megatron_lev.config import TrainConfig
    from megatron_lev.config.load import from_dict

    if resume.root is None or resume.saved is None:
        return 0
    stored = read_stored_config(resume.root / resume.tag)
    try:
        train = from_dict(TrainConfig, (stored or {}).get("train"), "train")
        return training_budget(train, resume.saved.global_batch, seq_length, n_params).train_iters * (
            resume.saved.global_batch
        )
    except ConfigError:  # an older or odd stored config: this run's own length decides
        return 0


def build_data(
    run: RunSetup, plan: RunPlan, budget, start: _Start, tokenizer, allow_changes=(), n_params: int = 0
) -> TrainData:
    """The training and validation micro-batches of this rank's data-parallel slice (`run.layout`)."""
    from megatron_lev.data.boundaries import DocumentLayout
    from megatron_lev.data.gpt_dataset import build_train_valid_test_datasets

    cfg, global_batch, resume = plan.cfg, plan.global_batch, start.resume
    n_valid = cfg.train.eval_iters * global_batch if cfg.train.eval_interval else 0
    n_train = budget.train_iters * global_batch
    if resume.saved is not None and resume.saved.global_batch != global_batch:  # a changed batch (allowed)
        done = min(resume.iteration, budget.train_iters)
        n_train = max(n_train, done * resume.saved.global_batch + (budget.train_iters - done) * global_batch)
    if resume.saved is not None and resume.saved.global_batch == global_batch:
        n_train = max(n_train, checkpoint_samples(resume, cfg.model.seq_length, n_params))
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        cfg.data,
        cfg.model.seq_length,
        (n_train, n_valid, 0),
        cfg.data.cache_dir,
        allow_tokenizer_change=TOKENIZER in allow_changes,  # the escape the resume check names
        fingerprint=start.tokenizer_fingerprint,  # the one made from the tokenizer built at setup
    )
    if train_ds is None:
        raise ConfigError(f"data.split={cfg.data.split!r} leaves no training documents")
    documents = DocumentLayout.from_config(cfg.data, tokenizer.eod)  # None unless a document option is on
    micro, dp_rank, dp, dev = plan.micro_batch, run.layout.dp_rank, run.layout.dp, run.device

    def train_batches(consumed: int):
        loader = make_loader(train_ds, consumed, micro, dp_rank, dp, cfg.data.num_workers)
        yield from token_batches(loader, dev, plan.true_vocab, documents)
        raise DataError(  # not a bare StopIteration from inside a step
            f"the training data ran out at sample {loader.batch_sampler.consumed_samples} of "
            f"{len(train_ds)} built for {budget.train_iters} iterations x {global_batch} sequences; "
            "the checkpoint's position lies beyond what this run's budget builds: check train.train_iters "
            "and train.global_batch_size against the checkpoint's"
        )

    def valid_batches():
        loader = make_loader(valid_ds, 0, micro, dp_rank, dp, 0)
        return token_batches(loader, dev, plan.true_vocab, documents)

    return TrainData(train_batches, valid_batches if valid_ds is not None else None, global_batch)


def fit(parts: RunParts) -> TrainResult:
    """Resume (or start), train, and record the run's start and end."""
    trainer, writer = parts.trainer, parts.writer
    try:
        parts.checkpointer.resume(trainer, parts.resume)
        start = {
            "event": "start",
            "parameters": parts.n_params,
            "train_iters": trainer.budget.train_iters,
            "world_size": trainer.world_size,
        }
        writer.record("event", trainer.state.iteration, start)
        result = trainer.train()
        end = {
            "event": "end",
            "reason": result.reason,
            "exit_code": result.exit_code,
            "skipped_steps": result.skipped_steps,
        }
        writer.record("event", result.iteration, end)
        return result
    finally:
        writer.close()


def default_callbacks(
    cfg: RunConfig,
    writer: MetricsWriter,
    checkpointer: Checkpointer | None,
    flops_per_token: float | None = None,
    watcher: PreemptionWatcher | None = None,
    vocab_size: int | None = None,
    layout: ParallelLayout = SINGLE,
) -> list[Callback]:
    """The callbacks every run has: guard, checkpoints (`checkpointer`; None: no checkpoints),
    validation, metrics and progress, preemption, and (`logging.train_dynamics`) the training
    dynamics, whose table sample is drawn from the tokenizer's `vocab_size` ids (default: the
    embedding's padded vocabulary), measured on the pipeline stage of `layout` that computes the table."""
    t, lg = cfg.train, cfg.logging
    callbacks = [
        NonFiniteGuard(t.max_consecutive_skips, t.max_update_ratio),
        SpikeWindow() if t.spike_window else None,
        checkpointer,
        Validation(t.eval_interval),
        MetricsLogger(writer, lg.log_interval, lg.progress_bar, flops_per_token, lg.peak_tflops),
        Preemption(watcher),
        ExitInterval(t.exit_interval),
        ClipMetrics(),
    ]
    if lg.train_dynamics:
        callbacks.append(TrainingDynamics(lg.log_interval, lg.dynamics_sample_ids, vocab_size, layout))
    callbacks.append(profiler_callback(cfg, layout.rank))
    return [cb for cb in callbacks if cb is not None]


def wandb_callback(cfg: RunConfig, rank: int) -> Callback | None:
    """The Weights & Biases mirror when `logging.wandb_project` is set (rank 0 only)."""
    if not cfg.logging.wandb_project or rank != 0:
        return None
    from megatron_lev.training.wandb_logger import WandbLogger

    return WandbLogger(cfg)
