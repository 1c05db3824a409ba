"""Where a run starts: the newest checkpoint that verifies and whose config matches, or a fresh
start that loses nothing.

Which config keys may differ between a checkpoint and the run that resumes it.

Three kinds of key. FREE keys (budget, intervals, logging, paths, memory knobs)
change nothing a checkpoint holds and may differ. FIXED keys (the model, the
parallel layout, precision) describe the saved weights and optimizer states: a
resume with other values would load them into the wrong shapes or meanings, so it
is refused. Every other key (seeds, data, batch sizes, optimizer settings) breaks
an exact resume: refused unless the user names it with `--allow-change KEY`.

A few `model.*` keys change neither the shapes nor the meaning of the saved weights:
dropout rates, initialisation scales and the sources of LEV's token order (its seed and counts
file: the order itself is stored with the weights; used only before the first step) are free,
and `model.seq_length` (rotary positions: no weight depends on it) is allowed with
`--allow-change`, since the data is then cut into other samples.

Beyond the config, the checkpoint's `provenance.json` (`ckpt.provenance`) records the shard sets
(their manifests' content digests), the blend and the tokenizer's fingerprint; a resume on other
tokens under the same paths, or with another tokenizer file, is refused unless allowed with
`--allow-change data` (which also allows every `data.*` key) or `--allow-change tokenizer`.

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

import copy
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_lev.ckpt.layout import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    LATEST_FILE,
    STARTED_MARKER,
    empty_trash,
    interrupted_start,
    iteration_of,
    read_latest,
    read_marker,
    resume_candidates,
    verify_checkpoint,
)
from megatron_lev.errors import CheckpointDataError, ConfigError
from megatron_lev.log import get_logger
from megatron_lev.utils import dist as ranks
from megatron_lev.utils.io import TEMP_MARK
from megatron_lev.utils.lock import DIR_LOCK_NAME

RUN_OUTPUTS = (
    "config.yaml",
    "metrics.jsonl",
    "logs",
    "tensorboard",
)  # when train.save is the output directory

log = get_logger(__name__)

FREE_PREFIXES = ("logging.",)
FREE_KEYS = frozenset(
    {
        "train.train_iters",
        "train.train_tokens",
        "train.chinchilla",
        "train.save_interval",
        "train.save_initial",
        "train.keep_last",
        "train.eval_interval",
        "train.eval_iters",
        "train.save",
        "train.load",
        "train.max_consecutive_skips",
        "train.max_update_ratio",
        "train.callbacks",
        "data.num_workers",
        "data.cache_dir",
        "parallel.distributed_backend",
        "parallel.collective_timeout_s",
        "parallel.heartbeat_timeout_s",
        "parallel.cpu_offload",
        "model.name",
        "model.activation_checkpointing",
        "model.checkpoint_num_layers",
        "model.lev.chunk_size",
        "model.lev.recompute",
        "model.hidden_dropout",
        "model.attention_dropout",
        "model.init_std",
        "model.lev.w_out_init_scale",
        "model.lev.id_order_seed",  # the token order is drawn at init and stored with the weights
        "model.lev.id_order_counts",
        "model.input_init_rms",
    }
)
DATA, TOKENIZER = "data", "tokenizer"  # --allow-change names for the provenance checks
# where the data and the tokenizer are: compared by content (provenance.json's digests), not as strings,
# when the checkpoint records its provenance; a copy of the same shards elsewhere resumes exactly
CONTENT_KEYS = frozenset({"data.data_path", "data.valid_data_path", "data.tokenizer_path"})
EXACT_KEYS = frozenset({"model.seq_length"})  # under a fixed prefix, yet allowed by --allow-change
FIXED_PREFIXES = ("model.",)
FIXED_KEYS = frozenset(
    {
        "parallel.tensor_model_parallel_size",
        "parallel.pipeline_model_parallel_size",
        "parallel.partition_method",
        "parallel.zero_stage",
        "train.precision",
        "train.clip_groups",  # splits the optimizer's groups: its saved states are grouped by them
    }
)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def kind_of(key: str) -> str:
    """ "free", "fixed" or "exact" (see the module docstring)."""
    if key in FREE_KEYS or key.startswith(FREE_PREFIXES):
        return "free"
    if key in EXACT_KEYS:
        return "exact"
    if key in FIXED_KEYS or key.startswith(FIXED_PREFIXES):
        return "fixed"
    return "exact"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return float(a) == float(b)
    return a == b


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, current value) for every key both configs have and that differs."""
    old, new = flatten(stored), flatten(current)
    return [(k, old[k], new[k]) for k in sorted(old.keys() & new.keys()) if not _same(old[k], new[k])]


