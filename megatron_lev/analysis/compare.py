"""The paper-style comparison of runs: relative perplexity change against a baseline (TIED),
overall and per frequency bucket, over several seeds with paired 95% intervals (seed-paired t and a
bootstrap over documents), the paper's gain decomposition, and tokens needed to reach the
baseline's final loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_lev.analysis.curves import Curve, tokens_to_target
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


LEVEL = 0.95

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


def _ppl(result: dict, bucket: str | None) -> float | None:
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


def _paired(
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

    per_seed = [_rel(_ppl(v, bucket), _ppl(b, bucket)) for v, b in zip(var, base)]
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


def _as_seeds(results: dict[str, dict | list[dict]]) -> dict[str, list[dict]]:
    return {name: (list(r) if isinstance(r, (list, tuple)) else [r]) for name, r in results.items()}


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
    if baseline not in results:
        raise DataError(
            f"--baseline {baseline!r} is not among the runs {sorted(results)}: name one run "
            f"{baseline}=EVAL_JSON, or pass --baseline NAME"
        )
    seeds = _as_seeds(results)
    sources = {
        name: (sources or {}).get(name) or [f"{name} seed {i + 1}" for i in range(len(rs))]
        for name, rs in seeds.items()
    }
    n_seeds = len(seeds[baseline])
    for name, rs in seeds.items():
        if len(rs) != n_seeds:
            raise DataError(
                f"{name} has {len(rs)} seed(s) but {baseline} has {n_seeds}: seeds are paired in the "
                f"order given (seed i with {baseline}'s seed i); give every run the same number of "
                "eval.json files"
            )
    base = seeds[baseline]
    curves = curves or {}
    target = None
    if curves:
        if baseline not in curves:
            raise DataError(
                f"--curves: tokens-to-target needs the baseline's loss curve ({baseline}=PATH in --curves)"
            )
        target = float(curves[baseline].loss[-1])
    base_tokens = tokens_to_target(curves[baseline], target) if target is not None else None
    labels = [b["bucket"] for b in base[0].get("buckets", [])]

    steps = _decomposition_steps(seeds, decomposition)
    boot, boot_info = _bootstrap(
        seeds, sources, labels, baseline, bootstrap, bootstrap_seed, require_bootstrap
    )

    def paired(name: str, ref: str, bucket: str | None, k: int, sign: float = 1.0) -> dict:
        return _paired(
            seeds[name], seeds[ref], bucket, k, boot and boot[name], boot and boot[ref], level, sign
        )

    rows = []
    for name, rs in seeds.items():
        first = {b["bucket"]: b for b in rs[0].get("buckets", [])}
        per_bucket = []
        for k, lab in enumerate(labels, 1):
            ppls = [_ppl(r, lab) for r in rs]
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
            "sources": sources[name],
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
        rows.append(row)

    decomp = None
    if steps is not None:
        terms = []
        for term, ref, var, paper_label, paper_gain in steps:
            terms.append(
                {
                    "term": term,
                    "variant": var,
                    "reference": ref,
                    "paper_label": paper_label,
                    "paper_gain_pct": paper_gain,
                    "gain": paired(var, ref, None, 0, -1.0),
                    "buckets": [
                        {"bucket": lab, "gain": paired(var, ref, lab, k, -1.0)}
                        for k, lab in enumerate(labels, 1)
                    ],
                }
            )
        first_ref, last_var = steps[0][1], steps[-1][2]
        decomp = {
            "terms": terms,
            "total": {
                "variant": last_var,
                "reference": first_ref,
                "gain": paired(last_var, first_ref, None, 0, -1),
            },
            "definition": "gain of a term = (1 - perplexity of the variant that adds the ingredient / "
            "perplexity of the variant before it) x 100, seed i against seed i; positive: the ingredient "
            "lowers perplexity. The terms multiply (1 - total) = prod (1 - term), so they add up to the "
            "total only approximately",
        }
    return {
        "baseline": baseline,
        "target_loss": target,
        "bucket_labels": labels,
        "seeds": n_seeds,
        "confidence": level,
        "bootstrap": boot_info,
        "rows": rows,
        "decomposition": decomp,
        "note": "rel. change = perplexity / baseline perplexity - 1, seed i against the baseline's seed i, "
        "averaged over seeds (sd: over seeds); seed-paired interval: Student t over the per-seed "
        "changes; bootstrap interval: percentiles of the seed-averaged change over resamples of the "
        "evaluated documents (the same resample for every model); tokens-to-target = first point "
        "(linearly interpolated) where a run's loss reaches the baseline's final loss",
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


def _bootstrap(seeds, sources, labels, baseline, resamples, seed, required):
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


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}%"


def _mean_sd_cell(stats: dict) -> str:
    if stats["mean"] is None:
        return "-"
    if stats["sd"] is None:
        return f"{stats['mean']:+.2f}% (1 seed)"
    return f"{stats['mean']:+.2f}% ± {stats['sd']:.2f}"


def _bucket_cell(bucket: dict) -> str:
    """A bucket's label with its target-token count: a change over a handful of tokens reads as such."""
    n = bucket.get("tokens")
    return bucket["bucket"] if n is None else f"{bucket['bucket']} ({n:,} token{'' if n == 1 else 's'})"


