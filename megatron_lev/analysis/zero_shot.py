"""Zero-shot evaluations of the paper beside perplexity: LAMBADA last-word prediction and
document-level Wikitext-103 perplexity, for any `model_fn(input_ids) -> logits`.

Both follow lm-eval's definitions so the numbers compare with its `lambada_openai` and
`wikitext` tasks:

- LAMBADA: the passage's context and target (" " + last word) are tokenized as lm-eval does
  for a causal model (the whole passage, then the context alone; the target's tokens are what
  follows the context's). A context longer than the window keeps its last tokens. `acc` is the
  share of passages whose greedy continuation is exactly the target's tokens; `perplexity` is
  `exp` of the mean over passages of the target's total NLL.
- Wikitext: each article is one token stream, prefixed with the end-of-text token so its first
  token is scored too. Windows of S tokens roll through it; the first scores S tokens and each
  later one the next `stride` (default S, no overlap), with the tokens before as context, so
  every token is scored once. Word perplexity = `exp(total NLL / words)`, words and bytes
  counted on the text as read (before detokenisation), as lm-eval does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from megatron_lev.analysis.corpora import TextTokenizer
from megatron_lev.data.zero_shot_formats import LambadaPassage, WikiDocument, wikitext_detokenize
from megatron_lev.errors import DataError


@dataclass
class _Row:
    """One forward input and the predictions scored on it: the last `len(targets)` positions."""

    inputs: list[int]
    targets: list[int]
    item: int  # index of the passage or document it belongs to


def _score_rows(
    rows: list[_Row], model_fn: Callable, batch_size: int, device: str, vocab_size: int | None, source: str
) -> Iterator[tuple[_Row, float, bool]]:
    """(row, total NLL of its targets, whether greedy decoding gives exactly its targets).

    Rows of a batch are right-padded; a causal model's logits at a position do not depend on
    later positions, so padding changes nothing that is scored.
    """
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            width = max(len(r.inputs) for r in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            for i, r in enumerate(batch):
                ids[i, : len(r.inputs)] = torch.tensor(r.inputs, dtype=torch.long)
            top = max(max(r.inputs) for r in batch)
            top = max(top, max(max(r.targets) for r in batch))
            if vocab_size is not None and top >= vocab_size:
                raise DataError(
                    f"{source}: token id {top} >= the model's vocabulary of {vocab_size}: the text was "
                    "tokenized with another tokenizer than the model's; use the model's tokenizer"
                )
            logits = model_fn(ids.to(device))  # (B, width, V)
            if logits.shape[:2] != ids.shape:
                raise ValueError(
                    f"model_fn returned logits {tuple(logits.shape)} for inputs {tuple(ids.shape)}"
                )
            for i, r in enumerate(batch):
                n, end = len(r.targets), len(r.inputs)
                scored = logits[i, end - n : end].float()  # (n, V)
                targets = torch.tensor(r.targets, dtype=torch.long, device=scored.device)
                nll = F.cross_entropy(scored, targets, reduction="sum").double().item()
                greedy = bool((scored.argmax(-1) == targets).all())
                yield r, nll, greedy


def _exp(x: float) -> float:
    """exp, inf where it overflows and nan for nan (a result a caller refuses, not a crash)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _progress(total: int, desc: str, enabled: bool):
    from megatron_lev.utils.progress import progress_bar

    return progress_bar(total=total, desc=desc, unit="seq", disable=not enabled)


# ----------------------------------------------------------------------------------------- LAMBADA


def lambada_tokens(
    passage: LambadaPassage, tokenizer: TextTokenizer, source: str = "lambada"
) -> tuple[list[int], list[int]]:
    """(context ids, target ids) as lm-eval encodes a pair for a causal model.

    The whole passage is encoded and the context alone; the target's ids are the passage's ids
    after as many as the context has. An empty context (a one-word passage) is the end-of-text
    token.
    """
    if not passage.context:
        if tokenizer.eos_id is None:
            raise DataError(
                f"{source}:{passage.line}: a one-word passage needs an end-of-text token to condition on, "
                f"and the tokenizer {tokenizer.name} has none"
            )
        return [tokenizer.eos_id], list(tokenizer.encode(passage.target))
    whole = list(tokenizer.encode(passage.context + passage.target))
    context = list(tokenizer.encode(passage.context))
    return context, whole[len(context) :]


def evaluate_lambada(
    model_fn: Callable,
    passages: list[LambadaPassage],
    tokenizer: TextTokenizer,
    seq_len: int,
    batch_size: int = 4,
    device: str = "cpu",
    vocab_size: int | None = None,
    source: str = "lambada",
    progress: bool = True,
) -> dict:
    """Accuracy and perplexity of the passages' last words; see the module docstring."""
    rows, truncated = [], 0
    for k, p in enumerate(passages):
        context, target = lambada_tokens(p, tokenizer, source)
        if not target:
            raise DataError(
                f"{source}:{p.line}: the last word {p.word!r} merges into the context's tokens "
                "(no token of its own to score)"
            )
        if len(target) > seq_len:
            raise DataError(
                f"{source}:{p.line}: the last word is {len(target)} tokens, more than the window of "
                f"{seq_len}; raise --seq-len"
            )
        seq = (context + target)[-(seq_len + 1) :]
        truncated += len(context) + len(target) > seq_len + 1
        rows.append(_Row(seq[:-1], target, k))
    nll = np.zeros(len(passages))
    hits = np.zeros(len(passages), dtype=bool)
    bar = _progress(len(rows), "lambada", progress)
    try:
        for row, total, greedy in _score_rows(rows, model_fn, batch_size, device, vocab_size, source):
            nll[row.item], hits[row.item] = total, greedy
            bar.update(1)
    finally:
        bar.close()
    n = len(passages)
    acc = float(hits.mean())
    mean_nll = float(nll.mean())
    return {
        "task": "lambada",
        "count": n,
        "acc": acc,
        "acc_stderr": math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else None,
        "perplexity": _exp(mean_nll),
        "mean_nll": mean_nll,
        "target_tokens": int(sum(len(r.targets) for r in rows)),
        "truncated": int(truncated),
        "seq_len": seq_len,
        "tokenizer": tokenizer.name,
        "per_document": {
            "unit": "passage",
            "count": n,
            "group": 1,
            "tokens": [1] * n,
            "nll_sum": nll.tolist(),
            "hits": hits.astype(int).tolist(),
            "note": "per passage: the last word's total NLL (nats) and whether the greedy continuation "
            "hit it; `tokens` is 1 per passage, as the perplexity averages over passages; the bootstrap of "
            "`megatron-lev compare` resamples these",
        },
        "normalisation": "acc: share of passages whose greedy continuation is exactly the last word's "
        "tokens; perplexity: exp of the mean over passages of the last word's total NLL (nats), as "
        f"lm-eval's lambada; contexts cut to the last {seq_len} tokens with the target",
    }


