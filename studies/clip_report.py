"""The clip experiment's tables, plots and verdict, from its raw files and the regime's.

    write_clip_report("results/clip/raw", "docs/results/clip")

The criteria are those `docs/results/clip/README.md` fixed before the runs. The experiment's own runs
(plan `clip`) are read beside the regime's (`../regime/raw`, plan `regime`), whose groups are shown
with a suffix: `TIED-R`, `LEV-R` and `ALBERT-32-R` ran on the regime's code (DeepSpeed clipped them);
UNTIED's seed 1234 is the regime's and its seeds 1235 and 1236 this experiment's, one group.
Deterministic output (fixed bootstrap seed, plan order, formats).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from megatron_lev.analysis.perplexity import COUNT_EDGES, count_band_labels
from megatron_lev.errors import DataError
from studies import regime_report as rr
from studies.plan_raw import (
    BOOTSTRAP,
    BOOTSTRAP_SEED,
    COUNT_SCOPE,
    LEVEL,
    PlanRaw,
    fmt_value,
    read_raw_json,
    save_plot,
    scale_phrase,
    seed_contrasts,
    seed_interval,
    write_pages,
)

PAGES = ("overall.md", "bands.md", "clipping.md", "rows.md", "verdict.md")
REGIME_NAMES = {"TIED": "TIED-R", "LEV": "LEV-R", "ALBERT-32": "ALBERT-32-R", "UNTIED": "UNTIED"}
TIED, LEV_SC, TIED_R, LEV_R, ALBERT_R = "TIED", "LEV-SC", "TIED-R", "LEV-R", "ALBERT-32-R"
UNTIED, TIED_C0, LEV_C0 = "UNTIED", "TIED-C0", "LEV-C0"
# the paper's target buckets: training frequency < 1e-7, ..., >= 1e-4 (evaluate's `buckets`)
PAPER = "bucket"
FACTOR_STEPS = (10, 100, 300, 600, 1000)
CLIP_GRAD = 1.0  # train.clip_grad of every clipped run (the regime's config)


class CombinedRaw:
    """The clip plan's runs and the regime's (renamed, `REGIME_NAMES`), read through their own
    `PlanRaw`; the interface `regime_report.comparison` and `verdict` use."""

    def __init__(self, clip: PlanRaw, regime: PlanRaw, names: dict[str, str] | None = None):
        self.clip, self.regime = clip, regime
        runs = [{**r, "source": "clip"} for r in clip.runs]
        runs += [
            {**r, "group": REGIME_NAMES[r["group"]], "source": "regime"}
            for r in regime.runs
            if r["group"] in REGIME_NAMES
        ]
        if names:  # a view under other group names (the regime's verdict reads TIED, LEV, ALBERT-32)
            runs = [{**r, "group": names[r["group"]]} for r in runs if r["group"] in names]
        self.runs = runs

    def _raw(self, run: dict) -> PlanRaw:
        return self.clip if run["source"] == "clip" else self.regime

    def result(self, run: dict, kind: str = "mmidx") -> dict:
        return self._raw(run).result(run, kind)

    def train_rows(self, run: dict) -> list[dict]:
        return self._raw(run).train_rows(run)

    def valid_rows(self, run: dict) -> list[dict]:
        return self._raw(run).valid_rows(run)

    def at(self, run: dict, iteration: int) -> dict | None:
        return self._raw(run).at(run, iteration)

    def preliminary(self) -> str | None:
        return self.clip.preliminary()

    def seeds(self, group: str) -> dict[int, dict]:
        return {r["seed"]: r for r in self.runs if r["group"] == group}

    def view(self, names: dict[str, str]) -> CombinedRaw:
        """These runs with only the groups in `names`, renamed."""
        return CombinedRaw(self.clip, self.regime, names)


def change(raw: CombinedRaw, kind: str, band: tuple[str, int] | None = None) -> dict | None:
    """`C = (LEV-SC - TIED) - (LEV-R - TIED-R)` per seed, over the seeds all four have."""
    groups = (LEV_SC, TIED, LEV_R, TIED_R)
    common = sorted(set.intersection(*(set(raw.seeds(g)) for g in groups)))
    if not common:
        return None
    signs = (1.0, -1.0, -1.0, 1.0)
    sets = [[(s, raw.result(raw.seeds(g)[seed], kind)) for s, g in zip(signs, groups)] for seed in common]
    values, interval = seed_contrasts(sets, band)
    if not values:
        return {"seeds": common, "diffs": [], "mean": None, "document": None, "seed": None}
    return {
        "seeds": common,
        "diffs": values,
        "mean": statistics.fmean(values),
        "document": interval,
        "seed": seed_interval(values),
    }


COMPARISONS = (  # (a, b): a - b over the seeds both have
    (LEV_SC, TIED),
    (LEV_R, TIED_R),
    (LEV_R, UNTIED),
    (LEV_SC, UNTIED),
    (LEV_SC, LEV_R),
    (TIED, TIED_R),
    (UNTIED, TIED),
    (TIED_C0, TIED),
    (LEV_C0, LEV_R),
)
CONTRAST = "C = (LEV-SC - TIED) - (LEV-R - TIED-R)"


def _rows(raw: CombinedRaw, kind: str, band: tuple[str, int] | None) -> list[str]:
    lines = []
    for a, b in COMPARISONS:
        c = rr.comparison(raw, a, b, kind, band)
        if c is not None:
            lines.append(f"| {a} - {b} | " + " | ".join(rr._diff_cells(c)) + " |")
    c = change(raw, kind, band)
    if c is not None:
        lines.append(f"| {CONTRAST} | " + " | ".join(rr._diff_cells(c)) + " |")
    return lines


def _header(raw: CombinedRaw, title: str) -> list[str]:
    lines = [f"# Clip: {title}", ""]
    if preliminary := raw.preliminary():
        lines += [preliminary, ""]
    lines += [
        "Groups: this experiment's TIED, LEV-SC (LEV with its seed side clipped on its own), TIED-C0 and "
        "LEV-C0 (no clipping), UNTIED (seed 1234 the regime's run, 1235 and 1236 this experiment's); "
        "the regime's TIED-R, LEV-R and ALBERT-32-R (its code: DeepSpeed clipped them). Differences in "
        "nats per predicted token, negative: the first group is ahead; document bootstrap "
        f"{LEVEL:.0%} over the seed pairs ({BOOTSTRAP} resamples, seed {BOOTSTRAP_SEED}) and the "
        "seed-paired Student-t.",
    ]
    return lines


def overall_markdown(raw: CombinedRaw) -> str:
    lines = _header(raw, "overall validation and zero-shot loss")
    lines += ["", "| group | seeds | validation NLL | zero-shot NLL |", "|---|---|---|---|"]
    for group in dict.fromkeys(r["group"] for r in raw.runs):
        runs = raw.seeds(group)
        cells = [
            rr._fmt_seeds([float(raw.result(r, kind)["mean_nll"]) for r in runs.values()])
            for kind, _ in rr.CORPORA
        ]
        lines.append(f"| {group} | {', '.join(str(s) for s in sorted(runs))} | " + " | ".join(cells) + " |")
    for kind, label in rr.CORPORA:
        lines += [
            "",
            f"## {label}",
            "",
            "| comparison | difference | document 95% | seed-paired 95% | per seed |",
            "|---|---|---|---|---|",
            *_rows(raw, kind, None),
        ]
    return "\n".join(lines) + "\n"


def _band_sets(raw: CombinedRaw, kind: str) -> list[tuple[str, str, list[str]]]:
    """(section title, band key, band labels): input and target count bands, and the paper's target
    frequency buckets where the evaluation has them."""
    labels = count_band_labels(COUNT_EDGES)
    out = [("input count", "input_band", labels), ("target count", "target_band", labels)]
    first = next(iter(raw.seeds(TIED).values()), None) or next(iter(raw.runs), None)
    if first is not None:
        buckets = raw.result(first, kind).get("buckets") or []
        if buckets:
            out.append(("target frequency (the paper's buckets)", PAPER, [str(b["bucket"]) for b in buckets]))
    return out


def bands_markdown(raw: CombinedRaw) -> str:
    lines = _header(raw, "loss by band")
    lines += [
        "",
        "Count bands: the training count of the input token or of the target (`evaluate`'s "
        "`count_bands`). The paper's buckets: the target's frequency in the training split (its count "
        "over the split's tokens), `< 1e-07` being the paper's rare tokens; on this split that is the "
        "targets never seen in training. Beside each band: the first TIED seed's predicted tokens of the "
        f"band. {COUNT_SCOPE}",
    ]
    for kind, label in rr.CORPORA:
        for title, key, labels in _band_sets(raw, kind):
            lines += [
                "",
                f"## {label}, by {title}",
                "",
                "| band | tokens | comparison | difference | document 95% | seed-paired 95% | per seed |",
                "|---|---|---|---|---|---|---|",
            ]
            first = next(iter(raw.seeds(TIED).values()), None)
            for b, band_label in enumerate(labels):
                tokens = "-"
                if first is not None:
                    doc = raw.result(first, kind).get("per_document") or {}
                    counts = doc.get(f"{key}_tokens")
                    if counts is not None:
                        tokens = f"{int(sum(counts[b])):,}"
                for row in _rows(raw, kind, (key, b)):
                    lines.append(f"| {band_label} | {tokens} " + row)
    return "\n".join(lines) + "\n"


def factors(raw: CombinedRaw, run: dict) -> list[tuple[int, float, float | None]]:
    """(step, global factor, seed-side factor) at each logged step: the logged `clip_factor/*`, or for
    a regime run (whose clipping DeepSpeed did, not logged) `min(1, 1 / (grad_norm + 1e-6))` from its
    logged norm."""
    out = []
    for r in raw.train_rows(run):
        if "clip_factor/global" in r:
            out.append((r["iteration"], r["clip_factor/global"], r.get("clip_factor/lev_seed")))
        elif r.get("grad_norm") is not None and "clip_grad=0" not in " ".join(run.get("overrides", [])):
            out.append((r["iteration"], min(1.0, CLIP_GRAD / (r["grad_norm"] + 1e-6)), None))
    return out


def clipping_markdown(raw: CombinedRaw) -> str:
    lines = [
        "# Clip: the clip factors over training",
        "",
        "What each logged step's gradients were multiplied by (every 10 steps, `metrics.jsonl`): "
        "`clip_factor/global` (every parameter no clip group takes) and, for LEV-SC, `clip_factor/lev_seed` "
        "(the codebooks and `W_l`, clipped on their own norm). The regime's runs logged no factor: "
        "theirs is `min(1, 1 / (grad_norm + 1e-6))` from the norm DeepSpeed clipped with. Runs without "
        "clipping (C0) have factor 1.",
    ]
    lines += ["", *rerun_lines(raw), "", "## Clip factors by run", ""]
    lines += [
        "| run | logged steps | clipped (global) | median global factor | median seed-side factor | "
        + " | ".join(f"global at {s}" for s in FACTOR_STEPS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(FACTOR_STEPS),
    ]
    for run in raw.runs:
        rows = factors(raw, run)
        if not rows:
            continue
        by_step = {s: g for s, g, _ in rows}
        seed = [f for _, _, f in rows if f is not None]
        cells = [
            run["name"] if run["source"] == "clip" else f"{run['name']} (regime)",
            str(len(rows)),
            f"{sum(g < 1 for _, g, _ in rows)}/{len(rows)}",
            f"{statistics.median(g for _, g, _ in rows):.3f}",
            f"{statistics.median(seed):.3f}" if seed else "-",
            *(fmt_value(by_step.get(s), ".3f") for s in FACTOR_STEPS),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", *update_lines(raw)]) + "\n"


UPDATE_KEYS = ("update_ratio/group/decay", "update_ratio/group/no_decay")
UPDATE_RANGE = (100, 1000)  # after the warm-up


def update_lines(raw: CombinedRaw) -> list[str]:
    """The median update ratio (|update| / |weight|) of the optimizer's two default groups over the
    logged steps in `UPDATE_RANGE`: what clipping did to the step sizes AdamW took."""
    lo, hi = UPDATE_RANGE
    lines = [
        "## Update sizes by run",
        "",
        f"The median over the logged steps {lo}-{hi} of the update ratio (norm of the step over norm of the "
        "weights) of the weight-decay group (every matrix outside a clip or rate group: attention, MLP, "
        "the output head, and for TIED its table) and of the no-decay group (norm gains), from "
        "`metrics.jsonl`. AdamW's step hardly depends on a constant gradient scale, so a clip factor "
        "shows here only through how it changes from step to step.",
        "",
        "| run | logged steps | decay group | no-decay group |",
        "|---|---|---|---|",
    ]
    for run in raw.runs:
        rows = [r for r in raw.train_rows(run) if lo <= r["iteration"] <= hi and UPDATE_KEYS[0] in r]
        if not rows:
            continue
        name = run["name"] if run["source"] == "clip" else f"{run['name']} (regime)"
        meds = [statistics.median(r[k] for r in rows if r.get(k) is not None) for k in UPDATE_KEYS]
        lines.append(f"| {name} | {len(rows)} | {meds[0]:.5f} | {meds[1]:.6f} |")
    return lines


def _median_global_factor(raw: CombinedRaw, group: str, seed: int) -> float | None:
    run = raw.seeds(group).get(seed)
    rows = factors(raw, run) if run is not None else []
    return statistics.median(g for _, g, _ in rows) if rows else None


def rows_markdown(raw: CombinedRaw) -> str:
    """The output layer's rows by the training count of their token: Adam's state at each run's final
    checkpoint (`output_rows.json`, `python -m studies rows`), and what a constant clip factor would
    make of the never-seen rows' eps share."""
    lines = [
        "# Clip: Adam's state of the output rows",
        "",
        "Per training-count band of the row's token, at each run's final checkpoint "
        "(`output_rows.json`, written by `python -m studies rows runs/clip results/clip/raw` from the "
        "checkpoint and the split's training counts; the regime's checkpoints were not kept): the "
        "median of `sqrt(v_hat)` over the band's elements with its 10% and 90% quantiles, the median "
        "share of Adam's `eps` in the step's denominator, `eps / (sqrt(v_hat) + eps)`, the median step "
        "per element before the learning rate, `|m_hat| / (sqrt(v_hat) + eps)`, and the median L2 norm "
        "of the rows. The output layer is LEV's and UNTIED's head and TIED's table. A row whose token "
        "is never a training target gets only the softmax's push-down, whose size falls with the row's "
        "logit: where `sqrt(v_hat)` nears `eps`, the step shrinks, and a clip factor `f` scales "
        f"`sqrt(v_hat)` by `f`. {COUNT_SCOPE}",
        "",
    ]
    found = [(r, raw.clip.root / r["name"] / "output_rows.json") for r in raw.runs if r["source"] == "clip"]
    found = [(r, p) for r, p in found if p.is_file()]
    if not found:
        return "\n".join([*lines, "No run has `output_rows.json` yet."]) + "\n"
    lines += [
        "| run | band | rows | median sqrt(v_hat) [10%, 90%] | eps share | Adam step | row norm |",
        "|---|---|---|---|---|---|---|",
    ]
    never: dict[str, tuple[float, float, float]] = {}  # run -> (median sqrt(v_hat) of band 0, eps, factor)
    for run, path in found:
        rec = read_raw_json(path)
        eps = rec["adam_eps"]
        for b in rec["bands"]:
            if not b["rows"]:
                continue
            s = b["sqrt_v"]
            lines.append(
                f"| {run['name']} | {b['band']} | {b['rows']:,} | {s['q50']:.2e} [{s['q10']:.2e}, "
                f"{s['q90']:.2e}] | {b['eps_share_median']:.3f} | {b['adam_step_median']:.3f} | "
                f"{b['row_norm_median']:.3f} |"
            )
            own = factors(raw, run)
            if b["band"] == "0" and own:
                never[run["name"]] = (s["q50"], eps, statistics.median(g for _, g, _ in own))
    f = _median_global_factor(raw, LEV_R, 1234)
    if f is not None and never:
        lines += [
            "",
            f"**Arithmetic, not a measurement**: the regime's LEV (seed 1234) was clipped by a median "
            f"global factor `f` of {f:.3f} (`clipping.md`); each run here had its own median global factor "
            "`f_run` (1 without clipping). Were the never-seen rows' gradients of each run scaled by "
            "`f / f_run` instead, their median eps share `eps / ((f / f_run) sqrt(v_hat) + eps)` would be:",
            "",
            "| run | median sqrt(v_hat), band 0 | f_run | eps share as is | at f |",
            "|---|---|---|---|---|",
        ]
        for name, (s, eps, own) in never.items():
            scaled = f / own * s
            lines.append(
                f"| {name} | {s:.2e} | {own:.3f} | {eps / (s + eps):.3f} | {eps / (scaled + eps):.3f} |"
            )
    return "\n".join(lines) + "\n"


