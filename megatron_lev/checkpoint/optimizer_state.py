"""Adam's moments across a reshard: read them from a ZeRO-0/1/2 checkpoint, merge them like the
parameters they belong to, and give each rank of the target layout its shard before it saves.

`exp_avg` and `exp_avg_sq` have their parameter's shape, so they merge and split with the
parameter's own TP rules (`model.canonical`); `step` is one count for the whole run. Where
DeepSpeed 0.19 keeps them:

- ZeRO-1/2 (`[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`): per parameter group, DP rank D's
  flat fp32 partition (`base_optimizer_state`, plus the fp32 master weights) and
  `param_slice_mappings` naming each parameter's slice of it; MM = stage x TP + TP rank.
- ZeRO-0 (`mp_rank_MM_model_states.pt`, key `optimizer`): torch's AdamW state dict, parameters
  by index in the order of their group (`training.optim.param_groups`); the names are those of
  the stage's module, in `named_parameters` order, recovered from the layer files.

ZeRO-3 and CPU-offloaded optimizers are refused (`CheckpointError`), never silently dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from megatron_lev.checkpoint.ds_reader import CheckpointError, load_file
from megatron_lev.checkpoint.merge import merge_shards
from megatron_lev.checkpoint.source import SourceCheckpoint
from megatron_lev.model.pipeline import canonical_name

MOMENTS = ("exp_avg", "exp_avg_sq")
FILLER = "param_group_filler"  # training.engine.GROUP_FILLER: a zero parameter in no layer file
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
NO_DECAY_NAME_PARTS = ("norm", "bias")  # training.optim.param_groups' rule


@dataclass
class OptimizerState:
    """The merged (TP = 1, canonical names) Adam state of a checkpoint."""

    step: torch.Tensor  # AdamW's step count (a 0-d tensor)
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> {exp_avg, exp_avg_sq}
    master: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> fp32 master weight (ZeRO-1/2)


def read_optimizer_state(src: SourceCheckpoint) -> OptimizerState:
    """The source's Adam state, merged over DP partitions, pipeline stages and TP ranks."""
    if src.files.kind == "zero3":
        raise CheckpointError(
            f"{src.tag_dir}: resharding a ZeRO-3 checkpoint cannot carry Adam's moments (only "
            "ZeRO-0/1/2 are supported); pass --drop-optimizer to restart them from zero"
        )
    optim = {
        (int(m.group(1)), int(m.group(2))): src.tag_dir / p.name
        for p in src.tag_dir.iterdir()
        if (m := _OPTIM.match(p.name))
    }
    local = _zero12_local(src, optim) if optim else _zero0_local(src)
    by_name: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    steps = set()
    for (mp, name), entry in local.items():
        if name == FILLER:
            continue
        steps.add(float(entry["step"]))
        key = canonical_name(name, src.num_layers) if src.files.kind == "pipeline" else name
        by_name.setdefault(key, {}).setdefault(mp % src.files.tp, entry)  # tied copies: the first stage's
    if len(steps) != 1:
        raise CheckpointError(
            f"{src.tag_dir}: the optimizer's step differs between parameters ({sorted(steps)})"
        )
    missing = sorted(set(src.specs) - set(by_name))
    if missing:
        raise CheckpointError(
            f"{src.tag_dir}: no optimizer state for {len(missing)} parameter(s), e.g. {missing[:3]}"
        )
    out = OptimizerState(step=torch.tensor(steps.pop(), dtype=torch.float32))
    for name, ranks in by_name.items():
        spec = src.specs[name]
        if sorted(ranks) != list(range(src.files.tp)):
            raise CheckpointError(
                f"{src.tag_dir}: optimizer state of {name} for TP ranks {sorted(ranks)} only"
            )
        parts = [ranks[r] for r in range(src.files.tp)]
        out.moments[name] = {
            k: merge_shards([p[k] for p in parts], spec, check_replicas=False) for k in MOMENTS
        }
        if all("master" in p for p in parts):
            out.master[name] = merge_shards([p["master"] for p in parts], spec, check_replicas=False)
    return out


