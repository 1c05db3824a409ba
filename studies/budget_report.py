"""The budget curve's report (`docs/results/budget/curve.md`) from its raw files: LEV - TIED at every
stage, overall and for the inputs seen 1-9 times and the targets of band 0, and the gap's change per
doubling of tokens with a document-bootstrap interval (docs/results/budget/README.md fixes the
reading before the runs).

python -m studies report results/budget/raw docs/results/budget   # the same, with plots/curve.png
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from megatron_lev.errors import DataError
from studies.plan_raw import (
    BOOTSTRAP,
    BOOTSTRAP_SEED,
    LEVEL,
    doc_arrays,
    logged_rows,
    read_raw_json,
    save_plot,
    write_pages,
)
from studies.plans import PLANS, stage_suffix

PLAN = PLANS["budget"]
SLICES = {  # name -> (per-document key of the band, band index); None: every predicted token
    "overall": None,
    "input 1-9": ("input_band", 1),
    "target band 0": ("target_band", 0),
}


def _result(raw: Path, run: str, stage: int, kind: str = "mmidx") -> dict:
    path = raw / run / f"eval{stage_suffix(stage)}.json"
    found = next((r for r in read_raw_json(path).get("results", []) if r.get("corpus_kind") == kind), None)
    if found is None:
        raise DataError(f"{path}: no {kind} result")
    return found


def lo_hi(values: np.ndarray) -> tuple[float, float]:
    """The central `LEVEL` interval of bootstrap statistics."""
    lo, hi = np.quantile(values, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return float(lo), float(hi)


def fit(x: np.ndarray, g: np.ndarray) -> tuple[float, float]:
    """Least-squares `g = a + b x`: (a, b)."""
    b, a = np.polyfit(x, g, 1)
    return float(a), float(b)


RUNS = ("tied-s1234", "lev-s1234")
PAGES = ("curve.md",)


def evaluated(raw: Path) -> tuple[int, ...]:
    """The plan's stages that both runs have an evaluation of (a run stopped early has the first
    few); a DataError where they share fewer than two (no slope to fit)."""
    stages = tuple(
        n for n in PLAN.stages if all((raw / r / f"eval{stage_suffix(n)}.json").is_file() for r in RUNS)
    )
    if len(stages) < 2:
        raise DataError(
            f"{raw}: TIED and LEV share {len(stages)} evaluated stage(s) of {len(PLAN.stages)}; the "
            "curve needs two (collect the runs after their second stage)"
        )
    return stages


def curve(raw: Path, band=None, kind: str = "mmidx") -> dict:
    """LEV - TIED per evaluated stage with its interval, and the fitted slope per doubling with its
    interval (one resample of the documents applied to every stage)."""
    stages = evaluated(raw)
    x = np.log2(np.asarray(stages, dtype=np.float64) / stages[0])
    diffs, per_stage, sides = [], [], []
    for n in stages:
        tt, tn = doc_arrays(_result(raw, RUNS[0], n, kind), band)
        lt, ln = doc_arrays(_result(raw, RUNS[1], n, kind), band)
        if not np.array_equal(tt, lt):
            raise DataError(f"stage {n}: TIED and LEV were not evaluated on the same documents")
        per_stage.append((tt, ln - tn))
        sides.append(tuple(float(v.sum() / tt.sum()) if tt.sum() else math.nan for v in (tn, ln)))
        diffs.append(float((ln - tn).sum() / tt.sum()) if tt.sum() else math.nan)
    g = np.asarray(diffs)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    idx = rng.integers(0, len(per_stage[0][0]), size=(BOOTSTRAP, len(per_stage[0][0])))
    boot = np.stack(
        [d[idx].sum(axis=1) / np.maximum(t[idx].sum(axis=1), 1e-300) for t, d in per_stage], axis=1
    )
    stage_ci = [lo_hi(boot[:, k]) for k in range(len(stages))]
    slopes = np.polyfit(x, boot.T, 1)  # (2, BOOTSTRAP): b, a per resample
    a, b = fit(x, g)
    out = {
        "stages": list(stages),
        "gap": diffs,
        "sides": sides,
        "gap_ci": stage_ci,
        "a": a,
        "b": b,
        "b_ci": lo_hi(slopes[0]),
    }
    if b < 0 < a:  # the fitted line crosses 0 at x* = -a / b doublings of the first stage's tokens
        cross = -slopes[1] / np.where(slopes[0] < 0, slopes[0], np.nan)
        out["crossing_doublings"] = -a / b
        out["crossing_ci"] = lo_hi(cross[np.isfinite(cross)]) if np.isfinite(cross).any() else None
        out["resamples_shrinking"] = float((slopes[0] < 0).mean())
    return out


def trainer_gap(raw: Path) -> list[dict]:
    """LEV - TIED in the trainer's own validation (`train.eval_interval`: the same few validation
    sequences every time) over each evaluated stage's window of steps: how far the gap moves between
    checkpoints at a constant rate, which a single checkpoint's document interval does not include."""
    stages = evaluated(raw)
    loss = [
        {r["iteration"]: r["loss"] for r in logged_rows(raw / run / "metrics.jsonl", "valid")} for run in RUNS
    ]
    out = []
    for prev, n in zip((0, *stages), stages):
        its = sorted(i for i in loss[0].keys() & loss[1].keys() if prev < i <= n)
        gap = np.asarray([loss[1][i] - loss[0][i] for i in its])
        if len(gap) >= 2:
            out.append(
                {
                    "steps": (prev, n),
                    "points": len(gap),
                    "mean": float(gap.mean()),
                    "sd": float(gap.std(ddof=1)),
                    "min": float(gap.min()),
                    "max": float(gap.max()),
                }
            )
    return out