RERUN_STEPS = (10, 20, 30, 40, 50)


def rerun_lines(raw: CombinedRaw) -> list[str]:
    """TIED on this code against the regime's TIED (its clipping DeepSpeed's), seed 1234: the training
    loss at the first logged steps, and whether they are bit-identical (the README's check)."""
    new, old = raw.seeds(TIED).get(1234), raw.seeds(TIED_R).get(1234)
    lines = ["## TIED rerun against the regime's TIED (seed 1234)", ""]
    if new is None or old is None:
        return [*lines, "Not available: a run is missing."]
    a = {r["iteration"]: r for r in raw.train_rows(old)}
    b = {r["iteration"]: r for r in raw.train_rows(new)}
    lines += [
        "| step | regime loss | this code | equal | regime grad norm | this code |",
        "|---|---|---|---|---|---|",
    ]
    differ = []
    for step in RERUN_STEPS:
        if step in a and step in b:
            same = a[step]["loss"] == b[step]["loss"]
            differ += [] if same else [step]
            norms = [fmt_value(r[step].get("grad_norm"), ".7f") for r in (a, b)]
            lines.append(
                f"| {step} | {a[step]['loss']!r} | {b[step]['loss']!r} | {'yes' if same else 'no'} | "
                f"{norms[0]} | {norms[1]} |"
            )
    verdict = (
        f"not bit-identical (first logged difference at step {differ[0]}): the regime's TIED runs are "
        "not reused; TIED is rerun on this code"
        if differ
        else "bit-identical at these steps"
    )
    return [*lines, "", f"The first {RERUN_STEPS[-1]} steps are {verdict}."]


