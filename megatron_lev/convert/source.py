"""A training checkpoint of any layout as a stream of full, canonically named tensors.

    src = open_checkpoint("runs/x/checkpoints")          # latest complete tag
    for name, tensor in iter_canonical(src): ...         # "layers.0.attention.qkv.weight", ...

Files are read one at a time (pipeline: one layer's TP shards; plain/ZeRO-3: one TP
rank after the other) and each tensor is dropped once merged, so memory stays around
one copy of the model. TP shards are merged with the model's own rules (fused
QKV / gate-up parts, vocabulary rows); a pipeline's layer files already hold canonical
names (each stage registers its parameters under its `GPTModel` prefix, `model.stages`);
ZeRO-3 weights are gathered from their fp32 partitions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lev.ckpt.layout import COMPLETE_MARKER, iteration_of
from megatron_lev.ckpt.record import find_run_config
from megatron_lev.config import RunConfig
from megatron_lev.convert.merge import merge_shards
from megatron_lev.engine.checkpoint_files import (
    CheckpointError,
    CheckpointFiles,
    find_files,
    load_file,
    plain_module_state,
    resolve_tag_dir,
    zero3_module_state,
)
from megatron_lev.model.canonical import ParamSpec, canonical_state_dict_spec
from megatron_lev.model.embeddings import InputEmbedding, embedding_class
from megatron_lev.model.stages import stage_specs
from megatron_lev.model.vocab import base_vocab_size, padded_vocab_size
from megatron_lev.plan.spec import ModelSpec
from megatron_lev.utils.progress import progress_bar


@dataclass
class SourceCheckpoint:
    tag_dir: Path
    files: CheckpointFiles
    cfg: RunConfig
    vocab_size: int  # the tokenizer's (what an export keeps)
    padded_vocab: int  # the model's rows (vocab padded for the source TP size)
    specs: dict[str, ParamSpec]

    @property
    def base_vocab(self) -> int:
        """The vocabulary padded as for one process (`model.vocab.base_vocab_size`): LEV's codebooks,
        reference ids and token order, whatever the source TP size."""
        return base_vocab_size(self.padded_vocab, self.vocab_size, self.cfg.model)

    @property
    def model_spec(self) -> ModelSpec:
        """The source model at TP = PP = 1 (`engine.build.build_model`): its config's model with the
        checkpoint's padded rows, the loss keeping the tokenizer's."""
        return ModelSpec(self.cfg.model, self.padded_vocab, self.vocab_size)

    @property
    def num_layers(self) -> int:
        return self.cfg.model.num_layers

    @property
    def embedding(self) -> type[InputEmbedding]:
        """The class of the checkpoint's input-embedding variant (what it ties, what it exports)."""
        return embedding_class(self.cfg.model.embedding)

    def layer_state(self, path: Path) -> dict[str, torch.Tensor]:
        """One pipeline layer file of this checkpoint, by canonical name (`load_layer_file`)."""
        return load_layer_file(path, self.specs)

    def shared_layers(self) -> dict[int, int]:
        """{pipeline layer: the first layer holding the same module} for the layers of a shared (tied)
        stage: the last stage's copy of a tied table is read from the first stage's file."""
        first: dict[str, int] = {}
        out = {}
        for idx, spec in enumerate(stage_specs(self.cfg.model, self.padded_vocab, self.cfg.train.seed)):
            if spec.tied_key is not None:
                out[idx] = first.setdefault(spec.tied_key, idx)
        return out


def open_checkpoint(
    path: str | os.PathLike,
    tag: str | None = None,
    config: str | os.PathLike | None = None,
    vocab_size: int | None = None,
) -> SourceCheckpoint:
    """Locate the shard files, the run config and the vocabulary; check the checkpoint is complete."""
    tag_dir = resolve_tag_dir(path, tag)
    return open_tag(tag_dir, find_run_config(tag_dir, config), vocab_size)


