"""The controls experiment's page, from its raw files and those of the clip, eps and regime experiments.

    write_controls_report("results/controls/raw", "docs/results/controls")

The questions and outcomes are those `docs/results/controls/README.md` fixed before the runs: on the
zero-shot corpus, targets of the paper's bucket below 1e-7, `A = LEV-C0 - UNTIED-C0` (seed 1234, no
clipping on either side) and `B = LEV-EPS - UNTIED-EPS` (Adam's eps 1e-10 on both sides; the
seed-paired interval where two seeds exist). The partners come from the other experiments' raw files
(`../clip/raw`, `../eps/raw`, `../regime/raw` beside this one's results folder), under the names
below. Deterministic output (the plan_raw bootstrap's fixed seed, fixed order and formats).
"""

from __future__ import annotations

from pathlib import Path

from megatron_lev.errors import DataError
from studies import regime_report as rr
from studies.plan_raw import BOOTSTRAP, BOOTSTRAP_SEED, LEVEL, PlanRaw, write_pages

PAGES = ("controls.md",)
RARE = ("bucket", 0)  # the paper's < 1e-7: targets never seen in training on this split
Q1_HALF = -0.441  # README: half of the clipped runs' lead on seed 1234 (LEV-R - UNTIED = -0.882)
# (experiment, its groups shown here under these names); the first source of a (group, seed) wins
SOURCES: tuple[tuple[str, dict[str, str] | None], ...] = (
    ("controls", None),
    ("clip", {"LEV-C0": "LEV-C0", "TIED-C0": "TIED-C0", "TIED": "TIED", "UNTIED": "UNTIED"}),
    ("eps", {"LEV": "LEV", "LEV-EPS": "LEV-EPS"}),
    ("regime", {"LEV": "LEV-R", "UNTIED": "UNTIED"}),
)
# (a, b, what it says): the deciding differences first, then what each control costs its side
COMPARISONS = (
    ("LEV-C0", "UNTIED-C0", "Q1: A, no clipping on either side"),
    ("LEV-EPS", "UNTIED-EPS", "Q2: B, Adam's eps 1e-10 on both sides"),
    ("LEV-R", "UNTIED", "the clipped runs' lead (the regime's LEV)"),
    ("LEV-EPS", "TIED-EPS", "eps 1e-10 on both sides, against TIED"),
    ("UNTIED-C0", "UNTIED", "what no clipping does to the matched head"),
    ("UNTIED-EPS", "UNTIED", "what eps 1e-10 does to the matched head"),
    ("TIED-EPS", "TIED", "what eps 1e-10 does to TIED"),
    ("LEV-C0", "LEV-R", "what no clipping does to LEV"),
    ("LEV-EPS", "LEV", "what eps 1e-10 does to LEV"),
)


class JoinedRaw:
    """Runs of several experiments' raw folders under one set of group names (`SOURCES`): the
    interface `regime_report.comparison` reads (`runs`, `result`)."""

    def __init__(self, parts: list[tuple[str, PlanRaw, dict[str, str] | None]]):
        self._raws, self.runs, seen = {}, [], set()
        for label, raw, names in parts:
            self._raws[label] = raw
            for r in raw.runs:
                if names is not None and r["group"] not in names:
                    continue
                group = r["group"] if names is None else names[r["group"]]
                if (group, r["seed"]) in seen:
                    continue
                seen.add((group, r["seed"]))
                self.runs.append({**r, "group": group, "source": label})

    def result(self, run: dict, kind: str = "mmidx") -> dict:
        return self._raws[run["source"]].result(run, kind)

    def seeds(self, group: str) -> dict[int, dict]:
        return {r["seed"]: r for r in self.runs if r["group"] == group}


def joined(raw_dir: Path) -> JoinedRaw:
    """This experiment's runs beside the clip, eps and regime experiments' (`../<name>/raw`)."""
    raw_dir = Path(raw_dir)
    parts = []
    for label, names in SOURCES:
        folder = raw_dir if label == "controls" else raw_dir.parent.parent / label / "raw"
        if not (folder / "study.json").is_file():
            raise DataError(
                f"{folder}: the {label} experiment's raw files are missing; this report reads them"
            )
        parts.append((label, PlanRaw(folder), names))
    return JoinedRaw(parts)


def _rare(raw: JoinedRaw, a: str, b: str, seeds: tuple[int, ...] | None = None) -> dict | None:
    """`a - b` on the zero-shot corpus below 1e-7, over `seeds` (default: every seed both have)."""
    if seeds is not None:
        view = JoinedRaw.__new__(JoinedRaw)
        view._raws, view.runs = raw._raws, [r for r in raw.runs if r["seed"] in seeds]
        raw = view
    return rr.comparison(raw, a, b, "text", RARE)