def question1(raw: CombinedRaw) -> tuple[str, list[str], str]:
    """The README's first question: (outcome, reasons, the regime criteria's verdict on LEV-SC)."""
    view = raw.view({LEV_SC: "LEV", TIED: "TIED", ALBERT_R: "ALBERT-32"})
    regime_verdict, regime_reasons = rr.verdict(view)
    reasons = [f"the regime's criteria on LEV-SC against TIED and ALBERT-32-R: {regime_verdict}"]
    reasons += [f"  {r}" for r in regime_reasons]
    below, above = {}, {}
    for name, band in (("overall", None), ("input 1-9", ("input_band", rr.RARE_BAND))):
        c = change(raw, "mmidx", band)
        if c is None or c["document"] is None or c["seed"] is None:
            reasons.append(f"C, {name}: not available")
            below[name] = above[name] = False
            continue
        doc, seed = rr._interval(c["document"]), rr._interval(c["seed"])
        reasons.append(f"C, {name}: {c['mean']:+.3f} document {doc}, seed-paired {seed}")
        below[name] = c["document"][1] < 0 and c["seed"][1] < 0
        above[name] = c["document"][0] > 0 and c["seed"][0] > 0
    if above["overall"]:
        return "clipping the seed side on its own hurts", reasons, regime_verdict
    if regime_verdict != "refute" and below["input 1-9"]:
        return "the clipping carried the refute", reasons, regime_verdict
    if regime_verdict == "refute" and (below["input 1-9"] or below["overall"]):
        return "the clipping was part of it", reasons, regime_verdict
    if regime_verdict == "refute":
        return "not the clipping", reasons, regime_verdict
    return "none of the stated outcomes", reasons, regime_verdict


