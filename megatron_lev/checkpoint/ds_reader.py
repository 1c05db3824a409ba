"""Find and read the shard files of a DeepSpeed checkpoint, one file at a time.

Layouts understood (DeepSpeed 0.19 file names):

- pipeline: `layer_XX-model_YY-model_states.pt` (layer XX of the PipelineModule, TP rank YY;
  `layer_XX-model_states.pt` without a model axis);
- plain ZeRO 0-2: `mp_rank_YY_model_states.pt` whose `module` holds TP rank YY's weights;
- ZeRO-3: `zero_pp_rank_D_mp_rank_YY_model_states.pt` + `..._optim_states.pt`; weights are
  rebuilt from the fp32 partitions with DeepSpeed's `zero_to_fp32` helpers, per TP rank.

A checkpoint directory is either a tag directory or a save directory with a `latest` file.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_lev.config import RunConfig, load_config
from megatron_lev.errors import CheckpointDataError

_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_MP = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class CheckpointError(CheckpointDataError):
    """The checkpoint is missing, incomplete or corrupted; the message names the file."""


@dataclass
class CheckpointFiles:
    """Where each shard of one checkpoint tag lives."""

    tag_dir: Path
    kind: str  # "pipeline" | "plain" | "zero3"
    tp: int
    layer_files: dict[int, dict[int, Path]] = field(default_factory=dict)  # layer -> tp rank -> file
    mp_files: dict[int, Path] = field(default_factory=dict)  # tp rank -> mp_rank file (plain)
    zero_dp: int = 0  # data-parallel partitions of a ZeRO-3 checkpoint


def resolve_tag_dir(path: str | os.PathLike, tag: str | None = None) -> Path:
    """The directory holding the shard files: `path/tag`, `path/<latest>`, or `path` itself."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if tag is not None:
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise CheckpointError(f"checkpoint tag directory {tag_dir} does not exist")
        return tag_dir
    if any(path.glob("*model_states.pt")):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag_dir = path / latest.read_text().strip()
        if not tag_dir.is_dir():
            raise CheckpointError(f"{latest} names tag {tag_dir.name!r} but {tag_dir} does not exist")
        return tag_dir
    raise CheckpointError(f"{path} holds no *model_states.pt files and no 'latest' file: not a DeepSpeed "
                          "checkpoint (pass the save directory or one tag directory)")


def find_files(tag_dir: Path) -> CheckpointFiles:
    """Classify the shard files of `tag_dir` and check that no TP rank or layer is missing."""
    names = [p.name for p in tag_dir.iterdir()]
    layers: dict[int, dict[int, Path]] = {}
    for n in names:
        if m := _LAYER.match(n):
            layers.setdefault(int(m.group(1)), {})[int(m.group(2) or 0)] = tag_dir / n
    if layers:
        tps = {len(v) for v in layers.values()}
        tp = max(tps)
        for idx, ranks in sorted(layers.items()):
            if sorted(ranks) != list(range(tp)):
                raise CheckpointError(f"{tag_dir}: layer {idx} has files for TP ranks {sorted(ranks)}, expected "
                                      f"0..{tp - 1}: the checkpoint is incomplete")
        return CheckpointFiles(tag_dir, "pipeline", tp, layer_files=layers)
    zero3 = [(int(m.group(1)), int(m.group(2))) for n in names if (m := _ZERO3.match(n))]
    if zero3:
        tp = 1 + max(mp for _, mp in zero3)
        dp = 1 + max(d for d, _ in zero3)
        optim = {(int(m.group(1)), int(m.group(2))) for n in names if (m := _OPTIM.match(n))}
        missing = [(d, mp) for d in range(dp) for mp in range(tp) if (d, mp) not in optim]
        if missing:
            raise CheckpointError(f"{tag_dir}: ZeRO-3 optimizer partition(s) (dp, tp) {missing} are missing: "
                                  "the checkpoint is incomplete")
        return CheckpointFiles(tag_dir, "zero3", tp, zero_dp=dp)
    mp = {int(m.group(1)): tag_dir / n for n in names if (m := _MP.match(n))}
    if not mp:
        raise CheckpointError(f"{tag_dir}: no model_states.pt shard files found")
    tp = 1 + max(mp)
    if sorted(mp) != list(range(tp)):
        raise CheckpointError(f"{tag_dir}: mp_rank files for TP ranks {sorted(mp)}, expected 0..{tp - 1}: "
                              "the checkpoint is incomplete")
    return CheckpointFiles(tag_dir, "plain", tp, mp_files=mp)


def load_file(path: Path) -> dict:
    """`torch.load` one shard on CPU; a truncated or foreign file becomes a CheckpointError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch raises several types for damaged zip archives
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(exc).__name__}: {exc} "
                              "(truncated or corrupted; was the save interrupted?)") from None


def plain_module_state(files: CheckpointFiles, tp_rank: int) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank`'s full module state dict from an `mp_rank_YY_model_states.pt` file."""
    path = files.mp_files[tp_rank]
    state = load_file(path)
    module = state.get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"{path} has no 'module' state dict (got {type(module).__name__})")
    return module


def zero3_module_state(files: CheckpointFiles, tp_rank: int) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank`'s fp32 weights gathered from the ZeRO-3 partitions of its DP group."""
    from deepspeed.utils.zero_to_fp32 import _get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

    tag = f"mp_rank_{tp_rank:02d}_"
    with tempfile.TemporaryDirectory() as tmp:
        # zero_to_fp32 treats every file it sees as one DP group: show it only this TP rank's files
        for p in files.tag_dir.iterdir():
            if tag in p.name and (_ZERO3.match(p.name) or _OPTIM.match(p.name)):
                os.symlink(p.resolve(), Path(tmp) / p.name)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints its progress to stdout
                state = _get_fp32_state_dict_from_zero_checkpoint(tmp, exclude_frozen_parameters=False)
        except Exception as exc:
            raise CheckpointError(f"{files.tag_dir}: cannot gather the ZeRO-3 partitions of TP rank {tp_rank}: "
                                  f"{type(exc).__name__}: {exc}") from None
    return dict(to_torch_tensor(state))  # lazy views over the flat partitions -> real tensors


def find_run_config(tag_dir: Path, config: str | os.PathLike | None = None) -> RunConfig:
    """The run config saved with the checkpoint (tag dir, then the save dir), or `config` if given."""
    candidates = [Path(config)] if config else [tag_dir / "config.yaml", tag_dir.parent / "config.yaml"]
    for path in candidates:
        if path.is_file():
            return load_config([path])
    raise CheckpointError(f"no config.yaml beside the checkpoint (looked in {tag_dir} and {tag_dir.parent}); "
                          "pass --config with the run's resolved config")