def reading(c: dict) -> str:
    lo, hi = c["b_ci"]
    return "the gap shrinks" if hi < 0 else "the gap does not shrink"


def count_scope(tokens: list[int]) -> str:
    """What the slices' counts are: over the whole training split, which holds more tokens than the full
    run (the plan's split, `README.md`), so an early stage had seen at most its share of the split."""
    full = PLAN.stages[-1] * PLAN.tokens_per_step
    return (
        "The slices' counts (input 1-9, target band 0) are the token's count in the whole training split, "
        "not what a stage had seen: the split holds more tokens than the full run's "
        f"{full / 1e6:.3f}M (one pass covers the run, `README.md`), so the stage at {tokens[0] / 1e6:.3f}M "
        f"tokens had seen at most {tokens[0] / full:.0%} of the split, and a token counted 1-9 times "
        "only a fraction of its count."
    )


def report(raw: Path) -> str:
    stages = evaluated(raw)
    tokens = [n * PLAN.tokens_per_step for n in stages]
    lacks = [n for n in PLAN.stages if n not in stages]
    lines = [
        "# The budget curve: LEV - TIED by tokens",
        "",
        "Validation NLL differences in nats per predicted token, LEV - TIED (positive: LEV behind), one "
        f"seed (1234) per side; 95% document-bootstrap intervals ({BOOTSTRAP} resamples, seed "
        f"{BOOTSTRAP_SEED}, one resample of the documents for every stage). `b`: the least-squares "
        f"change of the gap per doubling of tokens over the {len(stages)} stages evaluated"
        + (" (with two, the change from the first to the second)." if len(stages) == 2 else "."),
        "",
        count_scope(tokens),
        "",
    ]
    if lacks:
        lines += [
            f"**Partial: {len(stages)} of the plan's {len(PLAN.stages)} stages.** Evaluated at "
            f"{', '.join(f'{n:,}' for n in stages)} steps; not run: {', '.join(f'{n:,}' for n in lacks)} "
            "steps (the README's amendment says what a partial can and cannot decide).",
            "",
        ]
    lines += [
        "| slice | " + " | ".join(f"{t / 1e6:.3f}M tokens" for t in tokens) + " | b per doubling | reading |",
        "|---|" + "---|" * (len(tokens) + 2),
    ]
    curves = {}
    for name, band in SLICES.items():
        c = curves[name] = curve(raw, band)
        cells = [
            f"{g:+.3f} [{lo:+.3f}, {hi:+.3f}]" for g, (lo, hi) in zip(c["gap"], c["gap_ci"], strict=True)
        ]
        b_lo, b_hi = c["b_ci"]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {c['b']:+.4f} [{b_lo:+.4f}, {b_hi:+.4f}] | {reading(c)} |"
        )
    lines += [
        "",
        "Each side's NLL (nats per predicted token of the slice) at every stage:",
        "",
        "| slice | side | " + " | ".join(f"{t / 1e6:.3f}M" for t in tokens) + " |",
        "|---|---|" + "---|" * len(tokens),
    ]
    for name, c in curves.items():
        for k, side in enumerate(("TIED", "LEV")):
            lines.append(f"| {name} | {side} | " + " | ".join(f"{nll[k]:.3f}" for nll in c["sides"]) + " |")
    overall = curves["overall"]
    lines += ["", f"**Overall: {reading(overall)}** (the README's criterion: the interval of `b` below 0)."]
    if "crossing_doublings" in overall:
        ci = overall["crossing_ci"]
        at = tokens[0] * 2 ** overall["crossing_doublings"]
        span = (
            "no interval"
            if ci is None
            else f"[{tokens[0] * 2 ** ci[0] / 1e6:.1f}M, {tokens[0] * 2 ** ci[1] / 1e6:.1f}M]"
        )
        lines.append(
            f"The fitted line crosses 0 at {at / 1e6:.1f}M tokens ({span} over the resamples with a "
            f"falling line, {overall['resamples_shrinking']:.0%} of them): an extrapolation from "
            f"{len(stages)} points of one seed, not a prediction of a longer run."
        )
    limit = 2 * PLAN.stages[-1] * PLAN.tokens_per_step  # twice the full run's tokens
    ci = overall.get("crossing_ci")
    near = reading(overall) == "the gap shrinks" and ci is not None and tokens[0] * 2 ** ci[1] <= limit
    longer = f"over a {tokens[-1] / tokens[0]:.0f}x longer run with a constant rate"
    if near and lacks:
        verdict = (
            f"the partial points towards a change (the crossing's interval lies within {limit / 1e6:.1f}M "
            "tokens), but a partial does not change the verdict: the stages not run decide."
        )
    elif near:
        verdict = f"it changes: the gap shrinks and crosses within {limit / 1e6:.1f}M tokens."
    else:
        verdict = f'the regime\'s verdict stands, with "{longer}" added to its scope.'
    lines += ["", f"**The verdict at this scale** (the README's rule): {verdict}"]
    windows = trainer_gap(raw)
    if windows:
        lines += [
            "",
            "## Between the stages: the trainer's validation gap (not the plan's criterion)",
            "",
            "Added after stage 3 was evaluated. The trainer validates both runs every "
            "`train.eval_interval` steps on the same few validation sequences; LEV - TIED there, "
            "over each stage's window of steps. At a constant rate the gap moves between checkpoints "
            "by about its sd here, and a single checkpoint's gap (the table above) carries that "
            "movement, which its document interval does not include.",
            "",
            "| steps | points | mean | sd | min | max |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {w['steps'][0] + 1:,}-{w['steps'][1]:,} | {w['points']} | {w['mean']:+.3f} | {w['sd']:.3f} "
            f"| {w['min']:+.3f} | {w['max']:+.3f} |"
            for w in windows
        ]
    return "\n".join(lines) + "\n"


