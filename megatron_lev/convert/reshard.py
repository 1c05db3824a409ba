"""Reshard a training checkpoint for another layout (TP, PP or DP changed), offline, on CPU.

    reshard("runs/x/checkpoints", "runs/x/tp1", tp=1, pp=1, dp=8)

The source is merged into canonical full tensors (`source.iter_canonical`); then the
target layout is started as `TP x PP x DP` gloo processes on this machine (`parallel.local_workers`;
a failed one is a one-line error naming its rank), each builds
its part of the model with `build_model`, copies in its TP shard of every tensor
(vocabulary rows re-padded for the new TP size), wraps it in DeepSpeed exactly as the
trainer does (`engine.deepspeed_engine.build_engine`, `plan.ds_config.build_ds_config`) and
saves through `ckpt.io.save_checkpoint`, so the result is a native
checkpoint the trainer resumes from (model weights, iteration, client state such as
the data position, hence the learning-rate schedule, and the source's `provenance.json`: the
data and tokenizer the weights were trained on, which a resume compares).

Adam's state is carried (`optimizer_state`): each parameter's `exp_avg` / `exp_avg_sq` is
merged from the source's ZeRO-0/1/2 files with the parameter's TP rules, split for the
target and set into the target engine's optimizer (ZeRO-0: the torch AdamW; ZeRO-1/2 and the
bf16 optimizer: their flat fp32 partitions, with the fp32 master weights) before it saves,
together with the step count. Sources or targets it cannot serve (ZeRO-3, CPU offload) are
refused unless `optimizer=False` (`--drop-optimizer`), which restarts the moments from zero.

Validation (on by default): a fresh engine in the target layout loads the written
checkpoint through the trainer's `load_checkpoint` and its forward loss on a fixed batch
must equal that of the merged source model at TP = 1 (same weights, same padding).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from megatron_lev.ckpt.layout import read_latest
from megatron_lev.ckpt.provenance import read_provenance, warn_unrecorded
from megatron_lev.config import RunConfig, from_dict
from megatron_lev.convert.llama_names import pad_rows
from megatron_lev.convert.merge import split_full
from megatron_lev.convert.optimizer_state import OptimizerState, read_optimizer_state
from megatron_lev.convert.source import SourceCheckpoint, iter_canonical, open_checkpoint
from megatron_lev.engine.checkpoint_files import CheckpointError, load_file
from megatron_lev.model.canonical import canonical_state_dict_spec
from megatron_lev.model.embeddings.id_order import BUFFER as ID_RANK
from megatron_lev.model.vocab import padded_vocab_size
from megatron_lev.parallel.layout import ParallelLayout
from megatron_lev.plan import model_plan, validate_config
from megatron_lev.plan.spec import ModelSpec

_DS_KEYS = {
    "module",
    "optimizer",
    "lr_scheduler",
    "csr_tensor_module_names",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "data_sampler",
    "random_ltd",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
}  # what DeepSpeed writes itself; the rest is the trainer's client state


def target_config(cfg: RunConfig, tp: int, pp: int, dp: int, global_batch: int | None = None) -> RunConfig:
    """The source run config with the new layout, validated for `TP x PP x DP` processes.

    `global_batch` (the source's, in sequences) is written as `train.global_batch_size`, so a run
    resuming the result keeps it whatever its DP size (an unset key would mean micro-batch x the new
    DP). Whether the new layout can make it is the resuming run's to check: it may change the
    micro-batch."""
    data = cfg.to_dict()
    data["parallel"]["tensor_model_parallel_size"] = tp
    data["parallel"]["pipeline_model_parallel_size"] = pp
    data["train"]["global_batch_size"] = None  # checked below, not against the new DP
    new = validate_config(
        from_dict(RunConfig, data, prefix=""), world_size=tp * pp * dp
    )  # the variant's rules at the new TP too
    if global_batch is not None:
        new.train.global_batch_size = global_batch
    elif cfg.train.global_batch_size is not None:
        new.train.global_batch_size = cfg.train.global_batch_size
    return new


def engine_config(cfg: RunConfig, world_size: int) -> RunConfig:
    """`cfg` with a batch layout `world_size` processes can run (the saved weights do not depend on
    it): its own, else micro-batch x DP."""
    from megatron_lev.errors import ConfigError
    from megatron_lev.plan.ds_config import batch_layout

    try:
        batch_layout(cfg, world_size)
        return cfg
    except ConfigError:
        data = cfg.to_dict()
        data["train"]["global_batch_size"] = None
        return from_dict(RunConfig, data, prefix="")


def adapt_rows(name: str, tensor: torch.Tensor, want: tuple[int, ...], vocab: int) -> torch.Tensor:
    """Re-pad a vocabulary table's rows for another TP size (rows >= `vocab` are padding); a token
    order (`id_rank`) is re-padded as a permutation (`adapt_ranks`)."""
    if tuple(tensor.shape) == want:
        return tensor
    if name.rsplit(".", 1)[-1] == ID_RANK:
        return adapt_ranks(name, tensor, want[0], vocab)
    if tensor.shape[1:] == torch.Size(want[1:]) and tensor.shape[0] >= vocab and want[0] >= vocab:
        return pad_rows(tensor[:vocab], want[0])
    raise CheckpointError(
        f"{name}: shape {tuple(tensor.shape)} cannot be resharded to {want}; the vocabulary "
        "padding changed something other than padding rows (e.g. LEV's digit base): keep "
        "model.make_vocab_size_divisible_by x TP the same"
    )


def adapt_ranks(name: str, rank: torch.Tensor, padded: int, vocab: int) -> torch.Tensor:
    """A token order (`rank[i]`: whose digits token i takes) for another padded vocabulary: the real
    ids `< vocab` keep their ranks (so the model computes the same rows for them) and the padding
    ids take the remaining ranks of `range(padded)` in increasing order. Refused when a real id's
    rank does not fit the new size."""
    real = rank[:vocab]
    if len(real) and int(real.max()) >= padded:
        raise CheckpointError(
            f"{name}: the token order gives a real token rank {int(real.max())}, which does not fit the "
            f"new padded vocabulary of {padded}: keep model.make_vocab_size_divisible_by x TP the same"
        )
    free = torch.ones(padded, dtype=torch.bool)
    free[real] = False
    return torch.cat([real, free.nonzero().flatten().to(rank.dtype)])


def _client_state(src: SourceCheckpoint) -> tuple[dict, int]:
    """The trainer's client state and the iteration, from the source's first mp_rank file."""
    files = sorted(src.tag_dir.glob("mp_rank_*_model_states.pt")) or sorted(
        src.tag_dir.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")
    )
    if not files:
        raise CheckpointError(f"{src.tag_dir}: no mp_rank model-states file with the engine state")
    state = load_file(files[0])
    client = {k: v for k, v in state.items() if k not in _DS_KEYS}
    return client, int(state.get("global_steps", 0))


def reshard_worker(
    src_path: str,
    tag: str | None,
    config: str | None,
    out_root: str,
    cfg_yaml: str,
    check_ids: torch.Tensor | None,
    optim: OptimizerState | None = None,
    provenance: dict | None = None,
) -> float | None:
    """Collective on the target layout: build, fill, save (with the source's `provenance` record), and
    (optionally) reload and measure the loss."""
    import yaml

    from megatron_lev.ckpt.io import load_checkpoint, save_checkpoint, tag_for
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine, disable_cpu_shm_comm
    from megatron_lev.parallel import state

    disable_cpu_shm_comm()
    saved_cfg = from_dict(RunConfig, yaml.safe_load(cfg_yaml), prefix="")  # what config.yaml records
    world = torch.distributed.get_world_size()
    cfg = engine_config(saved_cfg, world)
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    src = open_checkpoint(src_path, tag, config)
    plan = model_plan(cfg, world, src.vocab_size)
    layout = state.initialize_model_parallel(tp, pp)
    torch.manual_seed(cfg.train.seed)
    model = build_model(plan.model_spec, layout)
    local = fill_from_source(model, src, cfg, layout)
    engine = build_engine(plan, model, layout)
    if optim is not None:
        engine.load_optimizer_moments(optimizer_shards(local, optim, src, cfg, layout), optim.step)
    client, iteration = _client_state(src)
    engine.global_steps = iteration
    save_checkpoint(
        engine,
        out_root,
        iteration,
        client,
        keep_last=10**6,
        config_yaml=saved_cfg.to_yaml(),
        provenance=provenance,
    )
    if check_ids is None:
        return None
    torch.manual_seed(cfg.train.seed)
    fresh = build_engine(plan, build_model(plan.model_spec, layout), layout)
    load_checkpoint(fresh, out_root, tag_for(iteration))
    return fresh.loss(check_ids[:, :-1], check_ids[:, 1:])


def fill_from_source(
    model: torch.nn.Module, src: SourceCheckpoint, cfg: RunConfig, layout: ParallelLayout
) -> dict[str, list[torch.nn.Parameter]]:
    """Copy `layout`'s TP shard of every merged source tensor into the (plain or pipeline) model;
    returns the model's parameters by canonical name (a tied table's copies under one name)."""
    return fill_from_tensors(model, iter_canonical(src, progress=False), cfg, layout, src.vocab_size)


def fill_from_tensors(
    model: torch.nn.Module,
    tensors,
    cfg: RunConfig,
    layout: ParallelLayout,
    vocab: int,
    what: str = "the source",
) -> dict[str, list[torch.nn.Parameter]]:
    """Copy `layout`'s TP shard of each full `(canonical name, tensor)` of `tensors` into the (plain or
    pipeline) model, the vocabulary's padding rows adapted to the model's (`adapt_rows`); every
    parameter must be given. Returns the model's parameters by canonical name. `what` names the
    source in errors."""
    tp, rank = layout.tp, layout.tp_rank
    padded = padded_vocab_size(vocab, cfg.model, tp)
    specs = canonical_state_dict_spec(cfg.model, padded, layout, vocab)
    if cfg.parallel.pipeline_model_parallel_size > 1:
        from megatron_lev.engine.pipeline import stage_modules

        parts = stage_modules(model)  # each stage names its parameters canonically
    else:
        parts = [model]
    local: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for name, param in part.state_dict(keep_vars=True).items():
            local.setdefault(name, []).append(param)
    filled = set()
    for name, full in tensors:
        if name not in local:
            continue
        full = adapt_rows(name, full, specs[name].shape, vocab)
        if tuple(full.shape) != tuple(specs[name].shape):
            raise CheckpointError(
                f"{what}: {name} is {tuple(full.shape)} there but {tuple(specs[name].shape)} in the "
                "target model: the two are not the same model"
            )
        shard = split_full(full, specs[name], tp)[rank]
        with torch.no_grad():
            for param in local[name]:
                param.copy_(shard.to(param.dtype))
        filled.add(name)
    for part in parts:  # a token order copied in is the checkpoint's: a `frequency` model may now run
        for module in part.modules():
            if getattr(module, "order_pending", False):
                module.order_pending = False
    missing = sorted(set(local) - filled)
    if missing:
        raise CheckpointError(f"the target model has parameters {what} lacks: {missing[:3]}")
    return local


def optimizer_shards(
    local: dict[str, list[torch.nn.Parameter]],
    optim: OptimizerState,
    src: SourceCheckpoint,
    cfg: RunConfig,
    layout: ParallelLayout,
) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
    """`layout`'s TP shard of every parameter's moments (and fp32 master weight), by target parameter."""
    tp, rank = layout.tp, layout.tp_rank
    padded = padded_vocab_size(src.vocab_size, cfg.model, tp)
    specs = canonical_state_dict_spec(cfg.model, padded, layout, src.vocab_size)
    out = {}
    for name, params in local.items():
        if specs[name].buffer:  # no moments (LEV's token order)
            continue
        full = dict(optim.moments[name])
        if name in optim.master:
            full["master"] = optim.master[name]
        shard = {
            k: split_full(adapt_rows(name, t, specs[name].shape, src.vocab_size), specs[name], tp)[rank]
            for k, t in full.items()
        }
        out.update({p: shard for p in params if isinstance(p, torch.nn.Parameter)})
    return out


def reference_loss(src: SourceCheckpoint, cfg: RunConfig, ids: torch.Tensor) -> float:
    """The merged source model at TP = 1 with the target's vocabulary padding: the loss to reproduce."""
    from megatron_lev.engine.build import build_model
    from megatron_lev.parallel.layout import SINGLE

    padded = padded_vocab_size(src.vocab_size, cfg.model, cfg.parallel.tensor_model_parallel_size)
    specs = canonical_state_dict_spec(cfg.model, padded, true_vocab_size=src.vocab_size)
    with torch.device("meta"):
        model = build_model(ModelSpec(cfg.model, padded, src.vocab_size, seed=cfg.train.seed), SINGLE)
    state = {
        n: adapt_rows(n, t.float() if t.is_floating_point() else t, specs[n].shape, src.vocab_size)
        for n, t in iter_canonical(src, False)
    }
    model.load_state_dict(state, strict=True, assign=True)
    with torch.no_grad():
        return float(model.eval()(ids[:, :-1], ids[:, 1:]).mean())