def question2(raw: CombinedRaw) -> tuple[str, list[str]]:
    c = rr.comparison(raw, LEV_R, UNTIED, "mmidx", ("input_band", rr.RARE_BAND))
    if c is None or c["document"] is None or c["seed"] is None or len(c["seeds"]) < 3:
        return "not available yet", ["LEV-R - UNTIED, input 1-9: fewer than three seed pairs"]
    reason = (
        f"LEV-R - UNTIED, input 1-9: {c['mean']:+.3f} document {rr._interval(c['document'])}, "
        f"seed-paired {rr._interval(c['seed'])} (seeds {', '.join(map(str, c['seeds']))})"
    )
    if c["document"][0] > 0 and c["seed"][0] > 0:
        return "the input layer's deficit holds with the head matched", [reason]
    if c["document"][0] <= 0 and c["seed"][0] <= 0:
        return "the deficit on rare inputs was not the input layer's", [reason]
    return "between the stated outcomes (one interval above zero)", [reason]


CRITERIA_ROW = re.compile(r"^LEV - (TIED|ALBERT-32), (input|target) 1-9: [+-]")
VERDICT_HEADER = (
    "| comparison | slice | seed pairs | difference | document 95% | seed-paired 95% |",
    "|---|---|---|---|---|---|",
)


