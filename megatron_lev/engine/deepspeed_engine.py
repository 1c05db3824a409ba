"""The DeepSpeed engine behind `Engine` (`engine/base.py`), the interface the trainer and converters use.

`build_engine(plan, model, layout)` runs `deepspeed.initialize` over the model
with our AdamW (`optim.GuardedAdamW`, so no DeepSpeed op is compiled at start)
and the run's DeepSpeed JSON (`plan.ds_config`). The plain model (PP = 1) runs under
ZeRO 0-3 (optionally CPU offload); a `PipelineModule` (PP > 1) under ZeRO 0/1. Either
way the caller sees the same methods:

    train_batch(batches) -> StepOutput   one optimizer step over `gas` micro-batches
    eval_batch(batches)  -> tensor ()    mean loss of `gas` micro-batches, averaged over ranks
    save(root, tag, client_state)        DeepSpeed's files for one checkpoint tag
    load(root, tag) -> client_state

`batches` yields the data side's micro-batches (`(input_ids, labels)` or a `MicroBatch`);
the engine turns them into what its DeepSpeed engine expects.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_lev.config import RunConfig
from megatron_lev.engine.base import StepMeasurement
from megatron_lev.engine.checkpoint_files import ENGINE_HELPER_FILES
from megatron_lev.engine.clipping import ClipRecord, GradClipper
from megatron_lev.engine.compile import apply_compile
from megatron_lev.engine.loss import micro_batch_loss
from megatron_lev.engine.mpu import TensorParallelMPU
from megatron_lev.engine.optimizer_files import MOMENTS as _MOMENTS
from megatron_lev.engine.pipeline import STAGE_PREFIX, pipeline_batches
from megatron_lev.engine.recompute import apply_activation_checkpointing
from megatron_lev.errors import CheckpointDataError, ConfigError
from megatron_lev.optim import GuardedAdamW, all_finite, param_groups, squared_norm
from megatron_lev.parallel.layout import ParallelLayout
from megatron_lev.parallel.session import no_phase
from megatron_lev.plan import RunPlan

GROUP_FILLER = "param_group_filler"


def disable_cpu_shm_comm() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op on CPU (gloo suffices).

    `MEGATRON_LEV_CPU_SHM=1` keeps the op (faster CPU all-reduce, ~40 s g++ build the first time).
    """
    if torch.cuda.is_available() or os.environ.get("MEGATRON_LEV_CPU_SHM") == "1":
        return
    import deepspeed.ops as ds_ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        ds_ops.__compatible_ops__[builder.NAME] = False


def uses_zero_optimizer_per_group(ds_config: dict) -> bool:
    """Whether DeepSpeed wraps the optimizer in its ZeRO-1/2 optimizer, which works group by group.

    bf16 with fp32 gradient accumulation under ZeRO-1 (the pipeline template) gets DeepSpeed's
    BF16 optimizer instead, which reduces one norm over all groups and steps once.
    """
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    bf16 = (ds_config.get("bf16") or {}).get("enabled", False)
    fp32_accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype") == "fp32"
    return stage in (1, 2) and not (stage == 1 and bf16 and fp32_accum)


def same_groups_on_every_stage(model: nn.Module, groups: list[dict]) -> list[dict]:
    """Give an empty group a one-element zero parameter (no gradient, saved in no layer file).

    DeepSpeed's ZeRO-1/2 optimizer all-reduces one gradient norm per parameter group over
    the model-parallel group, and the guard agrees once per group: under a pipeline, a stage
    without, say, any 1-D parameter would issue fewer collectives than the others and every
    rank would wait forever at the first step. With the filler every stage has both groups.
    """
    reference = next(model.parameters())
    fillers = 0
    for group in groups:
        if not group["params"]:
            filler = nn.Parameter(torch.zeros(1, dtype=reference.dtype, device=reference.device))
            # one name per empty group (several with train.param_groups): param_group_filler, _1, ...
            model.register_parameter(GROUP_FILLER + (f"_{fillers}" if fillers else ""), filler)
            fillers += 1
            group["params"].append(filler)
    return [g for g in groups if g["params"]]


@dataclass
class StepOutput:
    """One optimizer step; everything stays on the device (the trainer reads it when it logs)."""

    loss: torch.Tensor  # () this rank's mean loss over the step's micro-batches (pipeline: DP mean)
    skipped: bool  # the update was held back (non-finite gradients or loss; the guard agreed on it)
    scaler_overflow: bool  # DeepSpeed's fp16 loss scaler held it back (gradient overflow)
    grad_norm: torch.Tensor | None  # () global gradient norm, the one clipping used; None if unknown
    clip: torch.Tensor | None = None  # the clip groups' norms then their factors (`ClipRecord`)
    spiked: bool = False  # held back as a loss or gradient-norm spike (`engine.spikes`), not non-finite


