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


def evaluate_model(model_fn: Callable, name: str, data_prefixes: list[str] = (), text_paths: list[str] = (),
                   tokenizer: TextTokenizer | None = None, counts: np.ndarray | None = None,
                   edges: tuple[float, ...] = DEFAULT_EDGES, seq_len: int = 1024, batch_size: int = 4,
                   max_docs: int | None = None, device: str = "cpu", returns_loss: bool = False,
                   progress: bool = True) -> list[dict]:
    """One result per held-out shard and per text corpus (frequency buckets when `counts` is given)."""
    results = []
    for prefix in data_prefixes:
        batches = sequence_batches(indexed_documents(prefix, max_docs), seq_len, batch_size)
        losses = per_token_losses(batches, model_fn, returns_loss=returns_loss, device=device,
                                  progress=progress)
        results.append(evaluation_result(losses, name, counts, edges, corpus=str(prefix),
                                         corpus_kind="mmidx", seq_len=seq_len))
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
