"""Where a run starts: the newest checkpoint that verifies and whose config matches, or a fresh
start that loses nothing.

Which config keys may differ between a checkpoint and the run that resumes it, and whether its data
and tokenizer are the run's, is `training.resume_checks`; what the checkpoint records (its stored
config, the batch its steps were made with) is read by `ckpt.record`.

The data-parallel size is not a config key (it is the number of processes over TP x PP): a run
may resume on another DP size. It keeps the checkpoint's global batch (sequences per step) by
adjusting gradient accumulation, global = micro-batch x DP x accumulation, and says so in one
line; the sampler's position is a global sample count, so the same samples make each step. A
global batch the new layout cannot divide is refused naming the values that work, and so is a
direct DP change under ZeRO >= 1, whose optimizer files are split by DP rank (reshard first).
`train.global_batch_size` unset means "micro-batch x DP" at the start of a run; on resume it
means "the checkpoint's global batch".
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lev.ckpt.layout import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    LATEST_FILE,
    STARTED_MARKER,
    empty_trash,
    interrupted_start,
    iteration_of,
    read_latest,
    resume_candidates,
    verify_checkpoint,
)
from megatron_lev.ckpt.record import SavedBatch, saved_batch
from megatron_lev.errors import CheckpointDataError, ConfigError
from megatron_lev.log import get_logger
from megatron_lev.plan.ds_config import data_parallel_size
from megatron_lev.training.resume_checks import (
    TOKENIZER,
    check_resume_config,
    check_resume_provenance,
    differences,
    judge,
    kind_of,
)
from megatron_lev.utils import dist as ranks
from megatron_lev.utils.io import TEMP_MARK
from megatron_lev.utils.lock import DIR_LOCK_NAME

RUN_OUTPUTS = (
    CONFIG_FILE,
    "metrics.jsonl",
    "logs",
    "tensorboard",
)  # when train.save is the output directory

log = get_logger(__name__)


# ------------------------------------------------------------------ choosing what to resume


@dataclass(frozen=True)
class StartPoint:
    """Where a run starts: `tag` under `root`, or from scratch (`tag` None).

    Resuming: `saved` is how the checkpoint's steps were made (None if unknown: an older
    checkpoint), `global_batch` the global batch the run keeps (`keep_global_batch`)."""

    root: Path | None
    tag: str | None
    saved: SavedBatch | None = field(default=None, compare=False)
    global_batch: int | None = field(default=None, compare=False)

    @property
    def iteration(self) -> int:
        return (iteration_of(self.tag) or 0) if self.tag else 0

    def batch_line(self, cfg, world_size: int) -> str | None:
        """The log line for a resume whose batch layout differs from the checkpoint's, else None."""
        if self.saved is None or self.global_batch is None:
            return None
        dp, micro = data_parallel_size(cfg, world_size), cfg.train.micro_batch_size
        gas = self.global_batch // (micro * dp)
        s = self.saved
        if (dp, micro, gas, self.global_batch) == (
            s.data_parallel_size,
            s.micro_batch,
            s.accumulation,
            s.global_batch,
        ):
            return None
        kept = (
            "keeping the global batch of" if self.global_batch == s.global_batch else "with a global batch of"
        )
        return (
            f"resuming {self.root / self.tag} ({s.text()}) on DP={dp}: {kept} {self.global_batch} sequences "
            f"with gradient accumulation {gas} (micro-batch {micro} x DP {dp} x {gas})"
        )


def _foreign_entries(root: Path, cfg=None, engine_files: Collection[str] = ()) -> list[str]:
    """What in save directory `root` a fresh start would prune or overwrite but did not write."""
    if not root.is_dir():
        return []
    outputs = ()
    if cfg is not None and Path(cfg.logging.output_dir).resolve() == root.resolve():
        outputs = RUN_OUTPUTS
    found = []
    for child in sorted(root.iterdir()):
        name = child.name
        if TEMP_MARK in name or name in engine_files or name in outputs or name == DIR_LOCK_NAME:
            continue
        if iteration_of(name) is not None and child.is_dir():
            if (child / COMPLETE_MARKER).is_file():
                found.append(f"{name}/ (a complete checkpoint)")
            elif not (child / STARTED_MARKER).is_file() and not interrupted_start(child):
                found.append(f"{name}/ (no '{COMPLETE_MARKER}' marker, not written by this trainer)")
            continue
        if name == LATEST_FILE:
            wanted, _ = read_latest(root)
            found.append(
                f"{LATEST_FILE} (names {wanted or 'nothing readable'}, which is not a usable checkpoint)"
            )
            continue
        found.append(name + ("/" if child.is_dir() else ""))
    return found


