"""How sharp a model's predictions are, apart from how it ranks: the loss at a grid of softmax
temperatures, and the loss at a temperature fitted on other documents of the same corpus.

A temperature `T` divides every logit (`softmax(z / T)`); it changes no ranking, only how much
probability the model leaves to what it does not expect. Two models whose losses differ at `T = 1`
but agree at their fitted temperatures differ in sharpness, not in what they rank. The fit is
cross-fitted so that no document's loss uses a temperature fitted on that document: the corpus's
documents are split by parity, the temperature fitted on the odd ones scores the even ones and the
other way round.

`temperature_record` evaluates one model and keeps, per document, the NLL sums at every temperature
(overall and per frequency bucket) and the predictive entropy at `T = 1`; `cross_fitted` reads the
record back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from megatron_lev.analysis.perplexity import DEFAULT_EDGES, TokenLosses, per_document_sums, target_buckets
from megatron_lev.utils.progress import progress_bar

CHUNK = 64  # predicted tokens scored at a time (64 x a 50k vocabulary: 13 MB of logits)
# around 1 (unchanged), finer where the models of this repository's studies land (1.0-1.4)
TEMPERATURES = (0.8, 0.9, 1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.35, 1.4, 1.5, 1.6, 1.8, 2.0)


def temperature_losses(
    batches: Iterable[torch.Tensor],
    model_fn: Callable[[torch.Tensor], torch.Tensor],
    temperatures: Sequence[float] = TEMPERATURES,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Run `model_fn(inputs) -> logits (B, S, V)` over batches of ids (B, S+1).

    Returns `(nll, entropy, targets, inputs)`: `nll` (len(temperatures), N) the loss of every
    predicted token at every temperature, `entropy` (N,) of the prediction at T = 1 (nats), and the
    target and input ids (N,).
    """
    if not temperatures or min(temperatures) <= 0:
        raise ValueError(f"temperatures must be positive, got {tuple(temperatures)}")
    temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float32)
    nll_parts, ent_parts, tgt_parts, inp_parts = [], [], [], []
    bar = progress_bar(desc="temperatures", unit="tok", unit_scale=True, disable=not progress)
    with torch.inference_mode():
        for batch in batches:
            batch = torch.as_tensor(batch, dtype=torch.long)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            logits = model_fn(inputs).float()
            logits = logits.reshape(-1, logits.shape[-1])  # (n, V)
            y = targets.reshape(-1)
            nll, ent = [], []
            for lo in range(0, len(y), CHUNK):  # small blocks: reused memory, not fresh pages per batch
                z, yy = logits[lo : lo + CHUNK], y[lo : lo + CHUNK]
                picked = z.gather(1, yy[:, None])[:, 0]  # (n,)
                # lse(z / T) - z_y / T at every temperature
                nll.append(torch.stack([torch.logsumexp(z / t, dim=-1) - picked / t for t in temps]))
                ent.append(torch.special.entr(F.softmax(z, dim=-1)).sum(-1))  # 0 where p = 0
            nll_parts.append(torch.cat(nll, dim=1).double().numpy())
            ent_parts.append(torch.cat(ent).double().numpy())
            tgt_parts.append(y.numpy())
            inp_parts.append(inputs.reshape(-1).numpy())
            bar.update(y.numel())
    bar.close()
    if not nll_parts:
        raise ValueError("no batches to evaluate (empty corpus or too few tokens for one sequence)")
    return (
        np.concatenate(nll_parts, axis=1),
        np.concatenate(ent_parts),
        np.concatenate(tgt_parts).astype(np.int64),
        np.concatenate(inp_parts).astype(np.int64),
    )


def temperature_record(
    nll: np.ndarray,
    entropy: np.ndarray,
    targets: np.ndarray,
    temperatures: Sequence[float],
    doc_lengths: Sequence[int],
    counts: np.ndarray,
    edges: tuple[float, ...] = DEFAULT_EDGES,
) -> dict:
    """The JSON-ready record: per document, the predicted tokens (overall and per frequency bucket
    of the target, the training `counts`' buckets), NLL sums at every temperature, and the entropy
    sum at T = 1."""
    bucket = target_buckets(TokenLosses(nll[0], targets), counts, edges)
    n_buckets = len(edges) + 1
    per_t = [
        per_document_sums(TokenLosses(row, targets), doc_lengths, bucket, n_buckets, max_units=10**9)
        for row in nll
    ]
    ent = per_document_sums(TokenLosses(entropy, targets), doc_lengths, max_units=10**9)
    return {
        "temperatures": [float(t) for t in temperatures],
        "bucket_edges": list(edges),
        "tokens": per_t[0]["tokens"],
        "bucket_tokens": per_t[0]["bucket_tokens"],
        "nll_sum": [p["nll_sum"] for p in per_t],
        "bucket_nll_sum": [p["bucket_nll_sum"] for p in per_t],
        "entropy_sum": ent["nll_sum"],
        "note": "per document in corpus order: predicted tokens (overall, per target-frequency bucket), "
        "NLL sums (nats) at each temperature (logits / T), and the sum of the T = 1 entropies",
    }


def cross_fitted(record: dict) -> dict:
    """Per-document NLL sums at the cross-fitted temperature, overall and per bucket.

    The documents are split by parity; the temperature with the least total NLL on the odd documents
    scores the even ones and the other way round (the grid's values only). Returns
    `{"fit": (T for the even documents, T for the odd ones), "nll_sum": (docs,), "bucket_nll_sum":
    (buckets, docs)}`.
    """
    temps = record["temperatures"]
    nll = np.asarray(record["nll_sum"], dtype=np.float64)  # (T, docs)
    bucket = np.asarray(record["bucket_nll_sum"], dtype=np.float64)  # (T, buckets, docs)
    if nll.shape[1] < 2:
        raise ValueError("cross-fitting needs at least two documents")
    even = np.arange(nll.shape[1]) % 2 == 0
    t_even = int(np.argmin(nll[:, ~even].sum(axis=1)))  # fitted on the odd documents, scores the even
    t_odd = int(np.argmin(nll[:, even].sum(axis=1)))
    pick = np.where(even, t_even, t_odd)  # (docs,) index into the grid
    docs = np.arange(nll.shape[1])
    return {
        "fit": (temps[t_even], temps[t_odd]),
        "nll_sum": nll[pick, docs],
        "bucket_nll_sum": bucket[pick, :, docs].T,
    }


def best_temperature(record: dict) -> float:
    """The grid's temperature with the least total NLL over every document (in-sample; reported only)."""
    nll = np.asarray(record["nll_sum"], dtype=np.float64).sum(axis=1)
    return float(record["temperatures"][int(np.argmin(nll))])


def mean_entropy(record: dict) -> float:
    return float(np.sum(record["entropy_sum"]) / max(1, np.sum(record["tokens"])))


def mean_nll_at(record: dict, temperature: float = 1.0) -> float:
    temps = record["temperatures"]
    i = min(range(len(temps)), key=lambda k: abs(temps[k] - temperature))
    if not math.isclose(temps[i], temperature):
        raise ValueError(f"temperature {temperature} is not on the record's grid {temps}")
    return float(np.sum(record["nll_sum"][i]) / max(1, np.sum(record["tokens"])))