def _zero12_local(src: SourceCheckpoint, optim: dict) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(mp rank, module name): {step, exp_avg, exp_avg_sq, master}} from the ZeRO-1/2 partition files."""
    dp = 1 + max(d for d, _ in optim)
    mps = sorted({mp for _, mp in optim})
    missing = [(d, mp) for d in range(dp) for mp in mps if (d, mp) not in optim]
    if missing:
        raise CheckpointError(f"{src.tag_dir}: optimizer partition(s) (dp, mp) {missing} are missing")
    out = {}
    for mp in mps:
        shapes = load_file(src.tag_dir / f"mp_rank_{mp:02d}_model_states.pt").get("param_shapes")
        pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
        step = None
        for d in range(dp):
            path = optim[(d, mp)]
            sd = load_file(path).get("optimizer_state_dict", {})
            base, maps = sd.get("base_optimizer_state"), sd.get("param_slice_mappings")
            masters = sd.get("single_partition_of_fp32_groups") or sd.get("fp32_groups_flat_partition")
            if not isinstance(base, dict) or not maps or masters is None:
                raise CheckpointError(
                    f"{path}: not a ZeRO-1/2 optimizer partition (no base_optimizer_state / "
                    "param_slice_mappings): cannot carry Adam's moments"
                )
            for g, mapping in enumerate(maps):
                state = base["state"].get(base["param_groups"][g]["params"][0], {})
                if not all(k in state for k in MOMENTS):
                    raise CheckpointError(
                        f"{path}: parameter group {g} has no Adam moments (was it saved "
                        "before the first step?)"
                    )
                step = state["step"]
                flats = {**{k: state[k] for k in MOMENTS}, "master": masters[g]}
                for name, frag in mapping.items():
                    got = pieces.setdefault(name, {k: [] for k in flats})
                    for k, flat in flats.items():
                        got[k].append(flat.narrow(0, frag.start, frag.numel))
        sizes = {n: s for group in shapes or [] for n, s in group.items()}
        for name, got in pieces.items():
            if name not in sizes:
                raise CheckpointError(
                    f"{src.tag_dir}: mp_rank_{mp:02d}_model_states.pt has no shape for {name}"
                )
            out[(mp, name)] = {k: torch.cat(v).detach().view(sizes[name]).float() for k, v in got.items()} | {
                "step": step
            }
    return out


def _no_decay(name: str, ndim: int) -> bool:
    return ndim < 2 or any(part in name.lower() for part in NO_DECAY_NAME_PARTS)


def _zero0_local(src: SourceCheckpoint) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(mp rank, module name): {step, exp_avg, exp_avg_sq}} from the `optimizer` of each mp_rank file."""
    files = sorted(src.tag_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise CheckpointError(
            f"{src.tag_dir}: no optimizer state found (no *_optim_states.pt and no "
            "mp_rank_*_model_states.pt): cannot carry Adam's moments"
        )
    tp = src.files.tp
    layers = _layer_params(src) if src.files.kind == "pipeline" else None
    next_layer = first_of_stage = 0  # files come in (stage, tp rank) order: TP rank 0 opens each stage
    out = {}
    for path in files:
        mp = int(path.name.split("_")[2])
        state = load_file(path)
        opt = state.get("optimizer")
        if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
            raise CheckpointError(
                f"{path}: no torch optimizer state dict under 'optimizer' (an offloaded or "
                "foreign optimizer?): cannot carry Adam's moments"
            )
        shapes = [
            [tuple(opt["state"][i]["exp_avg"].shape) if i in opt["state"] else None for i in g["params"]]
            for g in opt["param_groups"]
        ]
        if layers is None:
            buffers = set(state.get("buffer_names") or [])
            names = [(n, t.ndim) for n, t in state["module"].items() if n not in buffers]
        else:
            first = next_layer if mp % tp == 0 else first_of_stage
            names, last = _stage_names(layers, first, mp % tp, shapes, opt["param_groups"], path)
            if mp % tp == 0:
                first_of_stage, next_layer = first, last + 1
        groups = _group_names(names, opt["param_groups"], path)
        for g, group in enumerate(opt["param_groups"]):
            for index, name in zip(group["params"], groups[g], strict=True):
                entry = opt["state"].get(index)
                if entry is None or not all(k in entry for k in MOMENTS):
                    raise CheckpointError(
                        f"{path}: {name} has no Adam moments (saved before the first step?)"
                    )
                out[(mp, name)] = {"step": entry["step"], **{k: entry[k].detach().float() for k in MOMENTS}}
    return out


def _group_names(names: list[tuple[str, int]], param_groups: list[dict], path) -> list[list[str]]:
    """The module names of each optimizer group, in the order `training.optim.param_groups` put them."""
    by_kind = {
        "decay": [n for n, d in names if not _no_decay(n, d)],
        "no_decay": [n for n, d in names if _no_decay(n, d)],
    }
    for members in by_kind.values():
        if not members:
            members.append(FILLER)
    out = []
    for group in param_groups:
        members = by_kind.get(group.get("name"))
        if members is None or len(members) != len(group["params"]):
            raise CheckpointError(
                f"{path}: optimizer group {group.get('name')!r} holds {len(group['params'])} "
                "parameters, not those of the model: cannot carry Adam's moments"
            )
        out.append(members)
    return out


def _layer_params(src: SourceCheckpoint) -> dict[int, dict[int, list[tuple[str, tuple[int, ...]]]]]:
    """{layer index: {TP rank: [(pipeline name, shape)]}} from the layer files (tied layers as DeepSpeed
    names them)."""
    from megatron_lev.model.pipeline import TIED_KEY

    tied = src.embedding.ties_output_head
    out = {}
    for idx, by_rank in src.files.layer_files.items():
        prefix = f"tied_modules.{TIED_KEY}." if tied and idx == 0 else f"{idx}."
        out[idx] = {
            r: [(prefix + k, tuple(v.shape)) for k, v in load_file(p).items()] for r, p in by_rank.items()
        }
    if tied:
        out[src.num_layers + 2] = out[0]  # the last stage's copy of the tied table
    return out


def _stage_names(
    layers, first: int, rank: int, shapes, param_groups, path
) -> tuple[list[tuple[str, int]], int]:
    """The parameter names of the stage starting at layer `first` whose optimizer holds `shapes`, and its last
    layer: the layer range is grown until the groups' shapes match (DeepSpeed saves no stage boundaries)."""
    tied_first = [n for n, _ in layers[0][rank] if n.startswith("tied_modules.")]
    for last in range(first, max(layers) + 1):
        params = [p for i in range(first, last + 1) for p in layers[i][rank]]
        tied = [p for p in params if p[0].startswith("tied_modules.")]
        ordered = list(dict.fromkeys(tied)) + [p for p in params if not p[0].startswith("tied_modules.")]
        names = [(n, len(s)) for n, s in ordered]
        shape_of = dict(ordered)
        try:
            groups = _group_names(names, param_groups, path)
        except CheckpointError:
            continue
        want = [[shape_of.get(n, (1,)) for n in g] for g in groups]
        if want == shapes:
            return names, last
    raise CheckpointError(
        f"{path}: cannot match the optimizer's parameters to layers from {first} on "
        f"(tied: {tied_first[:1]}): cannot carry Adam's moments"
    )


def load_into_engine(
    engine, shards: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: torch.Tensor
) -> None:
    """Give the target engine's optimizer this rank's moments (and fp32 masters where it keeps its own).

    `shards[param]` holds `exp_avg`, `exp_avg_sq` (and optionally `master`) in the parameter's shape;
    a parameter not in `shards` (the group filler) starts from zero.
    """
    opt = engine.optimizer
    flats = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(
        opt, "fp32_groups_flat_partition", None
    )
    if flats is not None:  # ZeRO-1/2 or DeepSpeed's bf16 optimizer: flat fp32 partitions per group
        if getattr(opt, "cpu_offload", False):
            raise CheckpointError(
                "the target layout offloads the optimizer to the CPU: resharding cannot carry "
                "Adam's moments there; pass --drop-optimizer to restart them from zero"
            )
        base = opt.optimizer
        for flat in flats:
            base.state[flat] = {"step": step.clone(), **{k: torch.zeros_like(flat) for k in MOMENTS}}
        for param, values in shards.items():
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:
                continue  # none of this parameter lies in this DP rank's partition
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            state = base.state[flats[mapping.param_group_index]]
            for k in MOMENTS:
                state[k].narrow(0, hp.start, hp.numel).copy_(
                    values[k].reshape(-1).narrow(0, lp.start, lp.numel)
                )
            if "master" in values:
                mapping.hp_fragment.data.copy_(values["master"].reshape(-1).narrow(0, lp.start, lp.numel))
        return
    if type(opt).__module__.startswith("deepspeed"):
        raise CheckpointError(
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
                    for k in MOMENTS
                },
            }
