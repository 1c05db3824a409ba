"""The paper-style comparison of runs: relative perplexity change against a baseline (TIED),
overall and per frequency bucket, over several seeds with paired 95% intervals (seed-paired t and a
bootstrap over documents), the paper's gain decomposition, and tokens needed to reach the
baseline's final loss.

The statistics are in `paired_intervals.py`, the tables and plots in `compare_report.py`; this module
reads the results and assembles the comparison."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_lev.analysis.compare_report import compare_markdown, plot_comparison
from megatron_lev.analysis.curves import Curve, tokens_to_target
from megatron_lev.analysis.paired_intervals import (
    LEVEL,
    document_bootstrap,
    mean_sd,
    paired_change,
    perplexity_at,
    t_interval,
)
from megatron_lev.errors import DataError


def load_result(path: str | Path, corpus: str | None = None) -> dict:
    """One evaluation result from `eval.json` (the first, or the one whose corpus contains `corpus`)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory: give the eval.json that `megatron-lev evaluate` wrote")
    if not path.is_file():
        raise DataError(
            f"{path}: evaluation result not found; run `megatron-lev evaluate ... --out DIR` "
            "and pass DIR/eval.json"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(
            f"{path}: not a readable evaluation result ({' '.join(str(exc).split())}); "
            "rerun `megatron-lev evaluate` to rewrite it"
        ) from None
    results = data.get("results", [data]) if isinstance(data, dict) else None
    if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
        raise DataError(
            f"{path}: not an evaluate result (expected {{'results': [{{'perplexity': ...}}, ...]}})"
        )
    for r in results:
        ppl = r.get("perplexity")
        if isinstance(ppl, bool) or not isinstance(ppl, (int, float)):
            raise DataError(f"{path}: not an evaluate result (a result without a numeric 'perplexity')")
        if not math.isfinite(ppl) or ppl <= 0:
            raise DataError(
                f"{path}: perplexity {ppl} of {r.get('corpus', 'a corpus')} is not a finite positive "
                "number: the evaluated model diverged or the file is damaged; evaluate again"
            )
    if corpus is not None:
        results = [r for r in results if corpus in str(r.get("corpus", ""))]
        if not results:
            raise DataError(f"{path}: no result for a corpus matching {corpus!r} (--corpus)")
    return results[0]


__all__ = [
    "DECOMPOSITION",
    "LEVEL",
    "compare_markdown",
    "compare_results",
    "load_result",
    "mean_sd",
    "plot_comparison",
    "t_interval",
]

# The spec's ablation chain: each variant adds one ingredient to the one before it. The paper's gain
# decomposition names the three steps after ALBERT (its figures, in % lower perplexity).
DECOMPOSITION = (
    ("non-linearity", "ALBERT", "FLAT-MLP", "continuous", 1.13),
    ("compositional structure", "FLAT-MLP", "FACT-MLP", "compositional", 0.37),
    ("separable spline", "FACT-MLP", "LEV", "spline smoothness", 0.62),
)
_ALIASES = {"FACTORIZED-MLP": "FACT-MLP", "FACTORISED-MLP": "FACT-MLP", "FLATMLP": "FLAT-MLP"}


def _canonical(name: str) -> str:
    key = name.strip().upper().replace("_", "-")
    return _ALIASES.get(key, key)


def _as_seeds(results: dict[str, dict | list[dict]]) -> dict[str, list[dict]]:
    return {name: (list(r) if isinstance(r, (list, tuple)) else [r]) for name, r in results.items()}


COMPARISON_NOTE = (
    "rel. change = perplexity / baseline perplexity - 1, seed i against the baseline's seed i, "
    "averaged over seeds (sd: over seeds); seed-paired interval: Student t over the per-seed "
    "changes; bootstrap interval: percentiles of the seed-averaged change over resamples of the "
    "evaluated documents (the same resample for every model); tokens-to-target = first point "
    "(linearly interpolated) where a run's loss reaches the baseline's final loss"
)
DECOMPOSITION_DEFINITION = (
    "gain of a term = (1 - perplexity of the variant that adds the ingredient / "
    "perplexity of the variant before it) x 100, seed i against seed i; positive: the ingredient "
    "lowers perplexity. The terms multiply (1 - total) = prod (1 - term), so they add up to the "
    "total only approximately"
)


def compare_results(
    results: dict[str, dict | list[dict]],
    curves: dict[str, Curve] | None = None,
    baseline: str = "TIED",
    sources: dict[str, list[str]] | None = None,
    bootstrap: int = 1000,
    bootstrap_seed: int = 0,
    require_bootstrap: bool = False,
    decomposition: bool | None = None,
    level: float = LEVEL,
) -> dict:
    """Rows per run: perplexity and % change vs the baseline, per bucket, over seeds with intervals,
    tokens-to-target, and the gain decomposition.

    `results`: name -> one result or a list of results, one per seed; seed i of a run is paired with
    seed i of the baseline, so every run needs as many seeds. `bootstrap`: document resamples (0: none);
    without per-document data it is skipped (a note says why) unless `require_bootstrap`.
    `decomposition`: None computes it when ALBERT, FLAT-MLP, FACT-MLP and LEV are all present;
    True requires them.
    """
    seeds = _paired_seeds(results, baseline)
    sources = {
        name: (sources or {}).get(name) or [f"{name} seed {i + 1}" for i in range(len(rs))]
        for name, rs in seeds.items()
    }
    curves = curves or {}
    target, base_tokens = _target(curves, baseline)
    labels = [b["bucket"] for b in seeds[baseline][0].get("buckets", [])]

    steps = _decomposition_steps(seeds, decomposition)
    boot, boot_info = document_bootstrap(
        seeds, sources, labels, baseline, bootstrap, bootstrap_seed, require_bootstrap
    )

    def paired(name: str, ref: str, bucket: str | None, k: int, sign: float = 1.0) -> dict:
        return paired_change(
            seeds[name], seeds[ref], bucket, k, boot and boot[name], boot and boot[ref], level, sign
        )

    rows = [
        _run_row(name, rs, labels, baseline, paired, sources[name], curves, target, base_tokens)
        for name, rs in seeds.items()
    ]
    return {
        "baseline": baseline,
        "target_loss": target,
        "bucket_labels": labels,
        "seeds": len(seeds[baseline]),
        "confidence": level,
        "bootstrap": boot_info,
        "rows": rows,
        "decomposition": None if steps is None else _decomposition_table(steps, labels, paired),
        "note": COMPARISON_NOTE,
    }


def _paired_seeds(results: dict[str, dict | list[dict]], baseline: str) -> dict[str, list[dict]]:
    """name -> its results, one per seed; refused unless the baseline is there and every run has as
    many seeds as it (seed i is paired with the baseline's seed i)."""
    if baseline not in results:
        raise DataError(
            f"--baseline {baseline!r} is not among the runs {sorted(results)}: name one run "
            f"{baseline}=EVAL_JSON, or pass --baseline NAME"
        )
    seeds = _as_seeds(results)
    n_seeds = len(seeds[baseline])
    for name, rs in seeds.items():
        if len(rs) != n_seeds:
            raise DataError(
                f"{name} has {len(rs)} seed(s) but {baseline} has {n_seeds}: seeds are paired in the "
                f"order given (seed i with {baseline}'s seed i); give every run the same number of "
                "eval.json files"
            )
    return seeds


def _target(curves: dict[str, Curve], baseline: str) -> tuple[float | None, float | None]:
    """(the baseline's final loss, the tokens it took to reach it), or Nones without curves."""
    if not curves:
        return None, None
    if baseline not in curves:
        raise DataError(
            f"--curves: tokens-to-target needs the baseline's loss curve ({baseline}=PATH in --curves)"
        )
    target = float(curves[baseline].loss[-1])
    return target, tokens_to_target(curves[baseline], target)


def _run_row(name, rs, labels, baseline, paired, sources, curves, target, base_tokens) -> dict:
    """One run's row: perplexity over seeds and its change against the baseline, overall and per
    bucket, and its tokens-to-target when it has a curve."""
    first = {b["bucket"]: b for b in rs[0].get("buckets", [])}
    per_bucket = []
    for k, lab in enumerate(labels, 1):
        ppls = [perplexity_at(r, lab) for r in rs]
        ppl_mean, ppl_sd = mean_sd(ppls) if None not in ppls else (None, None)
        change = paired(name, baseline, lab, k)
        per_bucket.append(
            {
                "bucket": lab,
                "tokens": first[lab]["tokens"] if lab in first else None,
                "perplexity": ppl_mean,
                "perplexity_sd": ppl_sd,
                "rel_change_pct": change["mean"],
                "rel_change": change,
            }
        )
    ppl_mean, ppl_sd = mean_sd([r["perplexity"] for r in rs])
    change = paired(name, baseline, None, 0)
    row = {
        "name": name,
        "seeds": len(rs),
        "sources": sources,
        "perplexity": ppl_mean,
        "perplexity_sd": ppl_sd,
        "perplexity_per_seed": [r["perplexity"] for r in rs],
        "rel_change_pct": change["mean"],
        "rel_change": change,
        "buckets": per_bucket,
    }
    if name in curves:
        t = tokens_to_target(curves[name], target)
        row.update(
            tokens_to_target=t,
            x_label=curves[name].x_label,
            final_loss=float(curves[name].loss[-1]),
            tokens_ratio=(t / base_tokens) if t is not None and base_tokens else None,
        )
    return row


def _decomposition_table(steps, labels, paired) -> dict:
    """The gain of each ingredient (variant against the one before it), overall and per bucket, and
    the total from the first reference to the last variant."""
    terms = [
        {
            "term": term,
            "variant": var,
            "reference": ref,
            "paper_label": paper_label,
            "paper_gain_pct": paper_gain,
            "gain": paired(var, ref, None, 0, -1.0),
            "buckets": [
                {"bucket": lab, "gain": paired(var, ref, lab, k, -1.0)} for k, lab in enumerate(labels, 1)
            ],
        }
        for term, ref, var, paper_label, paper_gain in steps
    ]
    first_ref, last_var = steps[0][1], steps[-1][2]
    return {
        "terms": terms,
        "total": {
            "variant": last_var,
            "reference": first_ref,
            "gain": paired(last_var, first_ref, None, 0, -1),
        },
        "definition": DECOMPOSITION_DEFINITION,
    }


def _decomposition_steps(seeds: dict[str, list[dict]], wanted: bool | None):
    """The decomposition's steps with the runs' own names, or None (not wanted, or runs missing)."""
    if wanted is False:
        return None
    by_canonical = {_canonical(name): name for name in seeds}
    needed = [n for n in ("ALBERT", "FLAT-MLP", "FACT-MLP", "LEV") if n not in by_canonical]
    if needed:
        if wanted:
            raise DataError(
                f"--decomposition needs the runs ALBERT, FLAT-MLP, FACT-MLP and LEV; missing: "
                f"{', '.join(needed)} (name them NAME=EVAL_JSON)"
            )
        return None
    return [
        (term, by_canonical[ref], by_canonical[var], label, gain)
        for term, ref, var, label, gain in DECOMPOSITION
    ]
