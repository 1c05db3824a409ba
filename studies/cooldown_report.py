"""The cooled budget curve's report (`docs/results/cooldown/cooled.md`) from its raw files: LEV - TIED
at each stage of the constant-rate runs and of their cool-down branches, what the cool-down moves,
and the gap's change per doubling of tokens, cooled and not, per seed and over seeds
(docs/results/cooldown/README.md fixes the readings before the runs).

python -m studies report results/cooldown/raw docs/results/cooldown   # cooled.md, plots/cooled.png
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import numpy as np

from megatron_lev.errors import DataError
from studies.budget_report import SLICES, lo_hi
from studies.clip_report import PAPER
from studies.plan_raw import (
    BOOTSTRAP,
    BOOTSTRAP_SEED,
    doc_arrays,
    logged_rows,
    read_raw_json,
    save_plot,
    seed_interval,
    write_pages,
)
from studies.plans import PLANS, stage_suffix, study_plan

PLAN = PLANS["cooldown"]
SEEDS = tuple(dict.fromkeys(r.seed for r in study_plan("cooldown")))  # the seeds the plan runs
PAGES = ("cooled.md", "calibration.md")  # calibration.md: from the records `studies calibrate` writes
KINDS = {"constant": "", "cooled": "-cool"}  # the file infix of a stage's and of its branch's evaluation
WINDOW = 300  # the trainer's validations in the last WINDOW steps before a stage give s_ckpt
Z = 1.96


def _path(raw: Path, run: str, stage: int, kind: str) -> Path:
    return raw / run / f"eval{KINDS[kind]}{stage_suffix(stage)}.json"


@functools.lru_cache(maxsize=32)
def _read(path: Path, mtime_ns: int) -> dict:
    """An evaluation file, read once however many slices and buckets the report takes from it."""
    return read_raw_json(path)


def _result(raw: Path, run: str, stage: int, kind: str, corpus: str = "mmidx") -> dict:
    path = _path(raw, run, stage, kind)
    mtime = path.stat().st_mtime_ns if path.is_file() else 0
    found = next((r for r in _read(path, mtime).get("results", []) if r.get("corpus_kind") == corpus), None)
    if found is None:
        raise DataError(f"{path}: no {corpus} result")
    return found


def seeds_and_stages(raw: Path) -> dict[int, tuple[int, ...]]:
    """{seed: the plan's stages both sides have a constant and a cooled evaluation of}, for the seeds
    with at least one such stage."""
    out = {}
    for seed in SEEDS:
        runs = (f"tied-s{seed}", f"lev-s{seed}")
        stages = tuple(
            n for n in PLAN.stages if all(_path(raw, r, n, kind).is_file() for r in runs for kind in KINDS)
        )
        if stages:
            out[seed] = stages
    if not out:
        raise DataError(f"{raw}: no stage with both sides' constant and cooled evaluations")
    return out


def _gaps(raw: Path, seed: int, stages, band, corpus: str = "mmidx"):
    """Per kind: per stage (per-document tokens, LEV - TIED NLL sums); the same documents throughout."""
    out = {}
    for kind in KINDS:
        per = []
        for n in stages:
            tt, tn = doc_arrays(_result(raw, f"tied-s{seed}", n, kind, corpus), band)
            lt, ln = doc_arrays(_result(raw, f"lev-s{seed}", n, kind, corpus), band)
            if not np.array_equal(tt, lt):
                raise DataError(f"seed {seed} stage {n} ({kind}): TIED and LEV on other documents")
            per.append((tt, ln - tn))
        out[kind] = per
    first = out["constant"][0][0]
    if any(not np.array_equal(t, first) for per in out.values() for t, _ in per):
        raise DataError(f"seed {seed}: the stages or branches were not evaluated on the same documents")
    return out


def s_ckpt(raw: Path, seed: int, stages) -> float:
    """The sd of the trainer's validation gap (LEV - TIED) over its evaluations in the `WINDOW` steps
    before each stage's checkpoint, pooled over the stages (the mean of their variances)."""
    loss = [
        {r["iteration"]: r["loss"] for r in logged_rows(raw / f"{side}-s{seed}" / "metrics.jsonl", "valid")}
        for side in ("tied", "lev")
    ]
    variances = []
    for n in stages:
        its = sorted(i for i in loss[0].keys() & loss[1].keys() if n - WINDOW < i <= n)
        gap = [loss[1][i] - loss[0][i] for i in its]
        if len(gap) >= 2:
            variances.append(float(np.var(gap, ddof=1)))
    return math.sqrt(sum(variances) / len(variances)) if variances else math.nan


def seed_curve(raw: Path, seed: int, stages, band=None, corpus: str = "mmidx") -> dict:
    """One seed's gaps (constant `g`, cooled `gc`, their difference `d`) per stage with document
    intervals, and per kind the slope per doubling `b` with its document interval (one resample of the
    documents for every stage and kind)."""
    per = _gaps(raw, seed, stages, band, corpus)
    n_docs = len(per["constant"][0][0])
    idx = np.random.default_rng(BOOTSTRAP_SEED).integers(0, n_docs, size=(BOOTSTRAP, n_docs))

    def point(t, d):
        return float(d.sum() / t.sum()) if t.sum() else math.nan

    def boot(t, d):
        return d[idx].sum(axis=1) / np.maximum(t[idx].sum(axis=1), 1e-300)

    out: dict = {"stages": list(stages)}
    boots = {}
    for kind, arrays in per.items():
        out[kind] = [point(t, d) for t, d in arrays]
        boots[kind] = np.stack([boot(t, d) for t, d in arrays], axis=1)  # (BOOTSTRAP, stages)
        out[f"{kind}_ci"] = [lo_hi(boots[kind][:, k]) for k in range(len(stages))]
    diff = boots["cooled"] - boots["constant"]
    out["d"] = [c - g for c, g in zip(out["cooled"], out["constant"], strict=True)]
    out["d_ci"] = [lo_hi(diff[:, k]) for k in range(len(stages))]
    if len(stages) >= 2:
        x = np.log2(np.asarray(stages, dtype=np.float64) / stages[0])
        out["sxx"] = float(((x - x.mean()) ** 2).sum())
        for kind in KINDS:
            out[f"b_{kind}"] = float(np.polyfit(x, np.asarray(out[kind]), 1)[0])
            out[f"b_{kind}_ci"] = lo_hi(np.polyfit(x, boots[kind].T, 1)[0])
    return out


def widened(b: float, ci: tuple[float, float], s: float, sxx: float) -> tuple[float, float]:
    """The README's one-seed interval of a slope: the document half-width combined with the
    checkpoint-to-checkpoint sd `s` carried by a line over points with spread `sxx`."""
    half = math.sqrt(((ci[1] - ci[0]) / 2) ** 2 + (Z * s) ** 2 / sxx)
    return b - half, b + half


def reading(ci: tuple[float, float] | None) -> str:
    if ci is None:
        return "-"
    if ci[0] > 0:
        return "the gap grows when cooled"
    if ci[1] < 0:
        return "the gap shrinks when cooled"
    return "cooled, the trend is not resolved"


def _fmt(v: float, ci=None, digits: int = 3) -> str:
    cell = f"{v:+.{digits}f}"
    return cell if ci is None else f"{cell} [{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"


def report(raw: Path) -> str:
    have = seeds_and_stages(raw)
    lacks = [
        f"seed {s}: {', '.join(f'{n:,}' for n in PLAN.stages if n not in have.get(s, ()))}"
        for s in SEEDS
        if len(have.get(s, ())) < len(PLAN.stages)
    ]
    lines = [
        "# The budget curve cooled down: LEV - TIED, constant rate and annealed",
        "",
        "Validation NLL differences in nats per predicted token, LEV - TIED (positive: LEV behind). "
        "`g`: the constant-rate checkpoint at the stage; `gc`: its cool-down branch (the rate decayed "
        "linearly to a tenth over 10% more steps); `d = gc - g`. Brackets: 95% document-bootstrap "
        f"intervals ({BOOTSTRAP} resamples, seed {BOOTSTRAP_SEED}, one resample of the documents for "
        "every stage, branch and seed). The slices count a token over the whole training split (the "
        "budget's `curve.md` says what an early stage had seen of it).",
        "",
    ]
    if lacks:
        lines += [f"**Partial.** Not evaluated: {'; '.join(lacks)} (steps).", ""]
    curves = {}
    for seed, stages in have.items():
        s = s_ckpt(raw, seed, stages)
        lines += [
            f"## Seed {seed}",
            "",
            "| slice | stage | tokens | g | gc | d = gc - g |",
            "|---|---|---|---|---|---|",
        ]
        for name, band in SLICES.items():
            c = curves[seed, name] = seed_curve(raw, seed, stages, band)
            for k, n in enumerate(stages):
                cells = [_fmt(c[key][k], c[f"{key}_ci"][k]) for key in ("constant", "cooled", "d")]
                tokens = f"{n * PLAN.tokens_per_step / 1e6:.3f}M"
                lines.append(f"| {name} | {n:,} | {tokens} | " + " | ".join(cells) + " |")
        if len(stages) >= 2:
            lines += [
                "",
                f"Per doubling of tokens over {len(stages)} stages. `s_ckpt` = {s:.4f} nats (the trainer's "
                f"validation gap, sd over its evaluations in the {WINDOW} steps before each stage, pooled); "
                "the widened interval (README) applies to the overall slice, whose gap the trainer "
                "validates; the slices' intervals are the documents' only.",
                "",
                "| slice | b (constant) | bc (cooled), document 95% | bc, widened 95% | reading |",
                "|---|---|---|---|---|",
            ]
            for name in SLICES:
                c = curves[seed, name]
                wide = widened(c["b_cooled"], c["b_cooled_ci"], s, c["sxx"]) if name == "overall" else None
                c["bc_decide"] = wide or c["b_cooled_ci"]
                lines.append(
                    f"| {name} | {_fmt(c['b_constant'], c['b_constant_ci'], 4)} | "
                    f"{_fmt(c['b_cooled'], c['b_cooled_ci'], 4)} | "
                    f"{_fmt(c['b_cooled'], wide, 4) if wide else '-'} | {reading(c['bc_decide'])} |"
                )
        lines.append("")
    lines += _over_seeds(have, curves, raw)
    lines += _zero_shot(raw, have)
    return "\n".join(lines).rstrip() + "\n"


def _over_seeds(have: dict, curves: dict, raw: Path) -> list[str]:
    """The readings: what cooling moves at each stage every seed has; the cooled trend over the seeds,
    each seed's `bc` fitted over the stages they all have (the seeds' slopes over the same tokens);
    and a seed with more stages than that, alone over all of its stages (widened)."""
    common = sorted(set.intersection(*(set(have[s]) for s in have))) if have else []
    lines = ["## Readings", ""]
    moved = []
    for n in common:
        cis = [curves[s, "overall"]["d_ci"][have[s].index(n)] for s in have]
        if all(lo > 0 for lo, _ in cis) or all(hi < 0 for _, hi in cis):
            moved.append(n)
    for n in common:
        ds = [curves[s, "overall"]["d"][have[s].index(n)] for s in have]
        verdict = "moves the gap" if n in moved else "does not move the gap at this resolution"
        lines.append(
            f"- **Stage {n:,}: cooling {verdict}** (overall d per seed: {', '.join(_fmt(d) for d in ds)})."
        )
    seeds = list(have) if len(common) >= 2 else []
    if len(seeds) >= 2:
        bcs = [
            curves[s, "overall"]["b_cooled"]
            if len(have[s]) == len(common)
            else seed_curve(raw, s, tuple(common))["b_cooled"]
            for s in seeds
        ]
        ci = seed_interval(bcs)
        span = f"stages {common[0]:,}-{common[-1]:,}"
        lines.append(
            f"- **Over seeds {', '.join(map(str, seeds))}** ({span}): bc = "
            f"{_fmt(float(np.mean(bcs)), ci, 4)} (Student t, {len(seeds) - 1} df): {reading(ci)}."
        )
    alone = [s for s in have if len(have[s]) >= 2 and (len(seeds) < 2 or len(have[s]) > len(common))]
    for s in alone:
        c = curves[s, "overall"]
        lines.append(
            f"- **Seed {s} alone** (stages {have[s][0]:,}-{have[s][-1]:,}): bc = "
            f"{_fmt(c['b_cooled'], c['bc_decide'], 4)} (widened): {reading(c['bc_decide'])}; b at a "
            f"constant rate on the same runs = {_fmt(c['b_constant'], c['b_constant_ci'], 4)} (documents)."
        )
    return [*lines, ""]


def _zero_shot(raw: Path, have: dict) -> list[str]:
    """LEV - TIED on the zero-shot corpus, overall and by the paper's target buckets, constant-rate
    and cooled, at each stage."""
    lines = []
    for seed, stages in have.items():
        first = _result(raw, f"tied-s{seed}", stages[0], "cooled", "text")
        slices = [("overall", None)] + [
            (str(b["bucket"]), (PAPER, k)) for k, b in enumerate(first.get("buckets") or [])
        ]
        lines += [
            f"## Zero-shot corpus by the paper's target buckets (seed {seed})",
            "",
            "LEV - TIED on the held-out subset (never trained on), g / gc with document 95% intervals; a "
            "bucket is the target's frequency in the training split. Reported, not deciding.",
            "",
            "| target | stage | g | gc | d = gc - g |",
            "|---|---|---|---|---|",
        ]
        for label, band in slices:
            for n in stages:
                c = seed_curve(raw, seed, (n,), band, "text")
                cells = [_fmt(c[key][0], c[f"{key}_ci"][0]) for key in ("constant", "cooled", "d")]
                lines.append(f"| {label} | {n:,} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot(raw: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for seed, stages in seeds_and_stages(raw).items():
        c = seed_curve(raw, seed, stages)
        t = np.asarray(stages) * PLAN.tokens_per_step / 1e6
        for kind, style in (("constant", "o--"), ("cooled", "s-")):
            lo, hi = np.asarray(c[f"{kind}_ci"]).T
            y = np.asarray(c[kind])
            ax.errorbar(t, y, yerr=[y - lo, hi - y], fmt=style, capsize=3, label=f"seed {seed}, {kind}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("LEV - TIED validation NLL (nats)")
    ax.set_title("The budget gap, constant rate and cooled down")
    ax.legend(fontsize=8)
    return save_plot(fig, out, "cooled.png")


def write_cooldown_report(raw: Path, out: Path, plots: bool = True) -> dict[str, Path]:
    raw, out = Path(raw), Path(out)
    from studies import calibration_report

    pages = {"cooled.md": report(raw)}
    have = calibration_report.records(raw)  # read and checked once
    if have:
        pages["calibration.md"] = calibration_report.report(raw, have)
    written = write_pages(out, pages)
    if plots:
        written["cooled.png"] = plot(raw, out)
    return written


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
