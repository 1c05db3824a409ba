"""Find and read the shard files of a DeepSpeed checkpoint, one file at a time.

Layouts understood (DeepSpeed 0.19 file names):

- pipeline: `layer_XX-model_YY-model_states.pt` (layer XX of the PipelineModule, TP rank YY;
  `layer_XX-model_states.pt` without a model axis), keyed by canonical parameter names;
- plain ZeRO 0-2: `mp_rank_YY_model_states.pt` whose `module` holds TP rank YY's weights;
- ZeRO-3: `zero_pp_rank_D_mp_rank_YY_model_states.pt` + `..._optim_states.pt`; weights are
  rebuilt from the fp32 partitions with DeepSpeed's `zero_to_fp32` helpers, per TP rank.

A checkpoint directory is either a tag directory or a save directory with a `latest` file. What the
trainer records beside these files (the run's config, the batch its steps were made with) is read by
`ckpt.record`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_lev.ckpt.layout import COMPLETE_MARKER, LATEST_FILE, read_latest, verify_checkpoint
from megatron_lev.ckpt.record import CheckpointError

_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_MP = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# DeepSpeed's optimizer-state files (ZeRO 1-3); engine.optimizer_files reads them too
OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


ENGINE_HELPER_FILES = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies these into a save directory


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
        raise CheckpointError(
            f"checkpoint directory {path} does not exist (or is not a directory); pass the "
            "run's save directory or one checkpoint tag directory"
        )
    if tag is not None:
        tag_dir = path / tag
        if not tag_dir.is_dir():
            tags = sorted(p.name for p in path.iterdir() if p.is_dir())
            raise CheckpointError(
                f"checkpoint tag directory {tag_dir} does not exist (--tag {tag}); tags there: "
                f"{', '.join(tags[:8]) or 'none'}"
            )
        return tag_dir
    if any(path.glob("*model_states.pt")):
        return path
    name, problem = read_latest(path, any_tag=True)
    latest = path / LATEST_FILE
    if problem:
        raise CheckpointError(f"{problem}; write the tag (e.g. iter_0001000) into it or pass --tag")
    if name is not None:
        tag_dir = path / name
        if not tag_dir.is_dir():
            raise CheckpointError(f"{latest} names tag {tag_dir.name!r} but {tag_dir} does not exist")
        return tag_dir
    raise CheckpointError(
        f"{path} holds no *model_states.pt files and no 'latest' file: not a DeepSpeed "
        "checkpoint (pass the save directory or one tag directory)"
    )


def verify_tag(tag_dir: Path) -> None:
    """Refuse a tag whose completion marker lists checksums its files no longer match."""
    if not (tag_dir / COMPLETE_MARKER).is_file():
        return  # a tag directory saved by another tool; find_files checks what is there
    problems = verify_checkpoint(tag_dir)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(
            f"{problems[0]}{more}: this checkpoint is damaged; convert an earlier tag "
            f"(--tag) or restore it from a copy"
        )


def find_files(tag_dir: Path) -> CheckpointFiles:
    """Classify the shard files of `tag_dir` and check that no TP rank or layer is missing
    and that every file matches the checksum its completion marker recorded."""
    verify_tag(tag_dir)
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
                raise CheckpointError(
                    f"{tag_dir}: layer {idx} has files for TP ranks {sorted(ranks)}, expected "
                    f"0..{tp - 1}: the checkpoint is incomplete"
                )
        return CheckpointFiles(tag_dir, "pipeline", tp, layer_files=layers)
    zero3 = [(int(m.group(1)), int(m.group(2))) for n in names if (m := _ZERO3.match(n))]
    if zero3:
        tp = 1 + max(mp for _, mp in zero3)
        dp = 1 + max(d for d, _ in zero3)
        optim = {(int(m.group(1)), int(m.group(2))) for n in names if (m := OPTIM_FILE.match(n))}
        missing = [(d, mp) for d in range(dp) for mp in range(tp) if (d, mp) not in optim]
        if missing:
            raise CheckpointError(
                f"{tag_dir}: ZeRO-3 optimizer partition(s) (dp, tp) {missing} are missing: "
                "the checkpoint is incomplete"
            )
        return CheckpointFiles(tag_dir, "zero3", tp, zero_dp=dp)
    mp = {int(m.group(1)): tag_dir / n for n in names if (m := _MP.match(n))}
    if not mp:
        raise CheckpointError(
            f"{tag_dir}: no *model_states.pt shard files found: not a DeepSpeed checkpoint "
            "tag, or its save was interrupted; pass a complete tag (--tag)"
        )
    tp = 1 + max(mp)
    if sorted(mp) != list(range(tp)):
        raise CheckpointError(
            f"{tag_dir}: mp_rank files for TP ranks {sorted(mp)}, expected 0..{tp - 1}: "
            "the checkpoint is incomplete"
        )
    return CheckpointFiles(tag_dir, "plain", tp, mp_files=mp)


# DeepSpeed's own checkpoint files pickle these objects besides tensors and plain containers
# (the loss scaler and ZeRO stage of the optimizer states, bf16 fragment addresses); nothing else
# is unpickled, so a planted pickle payload cannot run code when a checkpoint is read. An fp16 run
# pickles a DynamicLossScaler, whose state is numbers, bools and a torch dtype (allowed by default).
DEEPSPEED_SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def safe_globals() -> list:
    """The classes `load_file` allows besides tensors (those of the installed DeepSpeed that exist)."""
    import importlib

    found = []
    for module, name in DEEPSPEED_SAFE_GLOBALS:
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    return found


def safe_torch_load(path, **kwargs):
    """`torch.load` with `weights_only=True` and only DeepSpeed's allow-listed classes.

    Never falls back to `weights_only=False`. How the allow-list is given depends on torch:
    2.5+ scopes it to this call (`serialization.safe_globals`); 2.4 has only the process-wide
    `serialization.add_safe_globals`, so these few DeepSpeed classes stay allowed for every
    weights-only load of the process; 2.3 has no allow-list at all, so a file that pickles one
    of them (optimizer states of ZeRO-3 or fp16 runs) is refused with a CheckpointError that
    asks for torch >= 2.4, while files of tensors and plain containers still load.
    """
    kwargs["weights_only"] = True
    serialization = torch.serialization
    if hasattr(serialization, "safe_globals"):
        with serialization.safe_globals(safe_globals()):
            return torch.load(path, **kwargs)
    if hasattr(serialization, "add_safe_globals"):
        listed = getattr(serialization, "get_safe_globals", None) or getattr(
            serialization, "_get_safe_globals", lambda: []
        )
        have = list(listed())
        missing = [g for g in safe_globals() if g not in have]
        if missing:
            serialization.add_safe_globals(missing)
        return torch.load(path, **kwargs)
    try:
        return torch.load(path, **kwargs)
    except pickle.UnpicklingError as exc:
        names = [f"{m}.{n}" for m, n in DEEPSPEED_SAFE_GLOBALS]
        needed = [name for name in names if re.search(rf"\b{re.escape(name)}\b", str(exc))]
        if not needed:
            raise
        raise CheckpointError(
            f"cannot read {path} safely with torch {torch.__version__}: it pickles DeepSpeed's "
            f"{needed[0]}, and torch < 2.4 cannot allow a class in a weights-only load; "
            "install torch >= 2.4 to read this checkpoint"
        ) from None


def load_file(path: Path) -> dict:
    """`torch.load` one shard on CPU without running code from it; a truncated, foreign or
    code-carrying file becomes a CheckpointError naming it."""
    try:
        return safe_torch_load(path, map_location="cpu")
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():
            raise CheckpointError(_refused(path, exc)) from None
        raise CheckpointError(
            f"cannot read checkpoint file {path}: {_first_line(exc)} (truncated or corrupted; "
            "was the save interrupted?)"
        ) from None
    except Exception as exc:  # torch raises several types for damaged zip archives
        raise CheckpointError(
            f"cannot read checkpoint file {path}: {type(exc).__name__}: {_first_line(exc)} "
            "(truncated or corrupted; was the save interrupted?)"
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _refused(path, exc: BaseException) -> str:
    what = re.search(r"(?:Unsupported global|Unsupported class|Unsupported operand)[^\n]*", str(exc))
    return (
        f"refusing to load {path}: it holds pickled objects other than tensors and DeepSpeed's own "
        f"state ({what.group(0).strip() if what else _first_line(exc)}); a checkpoint is never unpickled "
        "beyond that, since it could run code: use a checkpoint written by the trainer"
    )


class _WeightsOnlyTorch:
    """`torch` as DeepSpeed's zero_to_fp32 sees it, with `load` restricted to weights and allow-listed
    classes."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(path, *args, **kwargs):
        kwargs.pop("weights_only", None)
        return safe_torch_load(path, *args, **kwargs)