def reshard(
    checkpoint: str | os.PathLike,
    out_root: str | os.PathLike,
    tp: int,
    pp: int,
    dp: int = 1,
    tag: str | None = None,
    config: str | os.PathLike | None = None,
    validate: bool = True,
    timeout: float = 3600.0,
    optimizer: bool = True,
) -> tuple[Path, float | None, float | None]:
    """Write the resharded checkpoint under `out_root`; returns (tag dir, reference loss, resharded loss).

    `optimizer`: carry Adam's moments and step (refused where they cannot be carried); False
    restarts them from zero.

    The result is written to a hidden `.<out>.partial` directory and renamed to `out_root` only
    after it reloads with the source's loss, so a failed or interrupted reshard leaves no
    checkpoint the trainer could resume from.
    """
    from megatron_lev.convert.hf_export import ExportError, check_out_dir
    from megatron_lev.errors import ConfigError
    from megatron_lev.parallel.local_workers import run_workers

    for flag, value in (("--tp", tp), ("--pp", pp), ("--dp", dp)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    from megatron_lev.ckpt.record import saved_batch

    src = open_checkpoint(checkpoint, tag, config)
    source_batch = saved_batch(src.tag_dir, src.cfg.to_dict())
    try:
        cfg = target_config(src.cfg, tp, pp, dp, source_batch.global_batch if source_batch else None)
    except ConfigError as exc:
        raise ConfigError(f"--tp {tp} --pp {pp} --dp {dp} does not fit this model: {exc}") from None
    out = Path(out_root)
    try:
        check_out_dir(out, overwrite=False, protect=[Path(checkpoint), src.tag_dir])
    except ExportError as exc:
        raise CheckpointError(
            str(exc).replace("pass --overwrite to replace it or choose", "choose")
        ) from None
    ids = None
    ref = None
    if validate:
        s = cfg.model.seq_length
        ids = torch.randint(
            0, src.vocab_size, (cfg.train.micro_batch_size, s + 1), generator=torch.Generator().manual_seed(0)
        )
        ref = reference_loss(src, cfg, ids)
    optim = (
        read_optimizer_state(src) if optimizer else None
    )  # after the weights: a damaged file is named first
    provenance = read_provenance(src.tag_dir)  # carried as it is: the weights were trained on the same data
    work = out.with_name(f".{out.name}.partial")
    shutil.rmtree(work, ignore_errors=True)  # a dead earlier run's
    world = tp * pp * dp
    try:
        losses = run_workers(  # a failed worker is a one-line WorkerError naming its rank
            reshard_worker,
            world_size=world,
            timeout=timeout,
            args=(
                str(checkpoint),
                tag,
                str(config) if config else None,
                str(work),
                cfg.to_yaml(),
                ids,
                optim,
                provenance,
            ),
        )
        got = losses[0]
        if validate and abs(got - ref) > 1e-4 * max(1.0, abs(ref)):
            raise CheckpointError(
                f"resharded checkpoint loads with loss {got:.6f} but the source gives {ref:.6f}; "
                "nothing was written"
            )
        latest, problem = read_latest(work)
        if latest is None:  # written by the save just above: a bug if it is not there
            raise CheckpointError(f"the resharded checkpoint in {work} has no readable latest ({problem})")
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if provenance is None:  # said after the work, so that a failure stays the only line
        warn_unrecorded(src.tag_dir, "the resharded checkpoint records none either")
    return out / latest, ref, got


__all__ = [
    "reshard",
    "target_config",
    "adapt_rows",
    "adapt_ranks",
    "fill_from_source",
    "fill_from_tensors",
    "reference_loss",
]