def judge(
    diffs: list[tuple[str, Any, Any]], allow: frozenset[str] | set[str]
) -> tuple[list[str], list[str], list[str]]:
    """Split differing keys into (log lines, refused fixed keys, refused exact keys)."""
    lines, fixed, exact = [], [], []
    for key, old, new in diffs:
        kind = kind_of(key)
        if kind == "fixed":
            fixed.append(key)
            verdict = "refused: the checkpoint's weights or optimizer states were saved with the old value"
        elif kind == "exact" and key not in allow and not (DATA in allow and key.startswith("data.")):
            exact.append(key)
            verdict = f"refused: the resume would not be exact; pass --allow-change {key} to accept"
        else:
            verdict = "allowed" if kind == "free" else "allowed by --allow-change"
        lines.append(f"  {key}: {old!r} -> {new!r} ({verdict})")
    return lines, fixed, exact


# ------------------------------------------------------------------ choosing what to resume


@dataclass(frozen=True)
class ResumePlan:
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
        dp, micro = cfg.data_parallel_size(world_size), cfg.train.micro_batch_size
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


@dataclass(frozen=True)
class SavedBatch:
    """How a checkpoint's steps were made: its data-parallel size and global batch (sequences)."""

    data_parallel_size: int
    global_batch: int
    micro_batch: int

    @property
    def accumulation(self) -> int | None:
        """Micro-batches per step, None when the global batch is not a multiple of micro x DP (a
        resharded checkpoint records the source's batch, which its new DP size may not divide)."""
        per_step = self.micro_batch * self.data_parallel_size
        return self.global_batch // per_step if self.global_batch % per_step == 0 else None

    def text(self) -> str:
        m, dp, gas = self.micro_batch, self.data_parallel_size, self.accumulation
        if gas is None:
            return f"global batch {self.global_batch}, micro-batch {m}, DP {dp}"
        return f"global batch {self.global_batch} = micro-batch {m} x DP {dp} x accumulation {gas}"


