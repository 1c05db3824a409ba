"""Per-token losses of any model given as a callable, perplexity, and perplexity by token frequency.

Only a `model_fn` is needed, so Hugging Face models and this project's checkpoints share the code.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from megatron_lev.utils.progress import progress_bar

DEFAULT_EDGES = (1e-7, 1e-6, 1e-5, 1e-4)  # relative-frequency decade edges
# training-count bands of the target and of the input token: 0, 1-9, 10-99, 100-999, >= 1000
COUNT_EDGES = (1, 10, 100, 1000)


@dataclass
class TokenLosses:
    """NLL (nats) of every predicted token and the token id it predicted."""

    nll: np.ndarray  # (N,) float64
    targets: np.ndarray  # (N,) int64
    inputs: np.ndarray | None = None  # (N,) int64: the token just before each target (None: not kept)

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean()) if len(self.nll) else math.nan

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def per_token_losses(
    batches: Iterable[torch.Tensor],
    model_fn: Callable[..., torch.Tensor],
    returns_loss: bool = False,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> TokenLosses:
    """Run `model_fn` over batches of token ids (B, S+1): inputs [:, :-1] predict targets [:, 1:].

    `model_fn(inputs) -> logits (B, S, V)`, or with `returns_loss`, `model_fn(inputs, targets)
    -> per-token NLL (B, S)`.
    """
    nll_parts, tgt_parts, inp_parts = [], [], []
    n_tokens, start = 0, time.perf_counter()
    bar = progress_bar(desc="evaluating", unit="tok", unit_scale=True, disable=not progress)
    with torch.inference_mode():
        for batch in batches:
            batch = torch.as_tensor(batch, dtype=torch.long)
            if batch.ndim != 2 or batch.shape[1] < 2:
                raise ValueError(f"a batch must be (B, S+1) token ids with S >= 1, got {tuple(batch.shape)}")
            inputs, targets = batch[:, :-1].to(device), batch[:, 1:].to(device)  # (B, S) each
            if returns_loss:
                nll = model_fn(inputs, targets).float()  # (B, S)
            else:
                logits = model_fn(inputs)  # (B, S, V)
                if logits.shape[:2] != targets.shape:
                    raise ValueError(
                        f"model_fn returned logits {tuple(logits.shape)} for inputs "
                        f"{tuple(inputs.shape)}; expected (B, S, V)"
                    )
                nll = torch.stack(
                    [F.cross_entropy(lg.float(), tg, reduction="none") for lg, tg in zip(logits, targets)]
                )  # (B, S)
            nll_parts.append(nll.reshape(-1).double().cpu().numpy())
            tgt_parts.append(targets.reshape(-1).cpu().numpy())
            inp_parts.append(inputs.reshape(-1).cpu().numpy())
            n_tokens += targets.numel()
            bar.update(targets.numel())
            bar.set_postfix(tok_per_s=f"{n_tokens / max(time.perf_counter() - start, 1e-9):.0f}")
    bar.close()
    if not nll_parts:
        raise ValueError("no batches to evaluate (empty corpus or too few tokens for one sequence)")
    return TokenLosses(
        np.concatenate(nll_parts),
        np.concatenate(tgt_parts).astype(np.int64),
        np.concatenate(inp_parts).astype(np.int64),
    )


def load_counts(path: str | Path) -> np.ndarray:
    """Training token counts: `<prefix>.counts.npy`, int64 per token id."""
    path = Path(path)
    try:
        counts = np.load(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read token counts ({exc})") from exc
    if counts.ndim != 1 or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
        raise ValueError(
            f"{path}: token counts must be a 1-D non-negative integer array, "
            f"got {counts.dtype} {counts.shape}"
        )
    if counts.sum() == 0:
        raise ValueError(f"{path}: token counts are all zero")
    return counts.astype(np.int64)


def bucket_labels(edges: tuple[float, ...]) -> list[str]:
    inner = [f"[{lo:.0e}, {hi:.0e})" for lo, hi in zip(edges[:-1], edges[1:])]
    return [f"< {edges[0]:.0e}", *inner, f">= {edges[-1]:.0e}"]


def target_buckets(losses: TokenLosses, counts: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """The frequency bucket (0 = rarest) of every predicted token; ids beyond `counts` have frequency 0."""
    freq = counts / counts.sum()
    tgt_freq = np.zeros(len(losses.targets))
    inside = losses.targets < len(counts)
    tgt_freq[inside] = freq[losses.targets[inside]]
    return np.searchsorted(tuple(float(e) for e in edges), tgt_freq, side="right")


def frequency_buckets(
    losses: TokenLosses, counts: np.ndarray, edges: tuple[float, ...] = DEFAULT_EDGES
) -> list[dict]:
    """Perplexity of target tokens grouped by their relative training frequency.

    Ids beyond `counts` (a padded vocabulary) have frequency 0. Every bucket is listed, with
    the number of evaluated tokens and of vocabulary ids in it, so empty buckets are visible.
    """
    edges = tuple(float(e) for e in edges)
    if not edges or any(a >= b for a, b in zip(edges[:-1], edges[1:])) or edges[0] <= 0:
        raise ValueError(f"bucket edges must be positive and increasing, got {edges}")
    freq = counts / counts.sum()  # (V,)
    vocab_bucket = np.searchsorted(edges, freq, side="right")  # 0: below edges[0]
    tgt_bucket = target_buckets(losses, counts, edges)  # (N,)
    bounds = (0.0, *edges, math.inf)
    out = []
    for b, label in enumerate(bucket_labels(edges)):
        sel = losses.nll[tgt_bucket == b]
        mean = float(sel.mean()) if len(sel) else None
        out.append(
            {
                "bucket": label,
                "lo": bounds[b],
                "hi": bounds[b + 1] if b < len(edges) else None,
                "tokens": int(len(sel)),
                "share": len(sel) / max(len(losses.nll), 1),
                "vocab_ids": int((vocab_bucket == b).sum()),
                "mean_nll": mean,
                "perplexity": math.exp(mean) if mean is not None else None,
            }
        )
    return out


def count_band_labels(edges: tuple[int, ...] = COUNT_EDGES) -> list[str]:
    """`0`, `1-9`, `10-99`, ..., `>= 1000` for edges (1, 10, 100, 1000)."""
    labels = [f"{lo}-{hi - 1}" if hi - lo > 1 else str(lo) for lo, hi in zip((0, *edges[:-1]), edges)]
    return [*labels, f">= {edges[-1]}"]


def count_band_of(ids: np.ndarray, counts: np.ndarray, edges: tuple[int, ...] = COUNT_EDGES) -> np.ndarray:
    """The training-count band (0 = never seen) of every id; ids beyond `counts` were never seen."""
    seen = np.zeros(len(ids), dtype=np.int64)
    inside = ids < len(counts)
    seen[inside] = counts[ids[inside]]
    return np.searchsorted(np.asarray(edges), seen, side="right")


def count_bands(
    losses: TokenLosses, counts: np.ndarray, edges: tuple[int, ...] = COUNT_EDGES
) -> dict[str, list[dict]]:
    """Mean NLL of the predicted tokens grouped by how often the training data held the **target**
    (the predicted token) and the **input** (the token before it, the one the input layer embeds):
    bands of absolute training count, e.g. 0, 1-9, 10-99, 100-999, >= 1000. Every band is listed with
    its evaluated tokens and its vocabulary ids, so empty bands are visible."""
    edges = tuple(int(e) for e in edges)
    if not edges or edges[0] < 1 or any(a >= b for a, b in zip(edges[:-1], edges[1:])):
        raise ValueError(f"count band edges must be integers >= 1, increasing, got {edges}")
    vocab_band = np.searchsorted(np.asarray(edges), counts, side="right")
    out = {}
    for side, ids in (("target", losses.targets), ("input", losses.inputs)):
        if ids is None:
            continue
        band = count_band_of(ids, counts, edges)
        rows = []
        for b, label in enumerate(count_band_labels(edges)):
            sel = losses.nll[band == b]
            mean = float(sel.mean()) if len(sel) else None
            rows.append(
                {
                    "band": label,
                    "tokens": int(len(sel)),
                    "vocab_ids": int((vocab_band == b).sum()),
                    "mean_nll": mean,
                    "perplexity": math.exp(mean) if mean is not None else None,
                }
            )
        out[side] = rows
    return out


class RecordLengths:
    """Passes documents through unchanged and records each one's length in tokens (`lengths`), so
    the evaluation can attribute every predicted token to its document: wrap the documents given
    to `sequence_batches` and hand `lengths` to `evaluation_result(doc_lengths=...)`."""

    def __init__(self, documents: Iterable[np.ndarray]):
        self.documents = documents
        self.lengths: list[int] = []

    def __iter__(self):
        for doc in self.documents:
            self.lengths.append(len(doc))
            yield doc


MAX_UNITS = 10_000  # per-document arrays beyond this are merged into groups of consecutive documents


def _token_units(n_predicted: int, doc_lengths, unit_tokens: int) -> tuple[np.ndarray, str]:
    """The unit (document, else evaluation window) of every predicted token, in stream order.

    The evaluation concatenates documents and predicts every token but the first once, in order,
    so predicted token j is stream position j + 1.
    """
    if doc_lengths is not None:
        ends = np.cumsum(np.asarray(doc_lengths, dtype=np.int64))
        if len(ends) == 0 or ends[-1] != n_predicted + 1:
            raise ValueError(
                f"document lengths add up to {int(ends[-1]) if len(ends) else 0} tokens but "
                f"{n_predicted} tokens were predicted (expected {n_predicted + 1} tokens in all)"
            )
        return np.searchsorted(ends, np.arange(1, n_predicted + 1), side="right"), "document"
    if unit_tokens < 1:
        raise ValueError(f"unit_tokens must be >= 1, got {unit_tokens}")
    return np.arange(n_predicted) // unit_tokens, "window"


def per_document_sums(
    losses: TokenLosses,
    doc_lengths: Iterable[int] | None = None,
    bucket_of_token: np.ndarray | None = None,
    n_buckets: int = 0,
    unit_tokens: int = 1024,
    max_units: int = MAX_UNITS,
    groupings: dict[str, tuple[np.ndarray, int]] | None = None,
) -> dict:
    """Token counts and NLL sums per document (overall and per frequency bucket), for resampling
    documents in `compare`'s bootstrap.

    Without `doc_lengths` the unit is the evaluation window of `unit_tokens` predicted tokens. Over
    `max_units` units, consecutive units are merged into equal groups (`group` units each) to keep
    the JSON small. NLL sums are rounded to 1e-6 nats.
    """
    n = len(losses.nll)
    doc_lengths = None if doc_lengths is None else [int(x) for x in doc_lengths]
    unit, kind = _token_units(n, doc_lengths, unit_tokens)
    n_units = len(doc_lengths) if doc_lengths is not None else (int(unit[-1]) + 1 if n else 0)
    group = max(1, math.ceil(n_units / max_units))
    unit = unit // group
    n_units = math.ceil(n_units / group)

    def sums(sel: np.ndarray | None) -> tuple[list[int], list[float]]:
        u = unit if sel is None else unit[sel]
        nll = losses.nll if sel is None else losses.nll[sel]
        tokens = np.bincount(u, minlength=n_units)
        total = np.bincount(u, weights=nll, minlength=n_units)
        return tokens.astype(int).tolist(), [round(float(x), 6) for x in total]

    tokens, nll_sum = sums(None)
    out = {
        "unit": kind,
        "group": group,
        "count": n_units,
        "tokens": tokens,
        "nll_sum": nll_sum,
        "note": "predicted tokens and their NLL sum (nats) per "
        + (f"group of {group} consecutive {kind}s" if group > 1 else kind)
        + ", in corpus order; the bootstrap of `megatron-lev compare` resamples these",
    }
    if bucket_of_token is not None:
        per_bucket = [sums(bucket_of_token == b) for b in range(n_buckets)]
        out["bucket_tokens"] = [t for t, _ in per_bucket]
        out["bucket_nll_sum"] = [s for _, s in per_bucket]
    for name, (group_of_token, n_groups) in (groupings or {}).items():  # e.g. the count bands
        per_group = [sums(group_of_token == g) for g in range(n_groups)]
        out[f"{name}_tokens"] = [t for t, _ in per_group]
        out[f"{name}_nll_sum"] = [s for _, s in per_group]
    return out


def evaluation_result(
    losses: TokenLosses,
    name: str,
    counts: np.ndarray | None = None,
    edges: tuple[float, ...] = DEFAULT_EDGES,
    n_bytes: int | None = None,
    tokenizer: str | None = None,
    doc_lengths: Iterable[int] | None = None,
    **extra,
) -> dict:
    """The JSON-ready result `compare` reads: overall perplexity, buckets, normalisation stated, and
    per-document sums (`per_document`; per evaluation window when `doc_lengths` is not given)."""
    total_nats = float(losses.nll.sum())
    res = {
        "name": name,
        "tokens": int(len(losses.nll)),
        "mean_nll": losses.mean_nll,
        "perplexity": losses.perplexity,
        "bits_per_token": losses.mean_nll / math.log(2),
        "normalisation": f"per token of the tokenizer {tokenizer or '(the model vocabulary)'}; "
        "exp of the mean NLL over every predicted token",
        **extra,
    }
    if n_bytes is not None:
        res["bytes"] = int(n_bytes)
        res["bits_per_byte"] = total_nats / math.log(2) / n_bytes
        res["normalisation"] += (
            "; bits_per_byte = total NLL in bits / UTF-8 bytes of the text, comparable across tokenizers"
        )
    bucket_of_token = None
    groupings = {}
    if counts is not None:
        res["bucket_edges"] = list(edges)
        res["buckets"] = frequency_buckets(losses, counts, edges)
        bucket_of_token = target_buckets(losses, counts, edges)
        res["count_band_edges"] = list(COUNT_EDGES)
        res["count_bands"] = count_bands(losses, counts)
        n_bands = len(COUNT_EDGES) + 1
        groupings["target_band"] = (count_band_of(losses.targets, counts), n_bands)
        if losses.inputs is not None:
            groupings["input_band"] = (count_band_of(losses.inputs, counts), n_bands)
    if len(losses.nll):
        res["per_document"] = per_document_sums(
            losses,
            doc_lengths,
            bucket_of_token,
            len(edges) + 1,
            unit_tokens=int(extra.get("seq_len") or 1024),
            groupings=groupings,
        )
    return res


def result_markdown(results: list[dict]) -> str:
    lines = ["| result | tokens | perplexity | bits/token | bits/byte |", "|---|---|---|---|---|"]
    for r in results:
        bpb = f"{r['bits_per_byte']:.4f}" if "bits_per_byte" in r else "-"
        lines.append(
            f"| {r['name']} | {r['tokens']} | {r['perplexity']:.3f} | {r['bits_per_token']:.4f} | {bpb} |"
        )
    for r in results:
        if "buckets" in r:
            lines += [
                "",
                f"Perplexity by training-token frequency, {r['name']}:",
                "",
                "| relative frequency | vocab ids | tokens | share | perplexity |",
                "|---|---|---|---|---|",
            ]
            for b in r["buckets"]:
                ppl = f"{b['perplexity']:.3f}" if b["perplexity"] is not None else "(empty)"
                lines.append(
                    f"| {b['bucket']} | {b['vocab_ids']} | {b['tokens']} | {b['share']:.2%} | {ppl} |"
                )
    lines += ["", *(f"- {r['name']}: {r['normalisation']}" for r in results)]
    return "\n".join(lines) + "\n"