@contextlib.contextmanager
def _weights_only_zero_to_fp32():
    """zero_to_fp32 calls `torch.load(..., weights_only=False)`; route those calls through
    `safe_torch_load`."""
    from deepspeed.utils import zero_to_fp32

    real = zero_to_fp32.torch
    zero_to_fp32.torch = _WeightsOnlyTorch()
    try:
        yield
    finally:
        zero_to_fp32.torch = real


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
            if tag in p.name and (_ZERO3.match(p.name) or OPTIM_FILE.match(p.name)):
                os.symlink(p.resolve(), Path(tmp) / p.name)
        try:
            with (
                contextlib.redirect_stdout(sys.stderr),
                _weights_only_zero_to_fp32(),
            ):  # progress goes to stdout
                state = _get_fp32_state_dict_from_zero_checkpoint(tmp, exclude_frozen_parameters=False)
        except pickle.UnpicklingError as exc:
            if "weights only" not in str(exc).lower():
                raise CheckpointError(
                    f"{files.tag_dir}: cannot read the ZeRO-3 files of TP rank {tp_rank}: "
                    f"{_first_line(exc)} (truncated or corrupted?)"
                ) from None
            raise CheckpointError(
                _refused(f"a ZeRO-3 file of TP rank {tp_rank} in {files.tag_dir}", exc)
            ) from None
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"{files.tag_dir}: cannot gather the ZeRO-3 partitions of TP rank {tp_rank}: "
                f"{type(exc).__name__}: {_first_line(exc)}"
            ) from None
    return dict(to_torch_tensor(state))  # lazy views over the flat partitions -> real tensors
