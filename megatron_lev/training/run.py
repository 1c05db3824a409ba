"""`pretrain(plan)`: join the process group, build tokenizer/model/engine/data, train.

Order matters for users: everything that can be checked from the config and the
tokenizer is checked before the model or the data indices are built. The checks run
once, in `engine.plan` (`validate_run`, then `RunPlan.with_vocab`); what they derive (padded
vocabulary, batch layout, DeepSpeed JSON) is taken from the plan, not computed again.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from megatron_lev.ckpt.io import check_save_dir
from megatron_lev.ckpt.provenance import run_provenance
from megatron_lev.config import RunConfig
from megatron_lev.data.batches import make_loader, token_batches
from megatron_lev.engine.build import build_model
from megatron_lev.engine.deepspeed_engine import DeepSpeedEngine, build_engine, disable_cpu_shm_comm
from megatron_lev.engine.plan import RunPlan, validate_run
from megatron_lev.errors import ConfigError, DataError, LockedError, UserError
from megatron_lev.log import get_logger, setup_logging
from megatron_lev.parallel import state
from megatron_lev.training.callbacks import (
    Checkpointer,
    EmbeddingProbe,
    MetricsLogger,
    NonFiniteGuard,
    Preemption,
    Validation,
)
from megatron_lev.training.dynamics import ClipMetrics, TrainingDynamics
from megatron_lev.training.hooks import Callback, TrainResult, callbacks_from_specs
from megatron_lev.training.launch import device as current_device
from megatron_lev.training.launch import init_distributed
from megatron_lev.training.metrics import MetricsWriter
from megatron_lev.training.resume import TOKENIZER, plan_resume
from megatron_lev.training.schedule import training_budget
from megatron_lev.training.signals import PreemptionWatcher
from megatron_lev.training.trainer import TrainData, Trainer
from megatron_lev.utils import dist as ranks
from megatron_lev.utils.lock import DIR_LOCK_NAME, exclusive_lock

log = get_logger(__name__)


def find_input_embedding(model: nn.Module) -> nn.Module | None:
    from megatron_lev.model.embeddings.base import InputEmbedding

    return next((m for m in model.modules() if isinstance(m, InputEmbedding)), None)


def pretrain(
    run: RunPlan | RunConfig, allow_changes=(), extra_callbacks: Sequence[Callback] = ()
) -> TrainResult:
    """Run (or resume) the pretraining described by `run` on the launcher's processes; config keys
    in `allow_changes` may differ from the resumed checkpoint's (see `training.resume`).

    `run` is the `RunPlan` the caller validated (`engine.plan.validate_run`, as `megatron-lev train`
    does before anything heavy), or a bare `RunConfig`, validated here once the process group is up.
    The run has the default callbacks, then those `train.callbacks` names (built here, at start),
    then `extra_callbacks`.
    """
    cfg = run.cfg if isinstance(run, RunPlan) else run
    extra = [*callbacks_from_specs(cfg.train.callbacks), *extra_callbacks]
    watcher = PreemptionWatcher().install()  # before the slow start-up: Slurm's notice may come early
    try:
        with contextlib.ExitStack() as held:  # the locks of the run's directories
            return _pretrain(run, watcher, held, allow_changes, extra)
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


def _pretrain(
    run: RunPlan | RunConfig,
    watcher: PreemptionWatcher,
    held: contextlib.ExitStack,
    allow_changes=(),
    extra_callbacks: Sequence[Callback] = (),
) -> TrainResult:
    from megatron_lev.data.documents import DocumentLayout
    from megatron_lev.data.gpt_dataset import build_train_valid_test_datasets
    from megatron_lev.data.tokenizers import build_tokenizer
    from megatron_lev.model.flops import flops_per_token, parameter_count
    from megatron_lev.parallel.random import model_parallel_manual_seed
    from megatron_lev.resources import checkout_root

    root = checkout_root()
    if root is not None:  # a checkout builds its kernels beside it; an install uses torch's cache
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root / ".torch_extensions"))
    disable_cpu_shm_comm()
    cfg = run.cfg if isinstance(run, RunPlan) else run
    env = init_distributed(
        cfg.parallel.distributed_backend,
        collective_timeout_s=cfg.parallel.collective_timeout_s,
        heartbeat_timeout_s=cfg.parallel.heartbeat_timeout_s,
    )
    out = Path(cfg.logging.output_dir)
    save_dir = cfg.train.save or str(out / "checkpoints")
    lock_run_dirs(held, cfg, save_dir)  # one run at a time writes metrics, logs and checkpoints here
    setup_logging(log_dir=out / "logs" if cfg.logging.log_all_ranks else None)
    world, rank, dev = env.world_size, env.rank, current_device()
    if isinstance(run, RunPlan):  # validated by the caller: nothing is checked twice
        plan = run
        if plan.world_size != world:
            raise ConfigError(
                f"the run was validated for {plan.world_size} processes but the launcher started {world}"
            )
    else:
        plan = validate_run(cfg, world, cuda=torch.cuda.is_available())
    cfg = plan.cfg  # with what the plan derived into it (e.g. model.lev.id_order_counts): recorded below
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    state.initialize_model_parallel(tp, pp)
    dp, dp_rank = state.get_data_parallel_world_size(), state.get_data_parallel_rank()
    log.info("world %d = TP %d x PP %d x DP %d (%s launch, %s)", world, tp, pp, dp, env.source, dev)

    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_path)
    # model.vocab_size against the tokenizer, the padding, the variant's rules at that vocabulary
    plan = plan.with_vocab(tokenizer.vocab_size)
    vocab, true_vocab = plan.padded_vocab, plan.true_vocab
    # which checkpoint (verified, config compared), or a fresh start that loses nothing: before the model
    load_dir = cfg.train.load or save_dir
    # what the checkpoints record they were trained on (shard sets, blend, tokenizer); a resume compares it
    provenance = run_provenance(cfg.data, tokenizer)
    resume = plan_resume(load_dir, save_dir, cfg, allow_changes, DeepSpeedEngine.owned_files(), provenance)
    check_save_dir(save_dir)
    if resume.global_batch is not None and resume.global_batch != plan.global_batch:
        plan = plan.with_global_batch(resume.global_batch)  # another DP size: keep the checkpoint's batch
        cfg = plan.cfg
    batch_line = resume.batch_line(cfg, world)
    if batch_line and rank == 0:
        log.warning("%s", batch_line)
    if rank == 0:
        log.info("resolved config saved to %s", cfg.save(out))

    model_parallel_manual_seed(cfg.train.seed)
    model = build_model(plan)
    n_params = parameter_count(cfg.model, vocab)["total"]
    micro, global_batch = plan.micro_batch, plan.global_batch
    budget = training_budget(cfg.train, global_batch, cfg.model.seq_length, n_params)
    log.info(
        "%s: %s parameters, vocabulary %d (padded), %d iterations x %d sequences x %d tokens (%s tokens; %s)",
        cfg.model.name,
        f"{n_params:,}",
        vocab,
        budget.train_iters,
        global_batch,
        cfg.model.seq_length,
        f"{budget.train_tokens:,}",
        budget.source,
    )
    embedding = find_input_embedding(model)
    probe = EmbeddingProbe(embedding) if embedding is not None else None

    engine = build_engine(plan, model)

    n_valid = cfg.train.eval_iters * global_batch if cfg.train.eval_interval else 0
    n_train = budget.train_iters * global_batch
    if resume.saved is not None and resume.saved.global_batch != global_batch:  # a changed batch (allowed)
        done = min(resume.iteration, budget.train_iters)
        n_train = max(n_train, done * resume.saved.global_batch + (budget.train_iters - done) * global_batch)
    train_ds, valid_ds, _ = build_train_valid_test_datasets(
        cfg.data,
        cfg.model.seq_length,
        (n_train, n_valid, 0),
        cfg.data.cache_dir,
        allow_tokenizer_change=TOKENIZER in allow_changes,  # the escape the resume check names
    )
    if train_ds is None:
        raise ConfigError(f"data.split={cfg.data.split!r} leaves no training documents")

    documents = DocumentLayout.from_config(cfg.data, tokenizer.eod)  # None unless a document option is on

    def train_batches(consumed: int):
        loader = make_loader(train_ds, consumed, micro, dp_rank, dp, cfg.data.num_workers)
        yield from token_batches(loader, dev, true_vocab, documents)
        raise DataError(  # not a bare StopIteration from inside a step
            f"the training data ran out at sample {loader.batch_sampler.consumed_samples} of "
            f"{len(train_ds)} built for {budget.train_iters} iterations x {global_batch} sequences; "
            "the checkpoint's position lies beyond what this run's budget builds: check train.train_iters "
            "and train.global_batch_size against the checkpoint's"
        )

    def valid_batches():
        return token_batches(make_loader(valid_ds, 0, micro, dp_rank, dp, 0), dev, true_vocab, documents)

    writer = MetricsWriter(out, enabled=rank == 0, tensorboard=cfg.logging.tensorboard)
    checkpointer = Checkpointer.from_config(cfg.train, save_dir, load_dir)
    checkpointer.provenance = provenance
    callbacks = default_callbacks(
        cfg, writer, checkpointer, flops_per_token(cfg.model, vocab), watcher, vocab_size=true_vocab
    )
    callbacks += [cb for cb in (probe, wandb_callback(cfg, rank)) if cb is not None]
    callbacks += extra_callbacks
    data = TrainData(train_batches, valid_batches if valid_ds is not None else None, global_batch)
    trainer = Trainer(
        cfg,
        engine,
        budget,
        data,
        callbacks,
        world_size=world,
        device=dev,
        save_dir=save_dir,
        load_dir=load_dir,
    )
    try:
        checkpointer.resume(trainer, resume)
        writer.record(
            "event",
            trainer.state.iteration,
            {
                "event": "start",
                "parameters": n_params,
                "train_iters": budget.train_iters,
                "world_size": world,
            },
        )
        result = trainer.train()
        writer.record(
            "event",
            result.iteration,
            {
                "event": "end",
                "reason": result.reason,
                "exit_code": result.exit_code,
                "skipped_steps": result.skipped_steps,
            },
        )
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
) -> list[Callback]:
    """The callbacks every run has: guard, checkpoints (`checkpointer`; None: no checkpoints),
    validation, metrics and progress, preemption, and (`logging.train_dynamics`) the training
    dynamics, whose table sample is drawn from the tokenizer's `vocab_size` ids (default: the
    embedding's padded vocabulary)."""
    t, lg = cfg.train, cfg.logging
    callbacks = [
        NonFiniteGuard(t.max_consecutive_skips, t.max_update_ratio),
        checkpointer,
        Validation(t.eval_interval),
        MetricsLogger(writer, lg.log_interval, lg.progress_bar, flops_per_token, lg.peak_tflops),
        Preemption(watcher),
        ClipMetrics(),
    ]
    if lg.train_dynamics:
        callbacks.append(TrainingDynamics(lg.log_interval, lg.dynamics_sample_ids, vocab_size))
    return [cb for cb in callbacks if cb is not None]


def wandb_callback(cfg: RunConfig, rank: int) -> Callback | None:
    """The Weights & Biases mirror when `logging.wandb_project` is set (rank 0 only)."""
    if not cfg.logging.wandb_project or rank != 0:
        return None
    from megatron_lev.training.wandb_logger import WandbLogger

    return WandbLogger(cfg)