def _read_stored_config(path: Path) -> dict | None:
    """The config mapping stored in checkpoint `path` (None when it has none: an older version)."""
    import yaml

    stored_file = path / CONFIG_FILE
    if not stored_file.is_file():
        return None
    try:
        stored = yaml.safe_load(stored_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CheckpointDataError(
            f"{stored_file} is unreadable ({exc}); restore it from the run's "
            "output directory or remove the checkpoint"
        ) from exc
    if not isinstance(stored, dict):
        raise CheckpointDataError(
            f"{stored_file} is not a config mapping; restore it or remove the checkpoint"
        )
    return stored


def saved_batch(path: str | os.PathLike, stored: dict | None = None) -> SavedBatch | None:
    """The data-parallel size and global batch checkpoint `path` was trained with, from its stored
    config and the world size in its `complete` marker; None when either is missing or unreadable."""
    path = Path(path)
    if stored is None:
        try:
            stored = _read_stored_config(path)
        except CheckpointDataError:
            return None
    try:
        world = int(read_marker(path)["world_size"])
        train, par = stored["train"], stored["parallel"]
        micro = int(train["micro_batch_size"])
        model_parallel = int(par["tensor_model_parallel_size"]) * int(par["pipeline_model_parallel_size"])
        dp = world // model_parallel
        global_batch = int(train.get("global_batch_size") or micro * dp)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if min(world, micro, dp, global_batch) < 1:
        return None
    return SavedBatch(dp, global_batch, micro)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def keep_global_batch(path: str | os.PathLike, saved: SavedBatch, cfg, world_size: int) -> int:
    """The global batch a run of `cfg` on `world_size` processes resuming checkpoint `path` (saved
    as `saved`) trains with: `train.global_batch_size` if set, else the checkpoint's. Refuses (one
    line naming what works) a layout that cannot make it, and a DP change under ZeRO >= 1."""
    t, p = cfg.train, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp, micro = cfg.data_parallel_size(world_size), t.micro_batch_size
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


def check_resume_config(path: str | os.PathLike, cfg, allow=(), saved: SavedBatch | None = None) -> None:
    """Print how `cfg` differs from the config stored in checkpoint `path`; refuse changes that
    would load the weights wrongly or make the resume inexact (unless allowed by name).

    `train.global_batch_size` is compared as the global batch it makes: the checkpoint's
    (`saved`), and, when the run leaves it unset, the checkpoint's too (the run keeps it)."""
    stored_file = Path(path) / CONFIG_FILE
    stored = _read_stored_config(Path(path))
    if stored is None:
        if ranks.rank() == 0:
            log.warning("%s not found (saved by an older version): the config is not compared", stored_file)
        return
    current = cfg.to_dict()
    if saved is not None and isinstance(stored.get("train"), dict):
        stored, current = copy.deepcopy(stored), copy.deepcopy(current)
        stored["train"]["global_batch_size"] = saved.global_batch
        if current["train"]["global_batch_size"] is None:
            current["train"]["global_batch_size"] = saved.global_batch
    diffs = differences(stored, current)
    if diffs and _records_provenance(Path(path)):
        moved = [d for d in diffs if d[0] in CONTENT_KEYS]
        diffs = [d for d in diffs if d[0] not in CONTENT_KEYS]
        if moved and ranks.rank() == 0:
            log.info(
                "%s: the checkpoint's data and tokenizer are compared by content (%s), not by path: %s",
                path,
                "provenance.json",
                "; ".join(f"{k} {old!r} -> {new!r}" for k, old, new in moved),
            )
    if not diffs:
        return
    lines, fixed, exact = judge(diffs, frozenset(allow))
    if ranks.rank() == 0:
        log.warning("the config differs from the checkpoint's (%s):\n%s", stored_file, "\n".join(lines))
    if fixed:
        raise CheckpointDataError(
            f"cannot resume from {path}: {', '.join(fixed)} differ from the checkpoint's config "
            f"({stored_file}), whose weights and optimizer states were saved for the old values: "
            "restore them, "
            "convert or reshard the checkpoint, or start a new run with another train.save"
        )
    if exact:
        flags = " ".join(f"--allow-change {k}" for k in exact)
        raise CheckpointDataError(
            f"cannot resume exactly from {path}: {', '.join(exact)} differ from the checkpoint's config "
            f"({stored_file}): restore them, or pass {flags} to accept a resume that is not exact"
        )


def _records_provenance(path: Path) -> bool:
    """Whether checkpoint `path` records the content of its data and tokenizer (`provenance.json`)."""
    from megatron_lev.ckpt.provenance import PROVENANCE_FILE

    return (path / PROVENANCE_FILE).is_file()


def check_resume_provenance(path: str | os.PathLike, cfg, allow=(), current: dict | None = None) -> None:
    """Refuse to resume checkpoint `path` on other tokens (a shard set whose manifest describes
    other content than the one recorded, another blend) or with another tokenizer file than it
    records, unless `allow` holds `data` / `tokenizer`. `current`: the run's record
    (`ckpt.provenance.run_provenance`), built from `cfg.data` when not given. A checkpoint
    without a record is named in one warning."""
    from megatron_lev.ckpt.provenance import (
        PROVENANCE_FILE,
        data_changes,
        read_provenance,
        run_provenance,
        tokenizer_change,
        warn_unrecorded,
    )

    recorded = read_provenance(path)
    if recorded is None:
        if ranks.rank() == 0:
            warn_unrecorded(path, "the data and tokenizer are not compared with this run's")
        return
    current = current if current is not None else run_provenance(cfg.data)
    changes, accepted, flags, what = [], [], [], []
    for key, found, thing in (
        (TOKENIZER, [tokenizer_change(recorded, current)], "the tokenizer file"),
        (DATA, data_changes(recorded, current), "the shard sets"),
    ):
        found = [f for f in found if f]
        if found and key in allow:
            accepted += found
        elif found:
            changes += found
            flags.append(f"--allow-change {key}")
            what.append(thing)
    if accepted and ranks.rank() == 0:
        log.warning("resuming from %s although %s (allowed by --allow-change)", path, "; ".join(accepted))
    if changes:
        raise CheckpointDataError(
            f"cannot resume from {path}: {'; '.join(changes)} (see {Path(path) / PROVENANCE_FILE}); "
            f"restore {' and '.join(what)} it was trained on, or pass {' '.join(flags)} to "
            "continue training on the new ones"
        )


def _resolved(path: str | os.PathLike) -> Path:
    """`path` absolute with symlinks resolved (as far as it exists), to compare two spellings of a
    directory."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def plan_resume(
    load_dir: str | os.PathLike | None,
    save_dir: str | os.PathLike | None,
    cfg=None,
    allow=(),
    engine_files: Collection[str] = (),
    provenance: dict | None = None,
) -> ResumePlan:
    """Collective: the newest checkpoint that verifies, looked for in `save_dir` first (a requeued run
    continues its own checkpoints), then `load_dir`; damaged ones are named and skipped. With none,
    checks that starting from scratch loses nothing (`engine_files`: what the engine writes beside
    its tags, `Engine.owned_files()`). Directories are compared resolved: a relative path or a
    symlink naming `save_dir` is the same directory. With `cfg`, the checkpoint's config and
    provenance are compared with the run's (`provenance`: the run's record, if already built)."""
    roots: list[Path] = []
    for d in (save_dir, load_dir):
        if d and all(_resolved(d) != _resolved(r) for r in roots):
            roots.append(Path(d))
    if save_dir and ranks.rank() == 0:
        empty_trash(save_dir)  # what a prune killed part-way left (this run's lock owns the directory)
    for root in roots:
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
                return ResumePlan(root, tag, saved, global_batch)
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
    return ResumePlan(None, None)
