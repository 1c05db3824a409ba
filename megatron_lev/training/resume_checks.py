"""Whether a checkpoint may be resumed by this run: which config keys may differ, and its data and
tokenizer (`training.resume` decides where a run starts and asks these checks).

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
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from megatron_lev.ckpt.layout import CONFIG_FILE
from megatron_lev.ckpt.record import SavedBatch, read_stored_config
from megatron_lev.errors import CheckpointDataError
from megatron_lev.log import get_logger
from megatron_lev.utils import dist as ranks

# part of the resume: its lines are named `megatron_lev.training.resume`, as they always were
log = get_logger("training.resume")

FREE_PREFIXES = ("logging.",)
FREE_KEYS = frozenset(
    {
        "train.train_iters",
        "train.train_tokens",
        "train.chinchilla",
        "train.save_interval",
        "train.save_initial",
        "train.keep_last",
        "train.async_save",
        "train.eval_interval",
        "train.eval_iters",
        "train.exit_interval",
        "train.save",
        "train.load",
        "train.init_from",  # a fresh run's first weights: a resume has its own
        "train.max_consecutive_skips",
        "train.spike_window",
        "train.spike_zscore",
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
        "model.fused_loss",
        "model.recompute_attention",
        "model.compile",
        "model.loss_chunk_tokens",
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
# the learning-rate schedule: a change that keeps the rate of every update before the checkpoint is a
# branch (a cool-down from a constant-rate checkpoint, say) and is allowed; any other needs --allow-change
SCHEDULE_KEYS = frozenset(
    {
        "train.lr",
        "train.min_lr",
        "train.lr_decay_style",
        "train.lr_warmup_iters",
        "train.lr_warmup_fraction",
        "train.lr_wsd_decay_iters",
        "train.lr_wsd_decay_fraction",
        "train.lr_wsd_decay_style",
    }
)
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


def threshold_only(key: str, old: Any, new: Any) -> bool:
    """Whether a fixed key's change moves only a clipping threshold, not the optimizer's groups: the same
    clip groups (names, patterns, order) with other `max_norm`s, or LEV's seed-side group kept with
    another `model.lev.seed_clip_grad`. Such a change is as inexact as `train.clip_grad`'s and, like it,
    allowed by `--allow-change KEY`."""
    if key == "model.lev.seed_clip_grad":
        return old is not None and new is not None
    if key != "train.clip_groups" or not isinstance(old, list) or not isinstance(new, list):
        return False

    def groups(rules):
        return [(r.get("name"), list(r.get("patterns") or [])) if isinstance(r, dict) else r for r in rules]

    return len(old) == len(new) and groups(old) == groups(new)


def judge(
    diffs: list[tuple[str, Any, Any]], allow: frozenset[str] | set[str], branch: str | None = None
) -> tuple[list[str], list[str], list[str]]:
    """Split differing keys into (log lines, refused fixed keys, refused exact keys). `branch`: why
    the schedule keys' changes keep every past rate (`schedule_branch`), None when they do not."""
    lines, fixed, exact = [], [], []
    for key, old, new in diffs:
        kind = "exact" if threshold_only(key, old, new) else kind_of(key)
        if key in SCHEDULE_KEYS and branch and key not in allow:
            lines.append(f"  {key}: {old!r} -> {new!r} (allowed: {branch})")
            continue
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


def check_resume_config(path: str | os.PathLike, cfg, allow=(), saved: SavedBatch | None = None) -> None:
    """Print how `cfg` differs from the config stored in checkpoint `path`; refuse changes that
    would load the weights wrongly or make the resume inexact (unless allowed by name).

    `train.global_batch_size` is compared as the global batch it makes: the checkpoint's
    (`saved`), and, when the run leaves it unset, the checkpoint's too (the run keeps it)."""
    stored_file = Path(path) / CONFIG_FILE
    stored = read_stored_config(path)
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
    branch = None
    if any(k in SCHEDULE_KEYS for k, _, _ in diffs):
        branch = schedule_branch(stored, cfg, Path(path).name, saved)
    lines, fixed, exact = judge(diffs, frozenset(allow), branch)
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


def schedule_branch(stored: dict, cfg, tag: str, saved: SavedBatch | None) -> str | None:
    """Why resuming checkpoint `tag` (saved under config `stored`) with `cfg`'s schedule is a branch:
    every update before the checkpoint's iteration had the rate `cfg`'s schedule gives it (a
    `train.lr_decay_style=wsd` decay that starts at or after it, say); None when one did not, or when
    the lengths need the parameter count (`train.chinchilla`)."""
    from megatron_lev.ckpt.layout import iteration_of
    from megatron_lev.config import TrainConfig
    from megatron_lev.config.load import from_dict
    from megatron_lev.errors import ConfigError
    from megatron_lev.training.schedule import learning_rate, training_budget

    iteration = iteration_of(tag)
    try:
        old_train = from_dict(TrainConfig, stored.get("train"), "train")
    except ConfigError:
        return None
    new_train = cfg.train
    if iteration is None or old_train.chinchilla or new_train.chinchilla:
        return None
    seq = cfg.model.seq_length
    batch = saved.global_batch if saved is not None else new_train.global_batch_size
    if batch is None:
        return None
    old_total = training_budget(old_train, batch, seq, 0).train_iters
    new_total = training_budget(new_train, batch, seq, 0).train_iters
    for i in range(iteration):
        a, b = learning_rate(i, old_train, old_total), learning_rate(i, new_train, new_total)
        if abs(a - b) > 1e-12 * max(abs(a), abs(b)):
            return None
    return (
        f"a branch: the {iteration:,} updates before the checkpoint had the rates this schedule gives "
        f"them; it differs from iteration {iteration:,} on"
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
