"""Evaluate a model (any `model_fn`) on held-out MMIDIDX shards and on text corpora."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from megatron_lev.analysis.corpora import TextTokenizer, TokenizedCorpus, indexed_documents, sequence_batches
from megatron_lev.analysis.perplexity import DEFAULT_EDGES, RecordLengths, evaluation_result, per_token_losses
from megatron_lev.errors import DataError, UserError


def read_hf_config(model_dir: str | Path) -> dict:
    """config.json of a Hugging Face model directory; a missing or unreadable one is named."""
    import json

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise DataError(
            f"{model_dir}: not a Hugging Face model directory (no config.json) and not a training "
            "checkpoint; pass an exported model directory or a checkpoint save directory"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a JSON model config ({exc}); re-export the model") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON model config (top level is {type(config).__name__})")
    return config


def hf_model_fn(
    model_dir: str | Path, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False
) -> Callable:
    """`input_ids (B, S) -> logits (B, S, V)` for an exported Hugging Face causal LM.

    A model that ships its own code (`auto_map` in config.json, e.g. a `--keep-lev` export) is
    only run with `trust_remote_code`: that code runs in this process.
    """
    from transformers import AutoModelForCausalLM

    from megatron_lev.utils.progress import hf_bars_off_a_terminal

    hf_bars_off_a_terminal()

    config = read_hf_config(model_dir)
    if config.get("auto_map") and not trust_remote_code:
        code = sorted(p.name for p in Path(model_dir).glob("*.py")) or ["its auto_map classes"]
        raise UserError(
            f"{model_dir} ships its own model code ({', '.join(code)}; e.g. a --keep-lev export): "
            "pass --trust-remote-code to run it, only if you trust that code"
        )
    check_weight_files(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )
    except pickle.UnpicklingError:
        raise DataError(_pickled_weights(Path(model_dir))) from None
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        bad = _failing_bin(Path(model_dir)) if isinstance(exc, RuntimeError) else None
        if bad is not None:
            raise DataError(
                f"{bad}: not a readable PyTorch weights file ({str(exc).strip().splitlines()[0][:150]}): "
                "it is truncated or damaged; copy or export the model again (megatron-lev convert)"
            ) from None
        raise DataError(
            f"{model_dir}: transformers cannot load this model: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        ) from None
    model.to(device).eval()
    return lambda ids: model(input_ids=ids).logits


def check_weight_files(model_dir: str | Path) -> None:
    """Refuse a `*.safetensors` file of a model directory whose header cannot be read (truncated,
    garbled, not safetensors), naming the file; only the headers are read."""
    from safetensors import safe_open

    for file in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as fh:
                fh.keys()
        except Exception as exc:  # safetensors raises its own SafetensorError (and OSError)
            raise DataError(
                f"{file}: not a readable safetensors file ({str(exc).strip()[:200]}): it is truncated "
                "or damaged; copy or export the model again (megatron-lev convert)"
            ) from None


def _failing_bin(model_dir: Path) -> Path | None:
    """The first `pytorch_model*.bin` of `model_dir` that does not load as plain tensors."""
    for file in sorted(model_dir.glob("pytorch_model*.bin")):
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - any failure marks the file to name
            return file
    return None


def _pickled_weights(model_dir: Path) -> str:
    """The message for a directory whose `pytorch_model*.bin` holds pickled objects besides tensors
    (transformers loads them with `weights_only=True` and refuses): it names the file."""
    culprit = _failing_bin(model_dir) or model_dir / "pytorch_model*.bin"
    return (
        f"{culprit}: a pickled PyTorch file holding Python objects besides tensors; refused to unpickle "
        "it (that can run code from the file). Use the model's safetensors weights (save it with "
        "safe_serialization=True where it came from) or export a training checkpoint with "
        "`megatron-lev convert`"
    )


def checkpoint_model_fn(
    checkpoint: str | Path, tag: str | None = None, device: str = "cpu"
) -> tuple[Callable, int, int]:
    """`input_ids -> logits` of a training checkpoint of any TP x PP x ZeRO layout, its sequence length
    and vocabulary size.

    The shards are merged into the TP = 1 model; logits keep the tokenizer's vocabulary only
    (padding rows dropped), exactly as an export does, so both give the same numbers.
    """
    from megatron_lev.convert.hf_export import source_model
    from megatron_lev.convert.source import open_checkpoint

    src = open_checkpoint(checkpoint, tag)
    model = source_model(src, progress=False).to(device)
    vocab = src.vocab_size
    return (lambda ids: model(ids)[..., :vocab]), src.cfg.model.seq_length, vocab


def is_hf_model_dir(path: str | Path) -> bool:
    return (Path(path) / "config.json").is_file()


def hf_sequence_length(model_dir: str | Path) -> int:
    return int(read_hf_config(model_dir).get("max_position_embeddings") or 1024)


def hf_vocab_size(model_dir: str | Path) -> int | None:
    config = read_hf_config(model_dir)
    vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    return int(vocab) if isinstance(vocab, int) else None


def _checked(batches: Iterator[torch.Tensor], source: str, vocab_size: int | None) -> Iterator[torch.Tensor]:
    """The batches, refusing a corpus with no window to evaluate or ids the model has no row for."""
    n = 0
    for batch in batches:
        n += 1
        top = int(batch.max())
        if vocab_size is not None and top >= vocab_size:
            raise DataError(
                f"{source}: token id {top} >= the model's vocabulary of {vocab_size}: the corpus was "
                "tokenized with another tokenizer than the model's; use the model's tokenizer"
            )
        yield batch
    if n == 0:
        raise DataError(
            f"{source}: no tokens to evaluate (empty, or fewer than 2 tokens); give a corpus with text"
        )


def _losses(batches, model_fn, **kwargs):
    """`per_token_losses`, closing its progress bar on an error so the error stays the last line."""
    try:
        return per_token_losses(batches, model_fn, **kwargs)
    except BaseException:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
        raise


def _finite(result: dict, source: str) -> dict:
    if not math.isfinite(result["mean_nll"]):
        raise DataError(
            f"{source}: the evaluation gave a non-finite perplexity ({result['mean_nll']} mean NLL): "
            "the model's weights or logits are not finite; evaluate an earlier checkpoint"
        )
    return result


def evaluate_model(
    model_fn: Callable,
    name: str,
    data_prefixes: list[str] = (),
    text_paths: list[str] = (),
    tokenizer: TextTokenizer | None = None,
    counts: np.ndarray | None = None,
    edges: tuple[float, ...] = DEFAULT_EDGES,
    seq_len: int = 1024,
    batch_size: int = 4,
    max_docs: int | None = None,
    device: str = "cpu",
    returns_loss: bool = False,
    progress: bool = True,
    split: tuple[str, str] | None = None,
    vocab_size: int | None = None,
) -> list[dict]:
    """One result per held-out shard and per text corpus (frequency buckets when `counts` is given).

    `split=(part, spec)` evaluates only that part of each shard's documents, as the trainer splits them.
    `vocab_size`: the model's; a corpus with larger ids is refused (another tokenizer). A corpus
    with nothing to evaluate, or a non-finite result, is refused too.
    """

    def measure(records: Iterable[np.ndarray], source: str) -> dict:
        """The finite result of one corpus: an MMIDIDX shard's documents or a `TokenizedCorpus`."""
        docs = RecordLengths(records)  # per-document sums (bootstrap)
        batches = _checked(sequence_batches(docs, seq_len, batch_size), source, vocab_size)
        losses = _losses(batches, model_fn, returns_loss=returns_loss, device=device, progress=progress)
        fields = {"corpus_kind": "mmidx"}
        if isinstance(records, TokenizedCorpus):  # bytes and documents, counted while it was read
            fields = {
                "n_bytes": records.n_bytes,
                "tokenizer": tokenizer.name,
                "corpus_kind": "text",
                "documents": records.n_docs,
            }
        result = evaluation_result(
            losses, name, counts, edges, corpus=source, **fields, seq_len=seq_len, doc_lengths=docs.lengths
        )
        return _finite(result, source)

    results = []
    for prefix in data_prefixes:
        results.append(measure(indexed_documents(prefix, max_docs, split), str(prefix)))
        if split is not None:
            results[-1]["split"] = {"part": split[0], "spec": split[1]}
    for path in text_paths:
        if tokenizer is None:
            raise UserError("evaluating a text corpus needs a tokenizer (--tokenizer)")
        results.append(measure(TokenizedCorpus([path], tokenizer, max_docs), str(path)))
    return results