def open_tag(tag_dir: Path, cfg: RunConfig, vocab_size: int | None = None) -> SourceCheckpoint:
    """`open_checkpoint` for a tag directory and run config already resolved (an export resolves
    them first, for its output checks and the tokenizer)."""
    trainer_layout = iteration_of(tag_dir.name) is not None or any(
        tag_dir.parent.glob(f"*/{COMPLETE_MARKER}")
    )
    if trainer_layout and not (tag_dir / COMPLETE_MARKER).is_file():
        raise CheckpointError(
            f"{tag_dir} has no '{COMPLETE_MARKER}' marker: the save was interrupted; convert an "
            "earlier complete tag (--tag)"
        )
    files = find_files(tag_dir)
    cfg_tp = cfg.parallel.tensor_model_parallel_size
    if files.tp != cfg_tp:
        raise CheckpointError(
            f"{tag_dir} holds {files.tp} tensor-parallel shard(s) but its config says "
            f"parallel.tensor_model_parallel_size={cfg_tp}"
        )
    if files.kind == "pipeline" and cfg.parallel.pipeline_model_parallel_size == 1:
        raise CheckpointError(
            f"{tag_dir} is a pipeline checkpoint but its config says parallel.pipeline_model_parallel_size=1"
        )
    vocab = vocab_size or _vocab_size(cfg)
    padded = padded_vocab_size(vocab, cfg.model, cfg_tp)
    specs = canonical_state_dict_spec(cfg.model, padded, true_vocab_size=vocab)
    if files.kind == "pipeline":  # refuse an older layout before reading anything large
        load_layer_file(
            min((r[0] for r in files.layer_files.values()), key=lambda p: p.stat().st_size), specs
        )
    return SourceCheckpoint(tag_dir, files, cfg, vocab, padded, specs)


def load_layer_file(path: Path, specs: dict[str, ParamSpec]) -> dict[str, torch.Tensor]:
    """One pipeline layer file, whose keys are canonical names; a file of the older layout (names
    relative to the layer, e.g. `attention.qkv.weight`) is refused."""
    state = load_file(path)
    roots = {name.split(".", 1)[0] for name in specs}
    stray = [key for key in state if key.split(".", 1)[0] not in roots]
    if stray:
        raise CheckpointError(
            f"{path} holds {stray[0]!r}, not a canonical parameter name: this checkpoint was written by "
            "an older megatron-lev (pipeline layer files without canonical names); convert it with that "
            "version"
        )
    return state


def _vocab_size(cfg: RunConfig) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    path = cfg.data.tokenizer_path
    if not path or not Path(path).is_file():
        raise CheckpointError(
            f"cannot tell the vocabulary size: model.vocab_size is unset and the tokenizer "
            f"(data.tokenizer_path={path!r}) is not found; pass --vocab-size or --tokenizer"
        )
    from megatron_lev.data.tokenizers import build_tokenizer

    return build_tokenizer(cfg.data.tokenizer_type, path).vocab_size


def iter_canonical(src: SourceCheckpoint, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(canonical name, full tensor)` for every parameter, in model order; checks none is missing."""
    seen: set[str] = set()
    bar = progress_bar(
        total=len(src.specs),
        desc=f"merging {src.files.kind} TP={src.files.tp}",
        unit="tensor",
        disable=not progress,
    )
    stream = _pipeline(src) if src.files.kind == "pipeline" else _per_rank(src)
    for name, tensor in stream:
        if name not in src.specs:
            raise CheckpointError(
                f"{src.tag_dir}: parameter {name!r} is not in the model built from config.yaml "
                f"(model.embedding={src.cfg.model.embedding!r}); wrong config?"
            )
        if name in seen:
            continue
        seen.add(name)
        bar.update(1)
        yield name, tensor
    bar.close()
    missing = [n for n in src.specs if n not in seen]
    if missing:
        raise CheckpointError(
            f"{src.tag_dir}: {len(missing)} parameter(s) missing from the checkpoint, e.g. "
            f"{missing[:3]}: the checkpoint is incomplete or from another model"
        )


def _pipeline(src: SourceCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    shared = src.shared_layers()
    for idx, by_rank in sorted(src.files.layer_files.items()):
        if shared.get(idx, idx) != idx:
            continue  # a second copy of a tied table (kept identical by DeepSpeed)
        shards = [load_layer_file(by_rank[r], src.specs) for r in range(src.files.tp)]
        for name in list(shards[0]):
            parts = [s.pop(name) for s in shards]
            if name in src.specs:
                parts = [merge_shards(parts, src.specs[name])]
            yield name, parts[0]
        del shards


def _per_rank(src: SourceCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    read = plain_module_state if src.files.kind == "plain" else zero3_module_state
    states = [read(src.files, r) for r in range(src.files.tp)]  # each holds 1/TP of the model
    for key in list(states[0]):
        parts = [s.pop(key) for s in states]
        if key in src.specs:
            parts = [merge_shards(parts, src.specs[key])]
        yield key, parts[0]


def load_canonical_state(src: SourceCheckpoint, progress: bool = True) -> dict[str, torch.Tensor]:
    """The whole merged state dict (one copy of the model in memory)."""
    return dict(iter_canonical(src, progress))