# ---------------------------------------------------------------------------------------- Wikitext


def rolling_windows(n: int, seq_len: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """Windows `(start, end, scored)` over a stream of `n` tokens: the inputs are `stream[start:end]`
    (at most `seq_len`) and the last `scored` of their predictions, of `stream[end - scored + 1 :
    end + 1]`, are counted.

    The first window scores as many tokens as fit; each later one the next `stride` (default
    `seq_len`), with the tokens before it as context, so every token but the first is scored
    exactly once.
    """
    stride = seq_len if stride is None else stride
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    out = []
    t0, t1 = 1, min(1 + seq_len, n)  # targets [t0, t1) of the stream
    while t0 < n:
        out.append((max(0, t1 - 1 - seq_len), t1 - 1, t1 - t0))
        t0, t1 = t1, min(t1 + stride, n)
    return out


def evaluate_wikitext(
    model_fn: Callable,
    documents: list[WikiDocument],
    tokenizer: TextTokenizer,
    seq_len: int,
    stride: int | None = None,
    detokenize: bool = False,
    batch_size: int = 4,
    device: str = "cpu",
    vocab_size: int | None = None,
    source: str = "wikitext",
    progress: bool = True,
) -> dict:
    """Word / byte / token perplexity of whole articles scored as streams; see the module docstring."""
    rows, words, n_bytes = [], 0, 0
    for k, doc in enumerate(documents):
        ids = list(tokenizer.encode(wikitext_detokenize(doc.text) if detokenize else doc.text))
        stream = ([tokenizer.eos_id] if tokenizer.eos_id is not None else []) + ids
        for start, end, scored in rolling_windows(len(stream), seq_len, stride):
            rows.append(_Row(stream[start:end], stream[end - scored + 1 : end + 1], k))
        words += doc.words
        n_bytes += doc.bytes
    if not rows:
        raise DataError(f"{source}: no tokens to evaluate; give a Wikitext file with text")
    total, tokens = 0.0, 0
    bar = _progress(len(rows), "wikitext", progress)
    try:
        for row, nll, _ in _score_rows(rows, model_fn, batch_size, device, vocab_size, source):
            total += nll
            tokens += len(row.targets)
            bar.update(1)
    finally:
        bar.close()
    word_ppl = _exp(total / words) if words else math.nan
    return {
        "task": "wikitext",
        "documents": len(documents),
        "tokens": tokens,
        "words": words,
        "bytes": n_bytes,
        "total_nll": total,
        "perplexity": word_ppl,
        "word_perplexity": word_ppl,
        "byte_perplexity": _exp(total / n_bytes),
        "bits_per_byte": total / n_bytes / math.log(2),
        "token_perplexity": _exp(total / tokens),
        "mean_nll": total / tokens,
        "bits_per_token": total / tokens / math.log(2),
        "seq_len": seq_len,
        "stride": stride or seq_len,
        "detokenize": detokenize,
        "tokenizer": tokenizer.name,
        "normalisation": "perplexity = word_perplexity = exp(total NLL / whitespace words); "
        "byte_perplexity and bits_per_byte per UTF-8 byte; words and bytes of the text as read, "
        f"{'scored after detokenisation, ' if detokenize else ''}as lm-eval's wikitext; "
        f"token_perplexity per token of {tokenizer.name}; each article one stream after an "
        f"end-of-text token, windows of {seq_len} tokens scoring {stride or seq_len} new tokens each",
    }


def zero_shot_markdown(results: list[dict]) -> str:
    """Lines for eval.md and the printed summary."""
    lines = []
    for r in results:
        if r.get("task") == "lambada":
            err = f" +- {r['acc_stderr']:.4f}" if r.get("acc_stderr") is not None else ""
            lines.append(
                f"- LAMBADA {r['name']} ({r['corpus']}): acc {r['acc']:.4f}{err}, perplexity "
                f"{r['perplexity']:.3f} over {r['count']} passages"
                + (f" ({r['truncated']} contexts cut to the window)" if r["truncated"] else "")
            )
        elif r.get("task") == "wikitext":
            lines.append(
                f"- Wikitext {r['name']} ({r['corpus']}): word perplexity {r['word_perplexity']:.3f}, "
                f"bits/byte {r['bits_per_byte']:.4f}, token perplexity {r['token_perplexity']:.3f} over "
                f"{r['documents']} documents, {r['words']} words, {r['tokens']} tokens"
                + (" (detokenised)" if r["detokenize"] else "")
            )
    return "\n".join(lines) + "\n" if lines else ""