def evaluate_zero_shot(
    model_fn: Callable,
    name: str,
    tokenizer: TextTokenizer,
    lambada: dict[str, list] | None = None,
    wikitext: dict[str, list] | None = None,
    seq_len: int = 1024,
    batch_size: int = 4,
    device: str = "cpu",
    stride: int | None = None,
    detokenize: bool = False,
    progress: bool = True,
    vocab_size: int | None = None,
) -> list[dict]:
    """One result per LAMBADA file (`{path: passages}`, from `data.zero_shot_formats.read_lambada`) and per
    Wikitext file (`{path: documents}`, from `split_wikitext`); a non-finite result is refused."""
    from megatron_lev.analysis.zero_shot import evaluate_lambada, evaluate_wikitext

    common = dict(batch_size=batch_size, device=device, vocab_size=vocab_size, progress=progress)
    results = []
    for path, passages in (lambada or {}).items():
        res = evaluate_lambada(model_fn, passages, tokenizer, seq_len, source=str(path), **common)
        results.append(_finite({"name": name, **res, "corpus": str(path), "corpus_kind": "lambada"}, path))
    for path, docs in (wikitext or {}).items():
        res = evaluate_wikitext(
            model_fn, docs, tokenizer, seq_len, stride, detokenize, source=str(path), **common
        )
        results.append(_finite({"name": name, **res, "corpus": str(path), "corpus_kind": "wikitext"}, path))
    return results
