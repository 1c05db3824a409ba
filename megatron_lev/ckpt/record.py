"""What a checkpoint records about the run that saved it, read in one place.

A trainer checkpoint holds, besides the engine's files, the run's resolved config (`config.yaml`,
in the tag directory and in the run's output directory) and the `complete` marker with the world
size (`ckpt.layout`). From them this module reads:

- the stored config: its file (`stored_config_path`), its mapping (`read_stored_config`) and the
  `RunConfig` a converter uses (`find_run_config`, which refuses a `--config` describing another
  model: `model_differences`);
- how the checkpoint's steps were made (`saved_batch`: data-parallel size, global batch,
  micro-batch), from the stored config and the marker;
- the tokenizer fingerprint an older run recorded in its config (`stored_tokenizer`; a newer
  checkpoint records it in `provenance.json`, `ckpt.provenance`).

A record that exists but cannot be read is refused with one line naming the file and what to do
(`read_record`); a missing one is None, since older versions saved less. Nothing here knows which
engine wrote the checkpoint or how a run resumes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_lev.ckpt.layout import CONFIG_FILE, read_marker
from megatron_lev.config import RunConfig, load_config
from megatron_lev.errors import CheckpointDataError


class CheckpointError(CheckpointDataError):
    """The checkpoint is missing, incomplete or corrupted; the message names the file."""


def read_record(path: str | os.PathLike, remedy: str) -> Any | None:
    """The parsed content of record file `path` (JSON for a `.json` file, else YAML); None when it
    does not exist. One that cannot be read or parsed raises CheckpointDataError, one line:
    `<path> is unreadable (<why>); <remedy>`."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        raise CheckpointDataError(f"{path} is unreadable ({exc}); {remedy}") from None


# ------------------------------------------------------------------ the stored config


def config_beside(directory: str | os.PathLike) -> Path | None:
    """The run config saved in `directory` (a tag directory or a run's output directory), if any."""
    path = Path(directory) / CONFIG_FILE
    return path if path.is_file() else None


def stored_config_path(tag_dir: Path) -> Path | None:
    """The config the trainer saved with this checkpoint (tag dir, then the save dir), if any."""
    return config_beside(tag_dir) or config_beside(tag_dir.parent)


def read_stored_config(tag_dir: str | os.PathLike) -> dict | None:
    """The config mapping stored in checkpoint `tag_dir` (None when it has none: an older version)."""
    stored_file = Path(tag_dir) / CONFIG_FILE
    if not stored_file.is_file():
        return None
    stored = read_record(stored_file, "restore it from the run's output directory or remove the checkpoint")
    if not isinstance(stored, dict):
        raise CheckpointDataError(
            f"{stored_file} is not a config mapping; restore it or remove the checkpoint"
        )
    return stored


# model keys that change training only (memory, regularisation, init), not the function a checkpoint computes
TRAINING_ONLY_MODEL_KEYS = {
    "name",
    "activation_checkpointing",
    "checkpoint_num_layers",
    "fused_loss",
    "recompute_attention",
    "compile",
    "loss_chunk_tokens",
    "hidden_dropout",
    "attention_dropout",
    "init_std",
    "lev.chunk_size",
    "lev.recompute",
    "lev.w_out_init_scale",
    "lev.id_order_seed",  # the token order they made is stored in the checkpoint (`id_rank`)
    "lev.id_order_counts",
    "input_init_rms",
}


def model_differences(stored: RunConfig, given: RunConfig) -> list[str]:
    """`model.<key>: <stored> (checkpoint) != <given>` for every key that changes what the model computes."""

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(stored.to_dict()["model"]), flat(given.to_dict()["model"])
    return [
        f"model.{k}: {a.get(k)!r} in the checkpoint != {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k not in TRAINING_ONLY_MODEL_KEYS and a.get(k) != b.get(k)
    ]


def find_run_config(tag_dir: Path, config: str | os.PathLike | None = None) -> RunConfig:
    """The run config saved with the checkpoint (tag dir, then the save dir), or `config` if given.

    A given `config` whose model differs from the stored one is refused with the differences:
    converting with another rope_theta or norm_eps gives a model that is not the trained one.
    """
    stored = stored_config_path(tag_dir)
    if config:
        given = load_config([Path(config)])
        if stored is not None and Path(config).resolve() != stored.resolve():
            diffs = model_differences(load_config([stored]), given)
            if diffs:
                raise CheckpointError(
                    f"--config {config} describes another model than the checkpoint's "
                    f"{stored}: {'; '.join(diffs)}; drop --config to use the checkpoint's own"
                )
        return given
    if stored is not None:
        return load_config([stored])
    raise CheckpointError(
        f"no {CONFIG_FILE} beside the checkpoint (looked in {tag_dir} and {tag_dir.parent}); "
        "pass --config with the run's resolved config"
    )


# ------------------------------------------------------------------ how its steps were made


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


def saved_batch(path: str | os.PathLike, stored: dict | None = None) -> SavedBatch | None:
    """The data-parallel size and global batch checkpoint `path` was trained with, from its stored
    config and the world size in its `complete` marker; None when either is missing or unreadable."""
    path = Path(path)
    if stored is None:
        try:
            stored = read_stored_config(path)
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


# ------------------------------------------------------------------ the tokenizer an older run recorded


def stored_tokenizer(stored_config: Path | None) -> dict | None:
    """A tokenizer fingerprint (a mapping with `sha256`) the run recorded in its config.yaml, if any."""
    if stored_config is None:
        return None
    try:
        data = (read_record(stored_config, "") or {}).get("data") or {}
    except (CheckpointDataError, AttributeError):
        return None
    for key in ("tokenizer", "tokenizer_fingerprint"):
        if isinstance(data.get(key), dict) and data[key].get("sha256"):
            return data[key]
    if isinstance(data.get("tokenizer_sha256"), str):
        return {"sha256": data["tokenizer_sha256"], "file": Path(str(data.get("tokenizer_path"))).name}
    return None


__all__ = [
    "CheckpointError",
    "SavedBatch",
    "TRAINING_ONLY_MODEL_KEYS",
    "config_beside",
    "find_run_config",
    "model_differences",
    "read_record",
    "read_stored_config",
    "saved_batch",
    "stored_config_path",
    "stored_tokenizer",
]
