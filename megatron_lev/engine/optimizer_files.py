"""Adam's state as DeepSpeed 0.19 stores it, read per (MP rank, canonical parameter name).

Where DeepSpeed keeps it:

- ZeRO-1/2 (`[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`): per parameter group, DP rank D's
  flat fp32 partition (`base_optimizer_state`, plus the fp32 master weights) and
  `param_slice_mappings` naming each parameter's slice of it; MM = stage x TP + TP rank.
- ZeRO-0 (`mp_rank_MM_model_states.pt`, key `optimizer`): torch's AdamW state dict, parameters
  by index in the order of their group (`training.optim.param_groups`); the names are those of
  the stage's module, in `named_parameters` order, recovered from the layer files.

A pipeline module names a parameter `<layer>.<canonical name>` (a tied stage's:
`tied_modules.<key>.<canonical name>`), since each stage registers its parameters under its
`GPTModel` prefix (`model.stages`); the layer files hold the canonical names themselves.
`checkpoint.optimizer_state` merges what this returns over TP ranks. ZeRO-3 is refused
(`CheckpointError`), never silently dropped.

`src` is a `checkpoint.source.SourceCheckpoint` (its files, config, specs, layer reader).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_lev.engine.checkpoint_files import OPTIM_FILE, CheckpointError, load_file
from megatron_lev.engine.pipeline import STAGE_PREFIX
from megatron_lev.optim import CLIP_SEPARATOR, GROUP_NAMES, group_name
from megatron_lev.plan import clip_group_rules, param_group_rules

MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's moments: what resharding carries of its state
FILLER = (
    "param_group_filler"  # engine.deepspeed_engine.GROUP_FILLER (+ _1, ...): zero parameters in no layer file
)


def local_states(src) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(mp rank, canonical name): {step, exp_avg, exp_avg_sq[, master]}} of a ZeRO-0/1/2 checkpoint;
    the group filler is left out, tied copies appear once per stage that holds them."""
    if src.files.kind == "zero3":
        raise CheckpointError(
            f"{src.tag_dir}: resharding a ZeRO-3 checkpoint cannot carry Adam's moments (only "
            "ZeRO-0/1/2 are supported); pass --drop-optimizer to restart them from zero"
        )
    optim = {
        (int(m.group(1)), int(m.group(2))): src.tag_dir / p.name
        for p in src.tag_dir.iterdir()
        if (m := OPTIM_FILE.match(p.name))
    }
    local = _zero12_local(src, optim) if optim else _zero0_local(src)
    out = {}
    for (mp, name), entry in local.items():
        if name.startswith(FILLER):  # param_group_filler, param_group_filler_1, ...
            continue
        # ZeRO-1/2 files name a parameter as the pipeline module does; ZeRO-0's come canonical already
        key = STAGE_PREFIX.sub("", name, count=1) if src.files.kind == "pipeline" else name
        out.setdefault((mp, key), entry)
    return out


def _zero12_local(src, optim: dict) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
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


def _zero0_local(src) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """{(mp rank, module name): {step, exp_avg, exp_avg_sq}} from the `optimizer` of each mp_rank file."""
    files = sorted(src.tag_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise CheckpointError(
            f"{src.tag_dir}: no optimizer state found (no *_optim_states.pt and no "
            "mp_rank_*_model_states.pt): cannot carry Adam's moments"
        )
    tp = src.files.tp
    layers = _layer_params(src) if src.files.kind == "pipeline" else None
    tied = set(src.shared_layers())
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
            names, last = _stage_names(
                layers, tied, first, mp % tp, shapes, opt["param_groups"], path, _rules(src.cfg)
            )
            if mp % tp == 0:
                first_of_stage, next_layer = first, last + 1
        groups = _group_names(names, opt["param_groups"], path, _rules(src.cfg))
        for g, group in enumerate(opt["param_groups"]):
            for index, name in zip(group["params"], groups[g], strict=True):
                entry = opt["state"].get(index)
                if entry is None or not all(k in entry for k in MOMENTS):
                    raise CheckpointError(
                        f"{path}: {name} has no Adam moments (saved before the first step?)"
                    )
                out[(mp, name)] = {"step": entry["step"], **{k: entry[k].detach().float() for k in MOMENTS}}
    return out


def _rules(cfg) -> tuple[Sequence, Sequence]:
    """The checkpoint's optimizer group rules: (`param_group_rules(cfg)`, `clip_group_rules(cfg)`)."""
    return param_group_rules(cfg), clip_group_rules(cfg)


def _group_names(
    names: list[tuple[str, int]], param_groups: list[dict], path, rules: tuple[Sequence, Sequence] = ((), ())
) -> list[list[str]]:
    """The module names of each optimizer group, in the order `optim.param_groups` put them (`rules`:
    the checkpoint's `_rules`)."""
    by_group: dict[str, list[str]] = {}
    for n, d in names:
        by_group.setdefault(group_name(n, d, *rules), []).append(n)
    for name in GROUP_NAMES:  # a stage without one of the default groups holds a filler
        by_group.setdefault(name, [FILLER])
    out = []
    for group in param_groups:
        members = by_group.get(group.get("name"))
        if members is None and (
            group.get("name", "").startswith("rule") or CLIP_SEPARATOR in group.get("name", "")
        ):
            members = [FILLER]  # a rule's or clip group's group this stage has no parameter of
        if members is None or len(members) != len(group["params"]):
            raise CheckpointError(
                f"{path}: optimizer group {group.get('name')!r} holds {len(group['params'])} "
                "parameters, not those of the model: cannot carry Adam's moments"
            )
        out.append(members)
    return out


def _layer_params(src) -> dict[int, dict[int, list[tuple[str, tuple[int, ...]]]]]:
    """{layer index: {TP rank: [(canonical name, shape)]}} of the parameters in the layer files (their
    persistent buffers, such as LEV's token order, left out); a second copy of a tied stage (no file
    of its own) is the first copy's."""
    buffers = {name for name, spec in src.specs.items() if spec.buffer}
    out = {}
    for idx, by_rank in src.files.layer_files.items():
        out[idx] = {
            r: [(k, tuple(v.shape)) for k, v in src.layer_state(p).items() if k not in buffers]
            for r, p in by_rank.items()
        }
    for idx, first in src.shared_layers().items():
        out[idx] = out[first]
    return out


def _stage_names(
    layers, tied: set[int], first: int, rank: int, shapes, param_groups, path, rules: tuple = ((), ())
) -> tuple[list[tuple[str, int]], int]:
    """The parameter names of the stage starting at layer `first` whose optimizer holds `shapes`, and its last
    layer: the layer range is grown until the groups' shapes match (DeepSpeed saves no stage boundaries).

    The pipeline module registers its tied stages (the layers in `tied`) before the others, once each."""
    for last in range(first, max(layers) + 1):
        span = range(first, last + 1)
        shared = [p for i in span if i in tied for p in layers[i][rank]]
        ordered = list(dict.fromkeys(shared)) + [p for i in span if i not in tied for p in layers[i][rank]]
        names = [(n, len(s)) for n, s in ordered]
        shape_of = dict(ordered)
        try:
            groups = _group_names(names, param_groups, path, rules)
        except CheckpointError:
            continue
        want = [[shape_of.get(n, (1,)) for n in g] for g in groups]
        if want == shapes:
            return names, last
    raise CheckpointError(
        f"{path}: cannot match the optimizer's parameters to layers from {first} on "
        f"(tied layers: {sorted(tied)}): cannot carry Adam's moments"
    )
