"""Evaluate a model (any `model_fn`) on held-out MMIDIDX shards and on text corpora."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from megatron_lev.analysis.corpora import TextTokenizer, TokenizedCorpus, indexed_documents, sequence_batches
from megatron_lev.analysis.perplexity import DEFAULT_EDGES, evaluation_result, per_token_losses


def hf_model_fn(model_dir: str | Path, device: str = "cpu", dtype: str = "float32") -> Callable:
    """`input_ids (B, S) -> logits (B, S, V)` for an exported Hugging Face causal LM."""
    from transformers import AutoModelForCausalLM

    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"{model_dir}: not a Hugging Face model directory")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.to(device).eval()
    return lambda ids: model(input_ids=ids).logits


def checkpoint_model_fn(checkpoint: str | Path, tag: str | None = None, device: str = "cpu") -> tuple[Callable, int]:
    """`input_ids -> logits` of a training checkpoint of any TP x PP x ZeRO layout, and its sequence length.

    The shards are merged into the TP = 1 model; logits keep the tokenizer's vocabulary only
    (padding rows dropped), exactly as an export does, so both give the same numbers.
    """
    from megatron_lev.checkpoint.hf_export import source_model
    from megatron_lev.checkpoint.source import open_checkpoint

    src = open_checkpoint(checkpoint, tag)
    model = source_model(src, progress=False).to(device)
    vocab = src.vocab_size
    return (lambda ids: model(ids)[..., :vocab]), src.cfg.model.seq_length


def is_hf_model_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def hf_sequence_length(model_dir: str | Path) -> int:
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 1024)


def evaluate_model(model_fn: Callable, name: str, data_prefixes: list[str] = (), text_paths: list[str] = (),
                   tokenizer: TextTokenizer | None = None, counts: np.ndarray | None = None,
                   edges: tuple[float, ...] = DEFAULT_EDGES, seq_len: int = 1024, batch_size: int = 4,
                   max_docs: int | None = None, device: str = "cpu", returns_loss: bool = False,
                   progress: bool = True, split: tuple[str, str] | None = None) -> list[dict]:
    """One result per held-out shard and per text corpus (frequency buckets when `counts` is given).

    `split=(part, spec)` evaluates only that part of each shard's documents, as the trainer splits them.
    """
    results = []
    for prefix in data_prefixes:
        batches = sequence_batches(indexed_documents(prefix, max_docs, split), seq_len, batch_size)
        losses = per_token_losses(batches, model_fn, returns_loss=returns_loss, device=device,
                                  progress=progress)
        results.append(evaluation_result(losses, name, counts, edges, corpus=str(prefix),
                                         corpus_kind="mmidx", seq_len=seq_len))
        if split is not None:
            results[-1]["split"] = {"part": split[0], "spec": split[1]}
    for path in text_paths:
        if tokenizer is None:
            raise ValueError("evaluating a text corpus needs a tokenizer (--tokenizer)")
        corpus = TokenizedCorpus([path], tokenizer, max_docs)
        losses = per_token_losses(sequence_batches(corpus, seq_len, batch_size), model_fn,
                                  returns_loss=returns_loss, device=device, progress=progress)
        results.append(evaluation_result(losses, name, counts, edges, n_bytes=corpus.n_bytes,
                                         tokenizer=tokenizer.name, corpus=str(path), corpus_kind="text",
                                         documents=corpus.n_docs, seq_len=seq_len))
    return results