def question1(raw: JoinedRaw) -> tuple[str, str]:
    """The README's Q1 outcome and the numbers it was read from."""
    a = _rare(raw, "LEV-C0", "UNTIED-C0", (1234,))
    if a is None or a["mean"] is None or a["document"] is None:
        return "open (UNTIED-C0 has not run)", "A needs UNTIED-C0 seed 1234"
    hi = a["document"][1]
    said = f"A = {a['mean']:+.3f}, document {rr._interval(a['document'])} (seed 1234)"
    if hi < 0 and a["mean"] <= Q1_HALF:
        return "the input layer's, clip or not", said
    if hi < 0:
        return "the clip carries part of it", said
    return "not without the clip", said


def question2(raw: JoinedRaw) -> tuple[str, str]:
    """The README's Q2 outcome: the seed-paired interval with two seeds, else the document one."""
    b = _rare(raw, "LEV-EPS", "UNTIED-EPS")
    if b is None or b["mean"] is None:
        return "open (UNTIED-EPS has not run)", "B needs UNTIED-EPS"
    seeds = ", ".join(str(s) for s in b["seeds"])
    if b["seed"] is not None:
        interval, which = b["seed"], f"seed-paired over seeds {seeds}"
    else:
        interval, which = b["document"], f"document, seed {seeds} only: one seed"
    said = f"B = {b['mean']:+.3f}, {which} {rr._interval(interval)}"
    if interval is None:
        return "open (no interval)", said
    if interval[1] < 0:
        return "the lead survives eps 1e-10", said
    return "eps carries it against the matched head too", said


def _table(raw: JoinedRaw, kind: str, band_key: str, labels: list[str]) -> list[str]:
    lines = [
        "| band | comparison | difference | document 95% | seed-paired 95% | per seed (seeds) |",
        "|---|---|---|---|---|---|",
    ]
    for k, label in enumerate(labels):
        for a, b, _ in COMPARISONS:
            c = rr.comparison(raw, a, b, kind, (band_key, k))
            if c is None:
                continue
            cells = rr._diff_cells(c)
            seeds = ", ".join(str(s) for s in c["seeds"])
            lines.append(
                f"| {label} | {a} - {b} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} ({seeds}) |"
            )
    return lines


def controls_markdown(raw: JoinedRaw) -> str:
    q1, q1_numbers = question1(raw)
    q2, q2_numbers = question2(raw)
    ran = sorted(f"{r['name']}" for r in raw.runs if r["source"] == "controls")
    lines = [
        "# Controls: is LEV's zero-shot lead on rare targets the input layer's?",
        "",
        "Written by `python -m studies report results/controls/raw docs/results/controls` from the raw files "
        "of this experiment and of `../clip/`, `../eps/` and `../regime/` (`studies/controls_report.py`). "
        "Nats per predicted token; `a - b` below zero: `a` is better. Document 95%: "
        f"{BOOTSTRAP} resamples of the evaluated documents (seed {BOOTSTRAP_SEED}), one resample for every "
        f"seed; seed-paired {LEVEL:.0%}: Student t over the per-seed differences (two seeds or more). "
        "Partners: LEV-C0, TIED-C0, TIED and UNTIED seeds 1235-1236 from the clip experiment, LEV and "
        "LEV-EPS seed 1234 from the eps experiment, LEV-R and UNTIED seed 1234 from the regime.",
        "",
        f"This experiment's runs collected: {', '.join(ran) or 'none'}.",
        "",
        "## Outcomes (the README's rules)",
        "",
        f"- **Q1, the clip**: {q1}. {q1_numbers}; the rule's line is A <= {Q1_HALF} with the interval "
        "below zero.",
        f"- **Q2, Adam's eps**: {q2}. {q2_numbers}.",
    ]
    for kind, corpus in rr.CORPORA:
        first = next(iter(raw.runs), None)
        if first is None:
            break
        buckets = [str(b["bucket"]) for b in raw.result(first, kind).get("buckets") or []]
        if not buckets:
            continue
        lines += ["", f"## {corpus}, by target frequency (the paper's buckets)", ""]
        lines += _table(raw, kind, "bucket", buckets)
    lines += ["", "Comparisons:", ""]
    lines += [f"- `{a} - {b}`: {what}" for a, b, what in COMPARISONS]
    return "\n".join(lines) + "\n"


def write_controls_report(raw_dir: Path, out_dir: Path, plots: bool = True) -> dict[str, Path]:
    """The page from `raw_dir` (plan `controls`) and the other experiments' raw files beside it."""
    raw = joined(raw_dir)
    return write_pages(Path(out_dir), {"controls.md": controls_markdown(raw)})


__all__ = ["JoinedRaw", "question1", "question2", "write_controls_report"]
