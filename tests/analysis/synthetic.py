"""Synthetic `evaluate` results with known per-document losses, shared by the compare and study tests."""

from __future__ import annotations

import math

import numpy as np


def synthetic_result(tokens: np.ndarray, nll: np.ndarray, labels: list[str], **fields) -> dict:
    """An evaluate result whose perplexities follow from its per-document sums: `tokens` and `nll` are
    `(documents, buckets)` predicted-token counts and NLL sums, `labels` the bucket names."""
    per_bucket = nll.sum(0) / tokens.sum(0)
    return {
        **fields,
        "perplexity": math.exp(nll.sum() / tokens.sum()),
        "buckets": [
            {"bucket": lab, "tokens": int(tokens[:, k].sum()), "perplexity": math.exp(per_bucket[k])}
            for k, lab in enumerate(labels)
        ],
        "per_document": {
            "unit": "document",
            "group": 1,
            "count": len(tokens),
            "tokens": tokens.sum(1).astype(int).tolist(),
            "nll_sum": nll.sum(1).tolist(),
            "bucket_tokens": tokens.T.astype(int).tolist(),
            "bucket_nll_sum": nll.T.tolist(),
        },
    }
