"""Paired changes of perplexity between runs and their 95% intervals: per seed pair, the mean and
sd, the seed-paired Student-t interval, and a percentile interval from a bootstrap over documents
that resamples every run of every pair with the same document weights."""

from __future__ import annotations

import math

from megatron_lev.errors import DataError

LEVEL = 0.95


def _rel(value: float | None, base: float | None) -> float | None:
    if value is None or base is None:
        return None
    return (value / base - 1.0) * 100.0


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def t_interval(values: list[float], level: float = LEVEL) -> tuple[float, float] | None:
    """Student-t interval of the mean of paired differences; None with fewer than 2 of them."""
    from scipy.stats import t

    n = len(values)
    if n < 2:
        return None
    mean, sd = mean_sd(values)
    half = float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean - half, mean + half


def perplexity_at(result: dict, bucket: str | None) -> float | None:
    if bucket is None:
        return result["perplexity"]
    for b in result.get("buckets", []):
        if b.get("bucket") == bucket:
            return b.get("perplexity")
    return None


def _doc_arrays(result: dict, labels: list[str], source: str):
    """(tokens, nll_sum), each (units, 1 + buckets): overall then the baseline's buckets, or a reason
    why the result cannot be resampled."""
    import numpy as np

    doc = result.get("per_document")
    if not isinstance(doc, dict) or "tokens" not in doc or "nll_sum" not in doc:
        return f"{source}: no per-document losses ('per_document') for the document bootstrap"
    try:
        cols_t, cols_s = [doc["tokens"]], [doc["nll_sum"]]
        if labels:
            order = [b.get("bucket") for b in result.get("buckets", [])]
            for lab in labels:
                k = order.index(lab)
                cols_t.append(doc["bucket_tokens"][k])
                cols_s.append(doc["bucket_nll_sum"][k])
        tokens = np.array(cols_t, dtype=np.float64).T
        nll = np.array(cols_s, dtype=np.float64).T
    except (KeyError, ValueError, IndexError, TypeError):
        return f"{source}: its per-document losses are incomplete (no per-bucket sums, or ragged arrays)"
    if tokens.ndim != 2 or len(tokens) == 0 or not np.isfinite(nll).all() or (tokens < 0).any():
        return f"{source}: its per-document losses are empty or not finite"
    total = float(nll[:, 0].sum() / max(tokens[:, 0].sum(), 1.0))
    if abs(total - math.log(result["perplexity"])) > 1e-3:
        return (
            f"{source}: its per-document losses (mean NLL {total:.4f}) do not add up to its perplexity "
            f"(mean NLL {math.log(result['perplexity']):.4f}): the file is damaged"
        )
    return tokens, nll


class _Bootstrap:
    """One set of document resamples (multiplicity weights), shared by every model of every pair."""

    def __init__(self, n_units: int, resamples: int, seed: int):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.weights = rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=resamples).astype(
            np.float64
        )  # (B, units)

    def mean_nll(self, tokens, nll):
        """(B, 1 + buckets) mean NLL of each resample; NaN where a bucket has no token."""
        import numpy as np

        with np.errstate(invalid="ignore", divide="ignore"):
            return (self.weights @ nll) / (self.weights @ tokens)


def _percentile_interval(samples, level: float) -> tuple[float, float] | None:
    import numpy as np

    samples = samples[np.isfinite(samples)]
    if len(samples) == 0:
        return None
    lo, hi = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def paired_change(
    var: list[dict],
    base: list[dict],
    bucket: str | None,
    k: int,
    boot_var: list | None,
    boot_base: list | None,
    level: float,
    sign: float = 1.0,
) -> dict:
    """Change of `var` against `base` (% of perplexity; `sign` -1 gives the gain), seed i with seed i:
    per seed, mean, sd, the seed-paired t interval and the document-bootstrap percentile interval."""
    import numpy as np

    per_seed = [_rel(perplexity_at(v, bucket), perplexity_at(b, bucket)) for v, b in zip(var, base)]
    out = {"per_seed": per_seed, "mean": None, "sd": None, "seed_interval": None, "bootstrap_interval": None}
    if any(x is None for x in per_seed):
        out["per_seed"] = [None if x is None else sign * x for x in per_seed]
        out["note"] = "a perplexity is missing (empty bucket)"
        return out
    per_seed = [sign * x for x in per_seed]
    out["per_seed"] = per_seed
    out["mean"], out["sd"] = mean_sd(per_seed)
    ci = t_interval(per_seed, level)
    out["seed_interval"] = list(ci) if ci else None
    if ci is None:
        out["seed_interval_note"] = f"{len(per_seed)} seed pair: a seed interval needs at least 2"
    if boot_var is not None and boot_base is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            rel = np.mean(
                [sign * (np.exp(bv[:, k] - bb[:, k]) - 1.0) * 100.0 for bv, bb in zip(boot_var, boot_base)],
                axis=0,
            )
        bi = _percentile_interval(rel, level)
        out["bootstrap_interval"] = list(bi) if bi else None
    return out


def document_bootstrap(seeds, sources, labels, baseline, resamples, seed, required):
    """Per run, per seed: the (B, 1 + buckets) bootstrap mean NLLs; and what was done (or why not)."""
    import numpy as np

    info = {"resamples": resamples, "seed": seed, "unit": None, "units": None, "skipped": None}
    if resamples <= 0:
        info["skipped"] = "--bootstrap 0"
        return None, info
    arrays, reference = {}, None
    for name, rs in seeds.items():
        arrays[name] = []
        for r, src in zip(rs, sources[name]):
            got = _doc_arrays(r, labels, src)
            if isinstance(got, tuple) and reference is not None:
                if got[0].shape != reference[1].shape or not np.array_equal(got[0][:, 0], reference[1][:, 0]):
                    got = (
                        f"{src}: its per-document token counts differ from those of {reference[0]}: "
                        "the bootstrap pairs documents, so evaluate every run on the same documents "
                        "(same corpus, tokenizer, --max-docs, --seq-len)"
                    )
            if isinstance(got, str):
                if required:
                    raise DataError(
                        f"{got}; rerun `megatron-lev evaluate` to rewrite it, or pass --bootstrap 0"
                    )
                info["skipped"] = got
                return None, info
            if reference is None:
                reference = (src, got[0], r.get("per_document", {}))
            arrays[name].append(got)
    doc = reference[2]
    info.update(unit=doc.get("unit"), group=doc.get("group", 1), units=int(len(reference[1])))
    boot = _Bootstrap(len(reference[1]), resamples, seed)
    return {name: [boot.mean_nll(t, s) for t, s in arrs] for name, arrs in arrays.items()}, info