def write_plot(raw: Path, out: Path) -> None:
    """LEV - TIED by tokens per slice, with the stages' intervals and the fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = np.asarray([n * PLAN.tokens_per_step for n in evaluated(raw)], dtype=np.float64)
    x = np.log2(tokens / tokens[0])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, band in SLICES.items():
        c = curve(raw, band)
        g = np.asarray(c["gap"])
        err = np.abs(np.asarray(c["gap_ci"]).T - g)
        line = ax.errorbar(tokens / 1e6, g, yerr=err, fmt="o", capsize=3, label=f"{name} (b {c['b']:+.3f})")
        ax.plot(tokens / 1e6, c["a"] + c["b"] * x, "--", color=line[0].get_color(), lw=0.9)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("LEV - TIED, validation NLL (nats)")
    ax.legend(fontsize=8)
    save_plot(fig, out, "curve.png")


def write_budget_report(raw: Path, out: Path, plots: bool = True) -> dict[str, Path]:
    """`curve.md` (and `plots/curve.png`) from the budget plan's raw files."""
    paths = write_pages(Path(out), {PAGES[0]: report(Path(raw))})
    if plots:
        write_plot(Path(raw), Path(out))
    return paths


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.exit(
            "usage: python -m studies.budget_report RAW_DIR OUT_DIR (results/budget/raw docs/results/budget)"
        )
    for path in write_budget_report(Path(args[0]), Path(args[1])).values():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