def _verdict_row(name: str, slice_: str, c: dict | None) -> str:
    """One comparison with its two intervals in their own columns ("-": not available, or one seed
    pair, which has no seed-paired interval)."""
    if c is None or c["mean"] is None:
        return f"| {name} | {slice_} | - | - | - | - |"
    seeds = ", ".join(map(str, c["seeds"]))
    return (
        f"| {name} | {slice_} | {seeds} | {c['mean']:+.3f} | {rr._interval(c['document'])} | "
        f"{rr._interval(c['seed'])} |"
    )


def _scale(raw: CombinedRaw) -> str:
    run = raw.seeds(TIED).get(1234) or next(iter(raw.seeds(TIED).values()), None)
    tokens, params = raw._raw(run).scale(run) if run is not None else (None, None)
    return scale_phrase(tokens, params, "the seed pairs in each row")


def verdict_markdown(raw: CombinedRaw) -> str:
    lines = ["# Clip: the criteria of the README applied", ""]
    if preliminary := raw.preliminary():
        lines += [f"{preliminary} The outcomes may change when the rest are collected.", ""]
    outcome, reasons, regime_verdict = question1(raw)
    view = raw.view({LEV_SC: "LEV", TIED: "TIED", ALBERT_R: "ALBERT-32"})
    lines += [
        "Validation shard, nats per predicted token. Each row prints the document bootstrap 95% over its "
        "seed pairs and the seed-paired Student-t 95% in separate columns; a row of one seed pair has no "
        "seed-paired interval (-). The regime's criteria read the document interval only; `C` and the "
        f"head-matched question read both. {COUNT_SCOPE}",
        "",
        "## 1. Clipping the seed side on its own",
        "",
        f"**{outcome}**",
        "",
        f"The regime's criteria on LEV-SC against TIED and ALBERT-32-R: **{regime_verdict}**, at this "
        f"scale only ({_scale(raw)}).",
        "",
        *VERDICT_HEADER,
    ]
    for side, key in rr.SIDES:
        for other, shown in (("TIED", TIED), ("ALBERT-32", ALBERT_R)):
            c = rr.comparison(view, "LEV", other, "mmidx", (key, rr.RARE_BAND))
            lines.append(_verdict_row(f"{LEV_SC} - {shown}", f"{side} 1-9", c))
    for name, band in (("overall", None), ("input 1-9", ("input_band", rr.RARE_BAND))):
        lines.append(_verdict_row(CONTRAST, name, change(raw, "mmidx", band)))
    # what the regime's criteria said beyond the rows above (a missing comparison, the seed noise)
    extra = [r.strip() for r in reasons[1:] if not r.startswith("C, ") and not CRITERIA_ROW.match(r.strip())]
    if extra:
        lines += ["", *[f"- {r}" for r in extra]]
    c = change(raw, "mmidx")
    setting = "LEV-SC" if c is not None and c["mean"] is not None and c["mean"] < 0 else "LEV (the regime's)"
    outcome2, _ = question2(raw)
    lines += [
        "",
        "## 2. The head matched",
        "",
        f"**{outcome2}**",
        "",
        *VERDICT_HEADER,
        _verdict_row(
            f"{LEV_R} - {UNTIED}",
            "input 1-9",
            rr.comparison(raw, LEV_R, UNTIED, "mmidx", ("input_band", rr.RARE_BAND)),
        ),
        "",
        "## The LEV setting the later experiments use",
        "",
        f"**{setting}** (LEV-SC if C overall is below zero, point estimate).",
        "",
        "Validation shard; at this scale only (`README.md`, *What this scale cannot show*).",
    ]
    return "\n".join(lines) + "\n"


