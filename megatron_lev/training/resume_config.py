"""Which config keys may differ between a checkpoint and the run that resumes it.

Three kinds of key. FREE keys (budget, intervals, logging, paths, memory knobs)
change nothing a checkpoint holds and may differ. FIXED keys (the model, the
parallel layout, precision) describe the saved weights and optimizer states: a
resume with other values would load them into the wrong shapes or meanings, so it
is refused. Every other key (seeds, data, batch sizes, optimizer settings) breaks
an exact resume: refused unless the user names it with `--allow-change KEY`.

A few `model.*` keys change neither the shapes nor the meaning of the saved weights:
dropout rates and initialisation scales (used only before the first step) are free,
and `model.seq_length` (rotary positions: no weight depends on it) is allowed with
`--allow-change`, since the data is then cut into other samples.
"""

from __future__ import annotations

from typing import Any

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
        "data.num_workers",
        "data.cache_dir",
        "parallel.distributed_backend",
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
        "model.input_init_rms",
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
        elif kind == "exact" and key not in allow:
            exact.append(key)
            verdict = f"refused: the resume would not be exact; pass --allow-change {key} to accept"
        else:
            verdict = "allowed" if kind == "free" else "allowed by --allow-change"
        lines.append(f"  {key}: {old!r} -> {new!r} ({verdict})")
    return lines, fixed, exact
