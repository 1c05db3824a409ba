"""Warm start (`train.init_from`): a run's first weights from a Hugging Face Llama directory or from a
checkpoint (a tag directory, or a save directory's latest), weights only: a fresh optimizer, iteration
0 and the run's own schedule (Megatron's `--finetune --no-load-optim`).

    record = warm_start(model, cfg, layout, vocab)   # before the engine copies the weights (ZeRO)

Each full tensor is cut to this rank's tensor-parallel shard and copied into the (plain or pipeline)
model, as `convert.reshard` does. What would not be the same function is refused in one line: another
model shape or variant (the checkpoint's stored config against the run's, or the Hugging Face config's
sizes), another vocabulary than the run's tokenizer, a LEV run from a dense Hugging Face table. The
returned record (what was loaded) goes into the run's provenance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_lev.config import RunConfig
from megatron_lev.errors import ConfigError
from megatron_lev.parallel.layout import ParallelLayout

HF_SIZES = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "kv_heads",
    "ffn_size",
    "rope_theta",
    "norm_eps",
)


def warm_start(model: torch.nn.Module, cfg: RunConfig, layout: ParallelLayout, vocab: int) -> dict[str, Any]:
    """Copy `cfg.train.init_from`'s weights into `model`; returns the record of what was loaded."""
    source = Path(cfg.train.init_from)
    if not source.exists():
        raise ConfigError(
            f"train.init_from={source}: no such file or directory; give a Hugging Face model directory "
            "or a checkpoint (tag directory, or a save directory for its latest)"
        )
    if (source / "config.json").is_file() and not any(source.glob("*model_states.pt")):
        tensors, record = _from_hf(source, cfg, vocab)
    else:
        tensors, record = _from_checkpoint(source, cfg, vocab)
    from megatron_lev.convert.reshard import fill_from_tensors

    fill_from_tensors(model, tensors, cfg, layout, vocab, f"train.init_from={source}")
    return record


def _from_checkpoint(source: Path, cfg: RunConfig, vocab: int):
    from megatron_lev.ckpt.record import find_run_config, model_differences
    from megatron_lev.convert.source import iter_canonical, open_tag
    from megatron_lev.engine.checkpoint_files import resolve_tag_dir

    tag_dir = resolve_tag_dir(source)
    stored = find_run_config(tag_dir)
    diffs = model_differences(stored, cfg)
    if diffs:
        listed = "; ".join(diffs[:3])
        raise ConfigError(
            f"train.init_from={source}: the checkpoint's model differs from this run's ({listed}): set the "
            "run's model keys to the checkpoint's, or start from another checkpoint"
        )
    src = open_tag(tag_dir, stored)
    if src.vocab_size != vocab:
        raise ConfigError(
            f"train.init_from={source}: the checkpoint was trained on a vocabulary of {src.vocab_size:,}, "
            f"this run's tokenizer has {vocab:,}: use the checkpoint's tokenizer (data.tokenizer_path)"
        )
    record = {"kind": "checkpoint", "path": str(tag_dir.resolve()), "tag": tag_dir.name}
    return iter_canonical(src, progress=False), record


def _from_hf(source: Path, cfg: RunConfig, vocab: int):
    from megatron_lev.convert.hf_import import import_hf_llama
    from megatron_lev.model.embeddings import embedding_class

    theirs = json.loads((source / "config.json").read_text())
    if cfg.model.embedding not in ("tied", "untied"):
        raise ConfigError(
            f"train.init_from={source} is a Hugging Face model (a dense input table): it starts "
            f"model.embedding=tied or untied, not {cfg.model.embedding!r}"
        )
    model, their_cfg = import_hf_llama(source, cfg.model.make_vocab_size_divisible_by)
    tied = bool(theirs.get("tie_word_embeddings", False))
    if tied != embedding_class(cfg.model.embedding).ties_output_head:
        raise ConfigError(
            f"train.init_from={source} has tie_word_embeddings={str(tied).lower()}: start "
            f"model.embedding={'tied' if tied else 'untied'} from it, not {cfg.model.embedding!r}"
        )
    wrong = [
        f"{key} {getattr(their_cfg, key)} there, {getattr(cfg.model, key)} here"
        for key in HF_SIZES
        if getattr(their_cfg, key) != getattr(cfg.model, key)
    ]
    if wrong:
        raise ConfigError(
            f"train.init_from={source}: another model shape ({'; '.join(wrong)}): set model.* to the Hugging "
            "Face config's"
        )
    if their_cfg.vocab_size != vocab:
        raise ConfigError(
            f"train.init_from={source}: its vocabulary is {their_cfg.vocab_size:,}, this run's tokenizer has "
            f"{vocab:,}: use the model's tokenizer (data.tokenizer_path)"
        )
    record = {"kind": "huggingface", "path": str(source.resolve())}
    return model.state_dict().items(), record