def write_plots(raw: CombinedRaw, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for run in raw.runs:
        if run["seed"] != 1234 or run["group"] not in (TIED, LEV_SC, TIED_R, LEV_R):
            continue
        rows = factors(raw, run)
        ax.plot(
            [s for s, _, _ in rows], [g for _, g, _ in rows], label=f"{run['group']} global", linewidth=1.1
        )
        seed = [(s, f) for s, _, f in rows if f is not None]
        if seed:
            ax.plot([s for s, _ in seed], [f for _, f in seed], "--", label=f"{run['group']} seed side")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("clip factor")
    ax.set_title("clip factors, seed 1234")
    ax.legend(fontsize=8)
    save_plot(fig, out, "factors.png")


def with_regime(raw_dir: Path, regime_raw: Path | None, report: str, needed: str) -> CombinedRaw:
    """`raw_dir`'s runs beside the regime's (`regime_raw`, default `../regime/raw` beside `raw_dir`'s
    results folder); a missing regime or no run of group `needed` is one line naming it."""
    raw_dir = Path(raw_dir)
    regime_raw = Path(regime_raw) if regime_raw is not None else raw_dir.parent.parent / "regime" / "raw"
    if not (regime_raw / "study.json").is_file():
        raise DataError(
            f"{regime_raw}: the regime's raw files are missing; the {report} report compares with them"
        )
    raw = CombinedRaw(PlanRaw(raw_dir), PlanRaw(regime_raw))
    if not raw.seeds(needed):
        raise DataError(f"{raw_dir}: no {needed} run collected; the {report} report compares against it")
    return raw


def write_clip_report(
    raw_dir: Path, out_dir: Path, plots: bool = True, regime_raw: Path | None = None
) -> dict[str, Path]:
    """The pages from `raw_dir` (plan `clip`) and the regime's raw files (default: `../regime/raw`
    beside `raw_dir`'s results folder)."""
    raw = with_regime(raw_dir, regime_raw, "clip", TIED)
    out = Path(out_dir)
    paths = write_pages(
        out,
        {
            "overall.md": overall_markdown(raw),
            "bands.md": bands_markdown(raw),
            "clipping.md": clipping_markdown(raw),
            "rows.md": rows_markdown(raw),
            "verdict.md": verdict_markdown(raw),
        },
    )
    if plots:
        write_plots(raw, out)
    return paths


__all__ = ["CombinedRaw", "change", "with_regime", "write_clip_report"]