def _interval_cell(ci: list[float] | None, why: str) -> str:
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}]%" if ci else f"- ({why})"


def compare_markdown(cmp: dict) -> str:
    head = ["run", "perplexity", f"vs {cmp['baseline']}", *cmp["bucket_labels"]]
    has_curves = cmp["target_loss"] is not None
    if has_curves:
        head += [f"tokens to {cmp['baseline']} final loss ({cmp['target_loss']:.4f})", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in cmp["rows"]:
        cells = [
            r["name"],
            f"{r['perplexity']:.3f}",
            _pct(r["rel_change_pct"]),
            *(_pct(b["rel_change_pct"]) for b in r["buckets"]),
        ]
        if has_curves:
            t = r.get("tokens_to_target")
            cells += [
                "not reached" if t is None and "final_loss" in r else ("-" if t is None else f"{t:.4g}"),
                "-" if r.get("tokens_ratio") is None else f"{r['tokens_ratio']:.3f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", cmp["note"]]
    seeds, boot = cmp.get("seeds", 1), cmp.get("bootstrap") or {}
    level = round(100 * cmp.get("confidence", LEVEL))
    seed_why = f"{seeds} seed" if seeds < 2 else "no value"
    boot_why = "not run" if boot.get("skipped") else "empty bucket"
    pct = f"{level}%"
    lines += [
        "",
        f"## Change against {cmp['baseline']} over {seeds} seed(s), with paired {pct} intervals",
        "",
        f"| run | target tokens (count) | vs {cmp['baseline']} (mean ± sd) | seed-paired {pct} | "
        f"document bootstrap {pct} |",
        "|---|---|---|---|---|",
    ]
    for r in cmp["rows"]:
        if r["name"] == cmp["baseline"]:
            continue
        for label, stats in [
            ("all", r["rel_change"]),
            *((_bucket_cell(b), b["rel_change"]) for b in r["buckets"]),
        ]:
            lines.append(
                f"| {r['name']} | {label} | {_mean_sd_cell(stats)} | "
                f"{_interval_cell(stats['seed_interval'], seed_why)} | "
                f"{_interval_cell(stats['bootstrap_interval'], boot_why)} |"
            )
    lines.append("")
    if boot.get("skipped"):
        lines.append(f"Document bootstrap not run: {boot['skipped']}.")
    else:
        unit = boot["unit"] + (f" groups of {boot['group']}" if boot.get("group", 1) > 1 else "")
        lines.append(
            f"Document bootstrap: {boot['resamples']} resamples (seed {boot['seed']}) of {boot['units']} "
            f"evaluation units ({unit}s), the same resample for both models of a pair."
        )
    if seeds < 2:
        lines.append(f"Seed-paired intervals need at least 2 seeds per run ({seeds} given).")
    dec = cmp.get("decomposition")
    if dec:
        lines += [
            "",
            f"## Gain decomposition (% lower perplexity, {pct} intervals)",
            "",
            f"| term | variant vs reference | gain (mean ± sd) | seed-paired {pct} "
            f"| document bootstrap {pct} | paper |",
            "|---|---|---|---|---|---|",
        ]
        for t in [*dec["terms"], {**dec["total"], "term": "total", "paper_label": None}]:
            paper = f"{t['paper_label']} +{t['paper_gain_pct']:.2f}%" if t.get("paper_label") else "-"
            g = t["gain"]
            lines.append(
                f"| {t['term']} | {t['variant']} vs {t['reference']} | {_mean_sd_cell(g)} | "
                f"{_interval_cell(g['seed_interval'], seed_why)} | "
                f"{_interval_cell(g['bootstrap_interval'], boot_why)} | {paper} |"
            )
        lines += ["", dec["definition"] + "."]
    return "\n".join(lines) + "\n"


def _errors(stats_list: list[dict]):
    """Bar heights and asymmetric error bars (2, n) from each change's interval: seed-paired where
    there are 2 or more seeds, else the document bootstrap, else none (zero length)."""
    import numpy as np

    means, err, kinds = [], np.zeros((2, len(stats_list))), set()
    for j, st in enumerate(stats_list):
        m = st["mean"]
        means.append(np.nan if m is None else m)
        ci = st["seed_interval"] or st["bootstrap_interval"]
        if m is not None and ci:
            err[:, j] = [max(m - ci[0], 0.0), max(ci[1] - m, 0.0)]
            kinds.add("seed-paired" if st["seed_interval"] else "document bootstrap")
    return np.array(means), err, kinds


def plot_comparison(cmp: dict, curves: dict[str, Curve], out: Path) -> list[Path]:
    """loss_curves.png (with the target line), bucket_perplexity.png (grouped bars, log scale, +- sd over
    seeds), bucket_rel_change.png and overall_rel_change.png (change against the baseline with
    interval error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    level = f"{round(100 * cmp.get('confidence', LEVEL))}%"
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, c in curves.items():
            ax.plot(c.x, c.loss, label=name)
        ax.axhline(cmp["target_loss"], color="k", ls=":", label=f"{cmp['baseline']} final")
        ax.set_xlabel(next(iter(curves.values())).x_label)
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        written.append(out / "loss_curves.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    labels = cmp["bucket_labels"]
    others = [r for r in cmp["rows"] if r["name"] != cmp["baseline"]]
    if labels:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(cmp["rows"])
        for k, r in enumerate(cmp["rows"]):
            vals = np.array([b["perplexity"] or np.nan for b in r["buckets"]])
            sd = np.array([b.get("perplexity_sd") or 0.0 for b in r["buckets"]])
            yerr = np.stack([np.minimum(sd, 0.999 * np.nan_to_num(vals)), sd])  # log scale: stay above 0
            ax.bar(np.arange(len(labels)) + k * width, vals, width, yerr=yerr, capsize=2, label=r["name"])
        ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("relative frequency of the target token in the training data")
        ax.set_ylabel(f"perplexity (mean ± sd over {cmp.get('seeds', 1)} seed(s))")
        ax.legend()
        fig.tight_layout()
        written.append(out / "bucket_perplexity.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
        if others:
            fig, ax = plt.subplots(figsize=(8, 4))
            width = 0.8 / len(others)
            kinds = set()
            for k, r in enumerate(others):
                means, err, used = _errors([b["rel_change"] for b in r["buckets"]])
                kinds |= used
                ax.bar(np.arange(len(labels)) + k * width, means, width, yerr=err, capsize=2, label=r["name"])
            ax.axhline(0.0, color="k", lw=0.8)
            ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, fontsize=8)
            ax.set_xlabel("relative frequency of the target token in the training data")
            ax.set_ylabel(f"perplexity change vs {cmp['baseline']} (%)")
            ax.set_title(f"{level} intervals: {', '.join(sorted(kinds)) or 'none'}", fontsize=9)
            ax.legend(fontsize=8)
            fig.tight_layout()
            written.append(out / "bucket_rel_change.png")
            fig.savefig(written[-1], dpi=110)
            plt.close(fig)
    if others:
        fig, ax = plt.subplots(figsize=(1.5 + 1.1 * len(others), 4))
        x = np.arange(len(others))
        stats = [r["rel_change"] for r in others]
        means = np.array([np.nan if s["mean"] is None else s["mean"] for s in stats])
        ax.bar(x, means, 0.6, color="0.8", label=f"mean over {cmp.get('seeds', 1)} seed(s)")
        for j, s in enumerate(stats):
            seeds_x = [j] * len(s["per_seed"])
            ax.plot(seeds_x, [np.nan if v is None else v for v in s["per_seed"]], "k.", ms=4)
        for key, dx, color, name in (
            ("seed_interval", -0.1, "C0", f"seed-paired {level}"),
            ("bootstrap_interval", 0.1, "C3", f"document bootstrap {level}"),
        ):
            err = np.full((2, len(others)), np.nan)
            for j, s in enumerate(stats):
                if s["mean"] is not None and s[key]:
                    err[:, j] = [max(s["mean"] - s[key][0], 0.0), max(s[key][1] - s["mean"], 0.0)]
            have = np.isfinite(err).all(axis=0)
            if have.any():
                ax.errorbar(
                    x[have] + dx,
                    means[have],
                    yerr=err[:, have],
                    fmt="none",
                    ecolor=color,
                    capsize=3,
                    label=name,
                )
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xticks(x, [r["name"] for r in others], fontsize=8)
        ax.set_ylabel(f"perplexity change vs {cmp['baseline']} (%)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out / "overall_rel_change.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