def check_fresh_start(save_dir: str | os.PathLike, cfg=None, engine_files: Collection[str] = ()) -> None:
    """Refuse to start from scratch into a save directory holding files a fresh run would prune or
    overwrite."""
    root = Path(save_dir)
    found = _foreign_entries(root, cfg, engine_files)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise CheckpointDataError(
            f"train.save={root} already holds {shown}, and no checkpoint there can be resumed; a fresh start "
            "would prune or overwrite them: move them elsewhere (or delete them), or set train.save to an "
            "empty directory"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def keep_global_batch(path: str | os.PathLike, saved: SavedBatch, cfg, world_size: int) -> int:
    """The global batch a run of `cfg` on `world_size` processes resuming checkpoint `path` (saved
    as `saved`) trains with: `train.global_batch_size` if set, else the checkpoint's. Refuses (one
    line naming what works) a layout that cannot make it, and a DP change under ZeRO >= 1."""
    t, p = cfg.train, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp, micro = data_parallel_size(cfg, world_size), t.micro_batch_size
    where = f"{path} (saved on DP={saved.data_parallel_size})"
    if dp != saved.data_parallel_size and p.zero_stage >= 1:
        out = f"{Path(path).parent}_dp{dp}"
        raise CheckpointDataError(
            f"cannot resume {where} on DP={dp}: parallel.zero_stage={p.zero_stage} splits Adam's "
            f"state by data-parallel rank; reshard it first (megatron-lev reshard {Path(path).parent} "
            f"{out} --tag {Path(path).name} --tp {tp} --pp {pp} --dp {dp}) and train with train.save={out}, "
            f"or run on {saved.data_parallel_size * tp * pp} processes"
        )
    global_batch = t.global_batch_size or saved.global_batch
    if global_batch % (micro * dp):
        source = (
            f"train.global_batch_size={global_batch}"
            if t.global_batch_size
            else f"the checkpoint's global batch of {global_batch} sequences"
        )
        options = []
        if global_batch % dp == 0:
            micros = [m for m in _divisors(global_batch // dp) if m != micro]
            options.append(
                f"train.micro_batch_size={' or '.join(map(str, micros[-3:]))} "
                "(with --allow-change train.micro_batch_size)"
            )
        worlds = [d * tp * pp for d in _divisors(global_batch // micro)] if global_batch % micro == 0 else []
        if worlds:
            options.append(f"{' or '.join(map(str, worlds[-4:]))} processes")
        options.append("another batch (train.global_batch_size=N --allow-change train.global_batch_size)")
        raise ConfigError(
            f"cannot resume {where} on DP={dp}: {source} is not a multiple of train.micro_batch_size x DP "
            f"= {micro} x {dp}; what works: {'; or '.join(options)}"
        )
    return global_batch


def _resolved(path: str | os.PathLike) -> Path:
    """`path` absolute with symlinks resolved (as far as it exists), to compare two spellings of a
    directory."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _named_tag(load_dir) -> str | None:
    """The tag `train.load` names when it is one checkpoint (`<save>/iter_0001000`), else None."""
    if not load_dir:
        return None
    path = Path(load_dir)
    if iteration_of(path.name) is None:
        return None
    if not path.is_dir():
        raise CheckpointDataError(
            f"train.load={load_dir} names checkpoint {path.name}, which does not exist: give an existing "
            "tag directory, or the save directory to resume from its latest checkpoint"
        )
    return path.name


def choose_start(
    load_dir: str | os.PathLike | None,
    save_dir: str | os.PathLike | None,
    cfg=None,
    allow=(),
    engine_files: Collection[str] = (),
    provenance: dict | None = None,
) -> StartPoint:
    """Collective: the newest checkpoint that verifies, looked for in `save_dir` first (a requeued run
    continues its own checkpoints), then `load_dir`; damaged ones are named and skipped. With none,
    checks that starting from scratch loses nothing (`engine_files`: what the engine writes beside
    its tags, `Engine.owned_files()`). `load_dir` may name one checkpoint (`<save>/iter_0001000`): that
    one is taken, not its directory's latest (a branch from it); the run's own `save_dir` still comes
    first, so a requeued branch continues its own checkpoints. Directories are compared resolved: a
    relative path or a symlink naming `save_dir` is the same directory. With `cfg`, the checkpoint's
    config and provenance are compared with the run's (`provenance`: the run's record, if already
    built)."""
    roots: list[Path] = []
    chosen: dict[Path, str] = {}  # a root whose one tag train.load names (a branch from it)
    load_tag = _named_tag(load_dir)
    if load_tag is not None:
        load_dir = Path(load_dir).parent
        if save_dir and _resolved(load_dir) == _resolved(save_dir):
            raise CheckpointDataError(
                f"train.load names checkpoint {load_tag} of train.save={save_dir} itself: a branch from one "
                "checkpoint saves into a directory of its own; set train.save to a new directory"
            )
        chosen[_resolved(load_dir)] = load_tag
    for d in (save_dir, load_dir):
        if d and all(_resolved(d) != _resolved(r) for r in roots):
            roots.append(Path(d))
    if save_dir and ranks.rank() == 0:
        empty_trash(save_dir)  # what a prune killed part-way left (this run's lock owns the directory)
    for root in roots:
        if _resolved(root) in chosen:
            tags, notes = [chosen[_resolved(root)]], []
        else:
            tags, notes = resume_candidates(root)
        if ranks.rank() == 0:
            for note in notes:
                log.warning("%s", note)
        if not tags:
            continue
        damaged = []
        for tag in tags:
            problems = verify_checkpoint(root / tag)
            if not problems:
                if damaged and ranks.rank() == 0:
                    log.warning("resuming from %s instead of the damaged %s", root / tag, ", ".join(damaged))
                saved = saved_batch(root / tag)
                global_batch = None
                if cfg is not None:
                    check_resume_config(root / tag, cfg, allow, saved)
                    check_resume_provenance(root / tag, cfg, allow, provenance)
                    if saved is not None:
                        global_batch = keep_global_batch(root / tag, saved, cfg, ranks.world_size())
                if save_dir and _resolved(save_dir) != _resolved(root):  # from train.load: saves go elsewhere
                    check_fresh_start(save_dir, cfg, engine_files)
                return StartPoint(root, tag, saved, global_batch)
            damaged.append(tag)
            if ranks.rank() == 0:
                more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
                log.warning("checkpoint %s is damaged: %s%s; skipping it", root / tag, problems[0], more)
        raise CheckpointDataError(
            f"no usable checkpoint under {root}: {', '.join(damaged)} failed verification (see the warnings "
            "above); restore them from a backup, or move the directory away to start from scratch"
        )
    if save_dir:
        check_fresh_start(save_dir, cfg, engine_files)
    if load_dir and save_dir and _resolved(load_dir) != _resolved(save_dir):
        raise CheckpointDataError(
            f"train.load={load_dir} holds no complete checkpoint: fix the path, or unset "
            "train.load to start from scratch"
        )
    if ranks.rank() == 0:
        log.info("no checkpoint under %s: starting from scratch", save_dir or load_dir)
    return StartPoint(None, None)


__all__ = [  # and, for their callers, the checks and the saved batch this module uses
    "RUN_OUTPUTS",
    "TOKENIZER",
    "StartPoint",
    "SavedBatch",
    "check_fresh_start",
    "check_resume_config",
    "check_resume_provenance",
    "differences",
    "judge",
    "keep_global_batch",
    "kind_of",
    "choose_start",
    "saved_batch",
]
