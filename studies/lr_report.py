"""The lower learning rate's page (`docs/results/lr/lr.md`) from its raw files, the clip experiment's
and the regime's.

    python -m studies report results/lr/raw docs/results/lr

The outcomes are those `docs/results/lr/README.md` fixed before the runs: `d_X = X(5e-4) - X(1e-3)` on
overall validation NLL, one seed, document interval, read only where the interval excludes zero and
`|d_X| > 0.01`. The 1e-3 runs: TIED seed 1234 of the clip experiment (this code) and LEV seed 1234 of
the regime (`LEV-R`); ALBERT-32 seed 1234 of the regime for the regime's input 1-9 criterion.
Deterministic output (fixed bootstrap seed, formats).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from megatron_lev.errors import DataError
from studies import clip_report as cr
from studies import regime_report as rr
from studies.plan_raw import COUNT_SCOPE, PlanRaw, doc_arrays, fmt_value, save_plot, scale_phrase, write_pages

PAGES = ("lr.md",)
READ = 0.01  # README: a difference is read only beyond this (the regime's seed noise, about 0.005)
SEED = 1234
# (name here, source, group there): the lower-rate runs and the 1e-3 runs they are compared with
RUNS = (
    ("TIED-LR05", "lr", "TIED-LR05"),
    ("LEV-LR05", "lr", "LEV-LR05"),
    ("TIED", "clip", "TIED"),
    ("LEV", "regime", "LEV"),
    ("ALBERT-32", "regime", "ALBERT-32"),
)
PAIRS = (("TIED", "TIED-LR05"), ("LEV", "LEV-LR05"))  # (the 1e-3 group, the 5e-4 group)
SIDES = (("input", "input_band"), ("target", "target_band"))


class Sources:
    """Seed-1234 runs of several plans' raw directories under one set of group names: the interface
    `regime_report.comparison` reads (`runs`, `result`)."""

    def __init__(self, raws: dict[str, PlanRaw]):
        self.raws = raws
        self.runs = []
        for name, source, group in RUNS:
            run = raws[source].run(group, SEED)
            if run is not None:
                self.runs.append({**run, "group": name, "source": source})

    def result(self, run: dict, kind: str = "mmidx") -> dict:
        return self.raws[run["source"]].result(run, kind)

    def preliminary(self) -> str | None:
        return self.raws["lr"].preliminary()

    def valid_rows(self, run: dict) -> list[dict]:
        return self.raws[run["source"]].valid_rows(run)

    def train_rows(self, run: dict) -> list[dict]:
        return self.raws[run["source"]].train_rows(run)

    def has(self, group: str) -> bool:
        return any(r["group"] == group for r in self.runs)


def read_difference(c: dict | None) -> str:
    """ "higher" / "lower" where the interval excludes zero and the difference is beyond `READ`,
    else "not read"; "not available" without the runs or the interval."""
    if c is None or c["mean"] is None or c["document"] is None:
        return "not available"
    lo, hi = c["document"]
    if lo > 0 and c["mean"] > READ:
        return "higher"
    if hi < 0 and c["mean"] < -READ:
        return "lower"
    return "not read"


def rate_outcomes(raw: Sources) -> dict[str, tuple[str, dict | None]]:
    """Per side: (the README's outcome, d_X)."""
    out = {}
    for base, low in PAIRS:
        d = rr.comparison(raw, low, base, "mmidx")
        read = read_difference(d)
        label = {
            "higher": "1e-3 stands",
            "lower": "prefers a lower rate",
            "not read": "not resolved",
            "not available": "not available yet",
        }[read]
        out[base] = (label, d)
    return out


def best(outcomes: dict) -> dict[str, str]:
    """Each side's group at its better rate of the two: the lower rate where the README's outcome is
    "prefers a lower rate", else 1e-3 (a difference not read does not move a side off 1e-3)."""
    return {base: (low if outcomes[base][0] == "prefers a lower rate" else base) for base, low in PAIRS}


def behind_on_rare(raw: Sources, lev: str, others: tuple[str, ...]) -> list[str]:
    """The regime's refute condition: the comparisons of `lev` on inputs and targets seen 1-9 times
    whose document interval lies above zero."""
    behind = []
    for other in others:
        for side, key in SIDES:
            c = rr.comparison(raw, lev, other, "mmidx", (key, rr.RARE_BAND))
            if c is not None and c["document"] is not None and c["document"][0] > 0:
                behind.append(f"{lev} - {other}, {side} 1-9")
    return behind


def verdict_change(raw: Sources, outcomes: dict) -> tuple[str, list[str]]:
    """Whether the regime's verdict at this scale changes, with each side at its better rate."""
    at = best(outcomes)
    lev, tied = at["LEV"], at["TIED"]
    if not (raw.has(lev) and raw.has(tied)):
        return "not available yet", [f"{lev} or {tied} is missing"]
    regime = rr.comparison(raw, "LEV", "TIED", "mmidx")
    now = rr.comparison(raw, lev, tied, "mmidx")
    if regime is None or now is None or now["document"] is None or regime["mean"] is None:
        return "not available yet", [f"LEV - TIED or {lev} - {tied} has no interval"]
    reasons = [
        f"at the better rates: {lev} - {tied} overall {now['mean']:+.3f} {rr._interval(now['document'])}; "
        f"at 1e-3: LEV - TIED {regime['mean']:+.3f} {rr._interval(regime['document'])}"
    ]
    changed = (now["mean"] > 0) != (regime["mean"] > 0) or now["document"][0] <= 0 <= now["document"][1]
    before = behind_on_rare(raw, "LEV", ("TIED", "ALBERT-32"))
    after = behind_on_rare(raw, lev, (tied, "ALBERT-32"))
    reasons.append(
        "the regime's input 1-9 criterion (refute when LEV is behind TIED or ALBERT-32 on inputs or "
        f"targets seen 1-9 times): at 1e-3 {'refute' if before else 'not refute'}, at the better rates "
        f"{'refute' if after else 'not refute'} (seed {SEED} only, at the scale above)"
    )
    changed = changed or bool(before) != bool(after)
    return ("the verdict at this scale changes" if changed else "the regime's verdict stands"), reasons


def scale(raw: Sources) -> str:
    """The scale the verdict rests on, from a TIED run's `metrics.jsonl` (tokens, parameters)."""
    for group in ("TIED", "TIED-LR05"):
        run = next((r for r in raw.runs if r["group"] == group), None)
        if run is not None:
            return scale_phrase(*raw.raws[run["source"]].scale(run), f"seed {SEED} only")
    return scale_phrase(None, None, f"seed {SEED} only")


def lr_markdown(raw: Sources) -> str:
    lines = ["# The lower learning rate: results", ""]
    if preliminary := raw.preliminary():
        lines += [preliminary, ""]
    outcomes = rate_outcomes(raw)
    lines += [
        "Validation shard, nats per predicted token, seed 1234, document bootstrap 95%. "
        "`d_X = X(5e-4) - X(1e-3)`; read where the interval excludes zero and `|d_X| > 0.01` "
        "(`README.md`). The 1e-3 runs: TIED of the clip experiment, LEV (and ALBERT-32) of the regime.",
        "",
        "| side | d_X overall | document 95% | outcome |",
        "|---|---|---|---|",
    ]
    for base, (label, d) in outcomes.items():
        mean = "-" if d is None or d["mean"] is None else f"{d['mean']:+.3f}"
        lines.append(f"| {base} | {mean} | {rr._interval(d['document'] if d else None)} | {label} |")
    lines += [
        "",
        f"By band (the same differences on the regime's count bands, validation). {COUNT_SCOPE}",
        "",
    ]
    lines += ["| side | band | d_X | document 95% |", "|---|---|---|---|"]
    for base, low in PAIRS:
        for side, key in SIDES:
            c = rr.comparison(raw, low, base, "mmidx", (key, rr.RARE_BAND))
            if c is not None and c["mean"] is not None:
                lines.append(f"| {base} | {side} 1-9 | {c['mean']:+.3f} | {rr._interval(c['document'])} |")
    label, reasons = verdict_change(raw, outcomes)
    lines += ["", f"**{label}** (the README's rule), at this scale only: {scale(raw)}."]
    lines += ["", *(f"- {r}" for r in reasons)]
    lines += ["", *runs_lines(raw)]
    return "\n".join(lines) + "\n"


RATIO = "input_table/mean_row_ratio"
RATES = {"TIED-LR05": "5e-4", "LEV-LR05": "5e-4", "TIED": "1e-3", "LEV": "1e-3"}


def runs_lines(raw: Sources) -> list[str]:
    """Descriptive, not a criterion: each run's validation NLL, its input-1-9 NLL, and what clipping and
    AdamW did over training (median clip factor, median update ratio of the weight-decay group over
    steps 100-1000, the input table's mean-row ratio at the last logged step)."""
    lo, hi = cr.UPDATE_RANGE
    lines = [
        "## The four runs",
        "",
        "Descriptive, not a criterion. Validation NLL overall and on inputs seen 1-9 times (mean per "
        "predicted token); from `metrics.jsonl`: the median global clip factor over the logged steps "
        "(a regime run's from its logged norm, as `../clip/clipping.md`), the median update ratio of the "
        f"weight-decay group over steps {lo}-{hi}, and the input table's mean-row ratio at the last logged "
        "step.",
        "",
        "| run | peak rate | validation NLL | input 1-9 NLL | median clip factor | update ratio (decay) | "
        "mean-row ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in raw.runs:
        if run["group"] not in RATES:
            continue
        result = raw.result(run)
        tokens, sums = doc_arrays(result, ("input_band", rr.RARE_BAND))
        rare = float(sums.sum() / tokens.sum()) if tokens.sum() else None
        factors = [g for _, g, _ in cr.factors(raw, run)]
        rows = raw.train_rows(run)
        key = cr.UPDATE_KEYS[0]
        upd = [r[key] for r in rows if lo <= r["iteration"] <= hi and r.get(key) is not None]
        ratio = [r[RATIO] for r in rows if r.get(RATIO) is not None]
        cells = [
            run["group"],
            RATES[run["group"]],
            f"{float(result['mean_nll']):.4f}",
            fmt_value(rare, ".4f"),
            fmt_value(statistics.median(factors) if factors else None, ".3f"),
            fmt_value(statistics.median(upd) if upd else None, ".5f"),
            fmt_value(ratio[-1] if ratio else None, ".3f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_plot(raw: Sources, out: Path) -> None:
    """The trainer's validation loss over steps of the four runs (`train.eval_interval`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for run in raw.runs:
        if run["group"] == "ALBERT-32":
            continue
        rows = raw.valid_rows(run)
        style = "--" if run["group"].endswith("LR05") else "-"
        ax.plot([r["iteration"] for r in rows], [r["loss"] for r in rows], style, label=run["group"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (trainer's batches)")
    ax.set_ylim(top=7)
    ax.legend(fontsize=8)
    save_plot(fig, out, "lr.png")


def write_lr_report(raw_dir: Path, out_dir: Path, plots: bool = True) -> dict[str, Path]:
    """`lr.md` from `raw_dir` (plan `lr`) and the clip and regime raw directories beside it."""
    raw_dir = Path(raw_dir)
    results = raw_dir.parent.parent
    raws = {"lr": PlanRaw(raw_dir)}
    for name in ("clip", "regime"):
        if not (results / name / "raw" / "study.json").is_file():
            raise DataError(f"{results / name / 'raw'}: missing; the lower-rate report compares with it")
        raws[name] = PlanRaw(results / name / "raw")
    raw = Sources(raws)
    paths = write_pages(Path(out_dir), {"lr.md": lr_markdown(raw)})
    if plots:
        write_plot(raw, Path(out_dir))
    return paths


__all__ = ["rate_outcomes", "verdict_change", "write_lr_report"]