def block_names(num_layers: int) -> list[str]:
    """The model's blocks by canonical name, in order (the same list on every rank)."""
    return ["embedding", *(f"layers.{i}" for i in range(num_layers)), "final_norm", "output_head"]


def block_of(name: str) -> str:
    """The block of canonical parameter `name`: `layers.3.mlp.w1.weight` -> `layers.3`."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


class DeepSpeedEngine:
    """A DeepSpeed engine (plain or pipeline) as an `Engine`; see the module doc."""

    def __init__(
        self,
        ds_engine,
        optimizer: GuardedAdamW,
        cfg: RunConfig,
        *,
        pipeline: bool,
        gas: int,
        groups: Sequence[tuple[str, Sequence[nn.Parameter]]] = (),
        layout: ParallelLayout,
    ):
        self.ds_engine, self.optimizer, self.cfg, self.layout = ds_engine, optimizer, cfg, layout
        self.pipeline, self.gas = pipeline, gas
        self.device = next(iter(ds_engine.module.parameters())).device
        self.groups = [(name, list(params)) for name, params in groups]  # the optimizer's, by name
        self._probe = None  # engine.step_probe.StepProbe, built at the first measured step
        self.phase: Callable[[str], None] = no_phase  # set by build_engine: what a save reports
        self.clipper: GradClipper | None = None  # set by build_engine: every step's clipping
        self.last_spike: torch.Tensor | None = None  # the window the last spike was judged against

    @staticmethod
    def owned_files() -> tuple[str, ...]:
        """Files DeepSpeed writes into a save directory beside the tags (a fresh start may overwrite them)."""
        return ENGINE_HELPER_FILES

    @property
    def module(self) -> nn.Module:
        """The model DeepSpeed wraps (`GPTModel`, or this rank's `PipelineModule` stages)."""
        return self.ds_engine.module

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)  # train.param_groups

    def weights_finite(self) -> torch.Tensor:
        """A device bool `()`: every weight this rank's optimizer updates (ZeRO: its partition) is finite."""
        return all_finite(p for g in self.optimizer.param_groups for p in g["params"])

    def weights_squared_norm(self) -> torch.Tensor:
        """A device float32 `()`: the sum of squares of the weights this rank's optimizer updates."""
        return squared_norm(p for g in self.optimizer.param_groups for p in g["params"])

    def train(self) -> None:
        self.ds_engine.train()

    def eval(self) -> None:
        self.ds_engine.eval()

    # ------------------------------------------------------------------ steps

    def train_batch(self, batches: Iterator) -> StepOutput:
        """One optimizer step over `gas` micro-batches from `batches`.

        The only host reads are the guard's finiteness flag (one per `optimizer.step()` call)
        and, for LEV and the other per-unique-id embeddings, `torch.unique`'s output size.
        """
        if self.pipeline:
            self.optimizer.begin_iteration()
            loss = self.ds_engine.train_batch(data_iter=pipeline_batches(batches))  # DP mean, every stage
            loss = torch.as_tensor(loss).detach().float().reshape(()).to(self.device)
        else:
            total = torch.zeros((), device=self.device)
            for micro in range(self.gas):
                loss_mb = micro_batch_loss(self.ds_engine, next(batches))  # (B, S) per-token -> () mean
                total += loss_mb.detach()
                self.ds_engine.backward(loss_mb)
                if micro == self.gas - 1:  # a non-finite loss skips the update: decided on the device
                    self.optimizer.begin_iteration(force_skip=~torch.isfinite(total))
                    if self.clipper is not None:
                        self.clipper.pending_loss = total / self.gas  # for the spike check
                self.ds_engine.step()
            loss = total / self.gas
        skipped = self.optimizer.iteration_skipped  # the same on every rank (the guard agrees)
        spiked = skipped and self.optimizer.spiked
        record = self.clip_record()
        norm = clip = None
        if record is not None:
            norm, clip = record.full.reshape(()), torch.cat([record.norms, record.factors])
        spikes = None if self.clipper is None else self.clipper.spikes
        if spikes is not None and norm is not None:
            if spiked:
                self.last_spike = spikes.last  # the window it was judged against, read when logged
            elif not skipped:
                spikes.record(norm, None if self.pipeline else loss)
        return StepOutput(loss, skipped, skipped and self._loss_scaler_overflow(), norm, clip, spiked)

    def clip_record(self) -> ClipRecord | None:
        """The last optimizer step's clipping (`engine.clipping`): norms and factors by clip group."""
        return None if self.clipper is None else self.clipper.record

    # ------------------------------------------------------------------ step measurements

    def canonical_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by canonical name (a pipeline's stages name theirs canonically;
        a tied table counted once)."""
        modules = [self.module]
        if self.pipeline:
            from megatron_lev.engine.pipeline import stage_modules

            modules = stage_modules(self.module)
        out: dict[str, nn.Parameter] = {}
        for module in modules:
            for name, param in module.named_parameters():
                out.setdefault(name, param)
        return out

    def step_device(self) -> torch.device:
        """Where the clipper's and the probe's all-reduced sums live (the current CUDA device under NCCL)."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return self.device

    def measure_next_step(self, prefixes: Sequence[str]) -> None:
        """See `Engine.measure_next_step` (`engine.step_probe`: the full tensors' norms in any layout)."""
        if self._probe is None:
            from megatron_lev.engine.step_probe import StepProbe

            names = {id(p): n for n, p in self.canonical_parameters().items()}
            fp16 = self.cfg.train.precision == "fp16"
            self._probe = StepProbe(
                self.ds_engine, self.groups, names, self.step_device(), fp16, layout=self.layout
            )
        self._probe.arm(prefixes)

    def step_measurement(self) -> StepMeasurement | None:
        return None if self._probe is None else self._probe.result

    def block_weight_squares(self) -> tuple[list[str], torch.Tensor]:
        """Collective (every rank): the sum of squares of the weights of each block of the model
        (`embedding`, `layers.<i>`, `final_norm`, `output_head`, by canonical name), over what every
        rank holds of them (ZeRO fragments and partitions, pipeline stages, TP shards; a copy held by
        several ranks counts once per holder, alike before and after a step). For a diagnosis, not the
        step: one pass over this rank's weights and one all-reduce; the sums stay on the device
        (no host read) as `(block names, float64 tensor)`."""
        from megatron_lev.engine.step_probe import holding, local_weight

        blocks = block_names(self.cfg.model.num_layers)
        index = {b: i for i, b in enumerate(blocks)}
        sums = torch.zeros(len(blocks), dtype=torch.float64, device=self.device)
        names = {id(p): n for n, p in self.canonical_parameters().items()}
        for _, params in self.groups:
            for p in params:
                name = names.get(id(p))
                block = None if name is None else index.get(block_of(name))
                weight = None if block is None else local_weight(p, holding(p))
                if weight is not None and weight.numel():
                    sums[block] += weight.detach().double().square().sum().to(sums.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        return blocks, sums

    def full_parameters(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """See `Engine.full_parameters`: DeepSpeed's `GatheredParameters` where ZeRO-3 partitions them."""
        params = [p for p in module.parameters() if hasattr(p, "ds_id")]
        if not params:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def _loss_scaler_overflow(self) -> bool:
        """Whether DeepSpeed's fp16 loss scaler held this step back (gradient overflow: it lowers the
        scale and never calls our optimizer). Its optimizers (FP16, ZeRO) flag that as `.overflow`."""
        if self.cfg.train.precision != "fp16" or getattr(self.optimizer, "calls", 0):
            return False
        return bool(getattr(getattr(self.ds_engine, "optimizer", None), "overflow", False))

    @torch.no_grad()
    def eval_batch(self, batches: Iterator) -> torch.Tensor:
        """The mean loss `()` of `gas` micro-batches, averaged over data-parallel ranks (no update).

        Raises StopIteration when `batches` runs out first.
        """
        if self.pipeline:
            loss = self.ds_engine.eval_batch(data_iter=pipeline_batches(batches))
            return torch.as_tensor(loss, dtype=torch.float32, device=self.device).reshape(())
        total = torch.zeros((), device=self.device)
        for _ in range(self.gas):
            total += micro_batch_loss(self.ds_engine, next(batches)).float()
        total /= self.gas
        if dist.is_initialized() and dist.get_world_size() > 1:  # TP ranks hold equal copies: plain mean
            dist.all_reduce(total)
            total /= dist.get_world_size()
        return total

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean per-token loss of one batch `(B, S)` without a training step (every rank gets it)."""
        self.eval()
        try:
            if self.pipeline:
                return float(self.ds_engine.eval_batch(data_iter=iter([((input_ids,), labels)])))
            with torch.no_grad():
                return float(self.ds_engine(input_ids, labels).float().mean())
        finally:
            self.train()

    # ------------------------------------------------------------------ checkpoints

    def save(self, root: str | os.PathLike, tag: str, client_state: dict[str, Any]) -> None:
        """Collective: this rank's DeepSpeed files of checkpoint `root/tag` (no `latest` file).

        DeepSpeed's checkpoint engine commits once a rank's files are written, before the save's last
        barrier: the rank's phase then says so (`self.phase`), so a peer's timeout in
        that barrier can tell a rank still writing (slow) from one waiting."""
        ckpt_engine = getattr(self.ds_engine, "checkpoint_engine", None)
        commit = getattr(ckpt_engine, "commit", None)
        shadowed = ckpt_engine is not None and "commit" in vars(ckpt_engine)
        if commit is not None:

            def committed(*args, **kwargs):
                self.phase(
                    f"saving checkpoint {tag}: this rank's files written, waiting for the other ranks'"
                )
                return commit(*args, **kwargs)

            ckpt_engine.commit = committed
        try:
            self.ds_engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
        finally:
            if commit is not None:
                if shadowed:
                    ckpt_engine.commit = commit
                else:
                    del ckpt_engine.commit

    def load(self, root: str | os.PathLike, tag: str) -> dict[str, Any]:
        """Collective: model and optimizer from `root/tag`; returns the client state.

        DeepSpeed's loader unpickles its files (`weights_only=False`): load only checkpoints from a
        trusted source.
        """
        try:
            path, client_state = self.ds_engine.load_checkpoint(
                str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        except Exception as exc:  # noqa: BLE001 - a file DeepSpeed cannot read is a checkpoint problem
            raise CheckpointDataError(
                f"DeepSpeed could not load checkpoint {Path(root) / tag} ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); move it away to "
                "resume from an older one"
            ) from exc
        if path is None:
            raise CheckpointDataError(
                f"DeepSpeed could not load checkpoint {Path(root) / tag}; move it away to resume from an "
                "older one"
            )
        if self.clipper is not None:
            self.clipper.disable_engine_clipping()  # a checkpoint of a run DeepSpeed clipped restores it
        return client_state or {}

    def load_optimizer_moments(
        self, shards: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: torch.Tensor
    ) -> None:
        """Give the target engine's optimizer this rank's moments (and fp32 masters where it keeps its own).

        `shards[param]` holds `exp_avg`, `exp_avg_sq` (and optionally `master`) in the parameter's shape;
        a parameter not in `shards` (the group filler) starts from zero.
        """
        opt = self.ds_engine.optimizer
        flats = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(
            opt, "fp32_groups_flat_partition", None
        )
        if flats is not None:  # ZeRO-1/2 or DeepSpeed's bf16 optimizer: flat fp32 partitions per group
            if getattr(opt, "cpu_offload", False):
                raise CheckpointDataError(
                    "the target layout offloads the optimizer to the CPU: resharding cannot carry "
                    "Adam's moments there; pass --drop-optimizer to restart them from zero"
                )
            base = opt.optimizer
            for flat in flats:
                base.state[flat] = {"step": step.clone(), **{k: torch.zeros_like(flat) for k in _MOMENTS}}
            for param, values in shards.items():
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is None:
                    continue  # none of this parameter lies in this DP rank's partition
                hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                state = base.state[flats[mapping.param_group_index]]
                for k in _MOMENTS:
                    state[k].narrow(0, hp.start, hp.numel).copy_(
                        values[k].reshape(-1).narrow(0, lp.start, lp.numel)
                    )
                if "master" in values:
                    mapping.hp_fragment.data.copy_(values["master"].reshape(-1).narrow(0, lp.start, lp.numel))
            return
        if type(opt).__module__.startswith("deepspeed"):
            raise CheckpointDataError(
                f"the target layout's optimizer ({type(opt).__name__}) is not one whose moments "
                "resharding can set (ZeRO-0/1/2); pass --drop-optimizer to restart them from zero"
            )
        for group in opt.param_groups:  # ZeRO-0: the torch optimizer steps the model's parameters themselves
            for param in group["params"]:
                values = shards.get(param)
                opt.state[param] = {
                    "step": step.clone(),
                    **{
                        k: (values[k].to(param.dtype).clone() if values else torch.zeros_like(param))
                        for k in _MOMENTS
                    },
                }

    @property
    def global_steps(self) -> int:
        return self.ds_engine.global_steps

    @global_steps.setter
    def global_steps(self, value: int) -> None:
        self.ds_engine.global_steps = value


class _UntestedOptimizerNotice(logging.Filter):
    """Drops DeepSpeed's "You are using ZeRO with an untested optimizer" warning: the optimizer is
    our `GuardedAdamW` (torch's AdamW plus a finiteness guard), chosen on purpose and allowed with
    `zero_allow_untested_optimizer` (plan.ds_config), so the warning would only appear in every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


def _quiet_deepspeed_logger(deepspeed) -> None:
    logger = deepspeed.utils.logging.logger
    if not any(isinstance(f, _UntestedOptimizerNotice) for f in logger.filters):
        logger.addFilter(_UntestedOptimizerNotice())


def build_engine(
    plan: RunPlan, model: nn.Module, layout: ParallelLayout, phase: Callable[[str], None] = no_phase
) -> DeepSpeedEngine:
    """`DeepSpeedEngine` over `model`, from the `RunPlan` (its DeepSpeed JSON and batch layout, derived
    once by `plan.validate_run`) and this rank's `layout` (`parallel.state`; DeepSpeed's `mpu`
    and the clipper read it).

    The optimizer is the `GuardedAdamW` DeepSpeed wraps (`engine.optimizer`). Activation
    checkpointing (`model.activation_checkpointing`) is applied to the model here, from outside
    (`engine.recompute`); a pipeline has it from `build_pipeline`.
    """
    import deepspeed

    _quiet_deepspeed_logger(deepspeed)
    cfg = plan.cfg
    check_layout(plan, layout)
    pipeline = cfg.parallel.pipeline_model_parallel_size > 1
    model = apply_compile(apply_activation_checkpointing(model, cfg.model), cfg.model)
    groups = _optimizer_groups(plan, model, pipeline)
    # the groups' own parameters, by name: ZeRO replaces a group's "params" with its flat partition
    named_groups = [(g.get("name", str(i)), list(g["params"])) for i, g in enumerate(groups)]
    t = cfg.train
    optimizer = GuardedAdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    mpu = TensorParallelMPU(layout) if not pipeline and layout.tp > 1 else None
    # DeepSpeed keeps the last engine's mpu in a module global (`deepspeed.utils.groups.mpu`) and sets
    # it only when given one: an engine without TP built after a TP engine in the same process (tests,
    # tools) would ask the stale layout. Each engine's own, or none.
    from deepspeed.utils import groups as ds_groups

    ds_groups.mpu = mpu
    # a copy: DeepSpeed may fill in the dict it is given, and the plan's stays as validated
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=copy.deepcopy(plan.ds_config),
        mpu=mpu,
        dist_init_required=False,
    )
    engine = DeepSpeedEngine(
        ds_engine, optimizer, cfg, pipeline=pipeline, gas=plan.gas, groups=named_groups, layout=layout
    )
    engine.phase = phase  # what this rank's saves report (`parallel.session.phase_reporter`)
    engine.clipper = GradClipper(
        ds_engine,
        optimizer,
        [(g.get("clip", 0), params) for g, (_, params) in zip(groups, named_groups, strict=True)],
        list(plan.clip_rules),
        t.clip_grad,
        engine.step_device(),
        fp16=t.precision == "fp16",
        layout=layout,
    )
    if t.spike_window:
        from megatron_lev.engine.spikes import SpikeDetector

        engine.clipper.spikes = SpikeDetector(t.spike_window, t.spike_zscore, engine.step_device())
    return engine


def check_layout(plan: RunPlan, layout: ParallelLayout) -> None:
    """Refuse a layout other than the plan's (TP, PP and the world size it was validated for)."""
    p = plan.cfg.parallel
    want = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, plan.world_size)
    if (layout.tp, layout.pp, layout.world_size) != want:
        raise ConfigError(
            f"the layout has TP={layout.tp}, PP={layout.pp} over {layout.world_size} processes but the plan "
            f"asks for parallel.tensor_model_parallel_size={want[0]}, "
            f"parallel.pipeline_model_parallel_size={want[1]} over {want[2]}"
        )


def _optimizer_groups(plan: RunPlan, model: nn.Module, pipeline: bool) -> list[dict]:
    """The optimizer's parameter groups (`optim.param_groups`, by the plan's rules), the same on every
    stage of a pipeline under a per-group ZeRO optimizer; empty groups left out."""
    canonical = (lambda name: STAGE_PREFIX.sub("", name, count=1)) if pipeline else str
    groups = param_groups(
        model,
        plan.cfg.train.weight_decay,
        keep_empty=pipeline,
        rules=list(plan.param_rules),
        canonical=canonical,
        clip_rules=list(plan.clip_rules),
    )
    if pipeline and uses_zero_optimizer_per_group(plan.ds_config):
        groups = same_groups_on_every_stage(model, groups)
    return [g for g in groups if g["params"]]
