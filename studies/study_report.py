"""Every table of the study's write-up, regenerated from its raw files alone (`study collect`).

    write_report("results/study/raw", "docs/results/study")

RAW_DIR holds `study.json` (the collected runs: name, group, variant, seed, overrides), `split.json`,
`lambada.json` and per run `eval.json`, `metrics.jsonl`, `geometry.json`, `config.yaml` and
`timing.json`. The markdown is deterministic (fixed bootstrap seed, plan order, fixed formats): the
same raw files give byte-identical tables. A comparison whose runs are missing says so instead.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from megatron_lev.analysis.compare import compare_results
from megatron_lev.analysis.compare_report import (
    compare_markdown,
    interval_cell,
    mean_sd_cell,
    plot_comparison,
)
from megatron_lev.errors import DataError
from megatron_lev.utils.io import atomic_write_text
from studies.plan_raw import read_raw_json as _read_json
from studies.plans import CORPORA, EQUAL_SCALE_RMS, GROUPS, VARIANT_GROUPS

BOOTSTRAP = 1000
BOOTSTRAP_SEED = 0
GEOMETRY_METRICS = ("eps", "mu", "sigma", "mean_row_ratio", "effective_rank")


class Raw:
    """The collected runs of a study, grouped; results read on demand."""

    def __init__(self, raw: Path):
        self.root = Path(raw)
        if not (self.root / "study.json").is_file():
            raise DataError(f"{raw}: no study.json; give the directory `python -m studies collect` wrote")
        self.runs = _read_json(self.root / "study.json")["runs"]
        order = {g: i for i, (g, *_rest) in enumerate(GROUPS)}
        self.runs.sort(key=lambda r: (order.get(r["group"], len(order)), r["seed"]))
        self.groups: dict[str, list[dict]] = {}
        for r in self.runs:
            self.groups.setdefault(r["group"], []).append(r)
        self._eval: dict[str, list[dict]] = {}

    def results(self, run: dict) -> list[dict]:
        if run["name"] not in self._eval:
            data = _read_json(self.root / run["name"] / "eval.json")
            self._eval[run["name"]] = data.get("results", []) if isinstance(data, dict) else []
        return self._eval[run["name"]]

    def result(self, run: dict, kind: str) -> dict | None:
        return next((r for r in self.results(run) if r.get("corpus_kind") == kind), None)

    def seeds(self, group: str) -> list[int]:
        return [r["seed"] for r in self.groups.get(group, [])]

    def paired(self, groups: list[str], kind: str, seeds: list[int] | None = None):
        """`{group: [result per seed]}` over the seeds every group has (or `seeds`), or a reason."""
        missing = [g for g in groups if g not in self.groups]
        if missing:
            return f"not run or not collected: {', '.join(missing)}"
        common = sorted(set.intersection(*(set(self.seeds(g)) for g in groups)))
        if seeds is not None:
            common = [s for s in common if s in seeds]
        if not common:
            return f"no seed that {', '.join(groups)} all have"
        out = {}
        for g in groups:
            by_seed = {r["seed"]: r for r in self.groups[g]}
            results = [self.result(by_seed[s], kind) for s in common]
            if any(r is None for r in results):
                return f"a {g} run has no {kind} result in its eval.json"
            out[g] = results
        return out, common


def _compare(raw: Raw, groups: list[str], kind: str, baseline: str, seeds=None):
    got = raw.paired(groups, kind, seeds)
    if isinstance(got, str):
        return got
    results, common = got
    cmp = compare_results(
        results,
        baseline=baseline,
        sources={g: [f"{g} seed {s}" for s in common] for g in groups},
        bootstrap=BOOTSTRAP,
        bootstrap_seed=BOOTSTRAP_SEED,
    )
    cmp["seed_values"] = common
    return cmp


def _demote(md: str) -> str:
    return "\n".join("#" + line if line.startswith("#") else line for line in md.splitlines()) + "\n"


def _row(cmp: dict, name: str) -> dict:
    return next(r for r in cmp["rows"] if r["name"] == name)


def _change_cells(stats: dict, seeds: int) -> list[str]:
    why = f"{seeds} seed" if seeds < 2 else "no value"
    boot = "not run" if stats.get("bootstrap_interval") is None else ""
    per_seed = ", ".join("-" if v is None else f"{v:+.2f}" for v in stats["per_seed"])
    return [
        mean_sd_cell(stats),
        interval_cell(stats["seed_interval"], why),
        interval_cell(stats["bootstrap_interval"], boot or "no value"),
        per_seed,
    ]


def _plots(cmp: dict, out: Path, name: str, plots: bool) -> None:
    if plots:
        d = out / "plots" / name
        d.mkdir(parents=True, exist_ok=True)
        plot_comparison(cmp, {}, d)


def _comparison_sections(raw: Raw, groups, baseline, out, prefix, plots, seeds=None) -> list[str]:
    lines = []
    for kind, label, what in CORPORA:
        lines += ["", f"## {label} ({what})", ""]
        cmp = _compare(raw, list(groups), kind, baseline, seeds)
        if isinstance(cmp, str):
            lines.append(f"Not available: {cmp}.")
            continue
        lines.append(f"Seeds (train.seed): {', '.join(map(str, cmp['seed_values']))}.")
        lines += ["", _demote(compare_markdown(cmp)).rstrip("\n")]
        _plots(cmp, out, f"{prefix}_{label.split('-')[0].lower()}", plots)
    return lines


def _summary_table(raw: Raw, pairs: list[tuple[str, str, str]]) -> list[str]:
    """One row per (label, variant group vs baseline group) and corpus: the change over paired seeds."""
    lines = [
        "| comparison | corpus | seeds | change (mean ± sd) | seed-paired 95% | document bootstrap 95% "
        "| per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, var, base in pairs:
        for kind, corpus, _ in CORPORA:
            cmp = _compare(raw, [base, var], kind, base)
            if isinstance(cmp, str):
                lines.append(f"| {label} | {corpus} | - | not available: {cmp} | | | |")
                continue
            n = len(cmp["seed_values"])
            cells = _change_cells(_row(cmp, var)["rel_change"], n)
            lines.append(f"| {label} | {corpus} | {n} | " + " | ".join(cells) + " |")
    return lines


def _mean_sd(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.fmean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def groups_markdown(raw: Raw) -> str:
    lines = [
        "# Study: every group's perplexities and LAMBADA-style accuracy",
        "",
        "Mean ± sd over the group's seeds (one value: one seed).",
        "",
        "| group | runs | seeds | validation ppl | zero-shot ppl | LAMBADA-style ppl | LAMBADA-style acc |",
        "|---|---|---|---|---|---|---|",
    ]
    for group, runs in raw.groups.items():
        cells = []
        for kind in ("mmidx", "text", "lambada"):
            vals = [r["perplexity"] for r in (raw.result(x, kind) for x in runs) if r]
            cells.append(_mean_sd(vals, ".3f"))
        accs = [r["acc"] for r in (raw.result(x, "lambada") for x in runs) if r and r.get("acc") is not None]
        cells.append(_mean_sd([100 * a for a in accs], ".2f") + ("%" if accs else ""))
        seeds = ", ".join(str(r["seed"]) for r in runs)
        lines.append(f"| {group} | {len(runs)} | {seeds} | " + " | ".join(cells) + " |")
    lines.append("")
    lambada = raw.root / "lambada.json"
    if lambada.is_file():
        lam = _read_json(lambada)
        lines.append(
            f"LAMBADA-style passages: {lam['passages']} of {lam['min_words']}-{lam['max_words']} words "
            f"(mean {lam['mean_words']}), cut from the held-out subset; the target is the last word. "
            "Unlike LAMBADA they are not filtered for needing the broader context."
        )
    split = raw.root / "split.json"
    if split.is_file():
        s = _read_json(split)
        lines.append(
            f"Data: zero-shot subset {s['zero_shot_subset']}; every {s['valid_every']}th document of the "
            f"others held out for validation; at most {s['max_chars_per_subset']:,} characters per subset."
        )
    return "\n".join(lines) + "\n"


def variants_markdown(raw: Raw, out: Path, plots: bool) -> str:
    lines = [
        "# Study: the six variants against TIED (first seed)",
        "",
        "Every variant with train.seed 1234 (UNTIED, ALBERT, FLAT-MLP and FACT-MLP ran one seed), so the "
        "intervals are the document bootstrap's only; TIED and LEV over three seeds are in seeds.md.",
    ]
    lines += _comparison_sections(raw, VARIANT_GROUPS, "TIED", out, "variants", plots, seeds=[1234])
    return "\n".join(lines) + "\n"


def seeds_markdown(raw: Raw, out: Path, plots: bool) -> str:
    lines = ["# Study: LEV against TIED over three seeds"]
    lines += _comparison_sections(raw, ("TIED", "LEV"), "TIED", out, "seeds", plots)
    return "\n".join(lines) + "\n"


def equal_scale_markdown(raw: Raw, out: Path, plots: bool) -> str:
    lines = [
        "# Study: default against equal-scale initialisation",
        "",
        f"TIED-EQ and LEV-EQ set `model.input_init_rms={EQUAL_SCALE_RMS}`: the input embedding's output "
        "RMS at initialisation is rescaled to TIED's own table scale (normal init, std 0.02), so both "
        "start at the same scale. Does LEV's change against TIED survive equal scales?",
        "",
    ]
    lines += _summary_table(
        raw,
        [
            ("LEV vs TIED (default init)", "LEV", "TIED"),
            ("LEV-EQ vs TIED-EQ (equal scale)", "LEV-EQ", "TIED-EQ"),
            ("TIED-EQ vs TIED (control)", "TIED-EQ", "TIED"),
            ("LEV-EQ vs LEV", "LEV-EQ", "LEV"),
        ],
    )
    lines += ["", "Change: perplexity / baseline perplexity - 1 in %, seed i against seed i."]
    lines += _comparison_sections(raw, ("TIED-EQ", "LEV-EQ"), "TIED-EQ", out, "equal_scale", plots)
    return "\n".join(lines) + "\n"


def centred_markdown(raw: Raw, out: Path, plots: bool) -> str:
    lines = [
        "# Study: centred LEV against LEV",
        "",
        "LEV-C sets `model.lev.centred=true` (G = sum_l (M_l - 1) W_out_l, without the all-ones mode's "
        "shared vector).",
        "",
    ]
    lines += _summary_table(
        raw,
        [
            ("LEV-C vs LEV", "LEV-C", "LEV"),
            ("LEV-C vs TIED", "LEV-C", "TIED"),
            ("LEV vs TIED", "LEV", "TIED"),
        ],
    )
    lines += _comparison_sections(raw, ("LEV", "LEV-C"), "LEV", out, "centred", plots)
    return "\n".join(lines) + "\n"


def decomposition_markdown(raw: Raw) -> str:
    lines = [
        "# Study: the gain decomposition (first seed)",
        "",
        "| term | variant vs reference | " + " | ".join(f"{c} gain" for _, c, _ in CORPORA) + " | paper |",
        "|---|---|---|---|---|---|",
    ]
    per_corpus = {}
    for kind, label, _ in CORPORA:
        cmp = _compare(raw, list(VARIANT_GROUPS), kind, "TIED", seeds=[1234])
        per_corpus[label] = cmp if not isinstance(cmp, str) and cmp.get("decomposition") else None
    first = next((c for c in per_corpus.values() if c), None)
    if first is None:
        return (
            "\n".join(lines[:2]) + "\nNot available: the six variants' first seeds are not all collected.\n"
        )
    dec0 = first["decomposition"]
    terms = [*dec0["terms"], {**dec0["total"], "term": "total", "paper_label": None}]
    for i, t in enumerate(terms):
        cells = []
        for _, label, _ in CORPORA:
            cmp = per_corpus[label]
            if cmp is None:
                cells.append("-")
                continue
            dec = cmp["decomposition"]
            g = (dec["terms"][i] if i < len(dec["terms"]) else dec["total"])["gain"]
            ci = g["bootstrap_interval"]
            cells.append(mean_sd_cell(g) + (f" {interval_cell(ci, '')}" if ci else ""))
        paper = f"{t['paper_label']} +{t['paper_gain_pct']:.2f}%" if t.get("paper_label") else "-"
        lines.append(
            f"| {t['term']} | {t['variant']} vs {t['reference']} | " + " | ".join(cells) + f" | {paper} |"
        )
    lines += [
        "",
        "Gain: % lower perplexity of the variant that adds the ingredient than the one before it, one "
        "seed; brackets: 95% bootstrap interval over the evaluated documents (passages for the "
        "LAMBADA-style task; none where a result has no per-document losses). " + dec0["definition"] + ".",
    ]
    return "\n".join(lines) + "\n"


def _geometry_rows(raw: Raw, run: dict) -> list[dict]:
    data = _read_json(raw.root / run["name"] / "geometry.json")
    return data.get("rows", []) if isinstance(data, dict) else []


def geometry_markdown(raw: Raw, out: Path, plots: bool) -> str:
    lines = [
        "# Study: embedding geometry at the first and the final saved checkpoint",
        "",
        "Mean ± sd over the group's seeds. mu: mean pairwise cosine; eps = mu + 2 sigma; mean row: "
        "norm of the mean row / mean row norm; eff. rank: exp of the entropy of the normalised singular "
        "values (bound: the most the construction allows). 'first' is the first saved checkpoint: the "
        "initial weights (iteration 0) when the runs set train.save_initial, as the study does.",
        "",
        "| group | matrix | checkpoint | iteration | eps | mu | sigma | mean row | eff. rank | rank bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    plot_rows = []
    for group, runs in raw.groups.items():
        per_run = [_geometry_rows(raw, r) for r in runs]
        for matrix in ("input", "output"):
            for which in ("first", "final"):
                picked = []
                for rows in per_run:
                    mine = sorted((r for r in rows if r["matrix"] == matrix), key=lambda r: r["iteration"])
                    if mine:
                        picked.append(mine[0] if which == "first" else mine[-1])
                if not picked:
                    continue
                iters = sorted({p["iteration"] for p in picked})
                cells = [
                    _mean_sd([p[m] for p in picked], ".1f" if m == "effective_rank" else ".4f")
                    for m in GEOMETRY_METRICS
                ]
                bound = sorted({p["rank_bound"] for p in picked})
                lines.append(
                    f"| {group} | {matrix} | {which} | {', '.join(map(str, iters))} | "
                    + " | ".join(cells)
                    + f" | {', '.join(map(str, bound))} |"
                )
        if per_run and per_run[0]:
            plot_rows += per_run[0]
    if plots and plot_rows:
        from megatron_lev.analysis.geometry import GeometryRow, plot_geometry

        fields = set(GeometryRow.__dataclass_fields__)
        plot_geometry(
            [GeometryRow(**{k: v for k, v in r.items() if k in fields}) for r in plot_rows],
            out / "plots" / "geometry.png",
        )
    return "\n".join(lines) + "\n"


def cost_markdown(raw: Raw) -> str:
    from megatron_lev.experiments.summary import run_stats

    lines = [
        "# Study: cost",
        "",
        "Seconds of each step as the study ran it (one thread per process, two runs side by side), "
        "from the step markers; CPU-hours = seconds x threads / 3600. A run stopped and resumed has "
        "more than one training segment, and its marker counts only the last one; `step s` is every "
        "run's training time estimated the same way (its tokens / its median tokens/s), and a resumed run's "
        "CPU-hours count the larger of the two.",
        "",
        "| run | group | segments | train s | step s | convert s | evaluate s | geometry s | CPU-hours "
        "| tokens/s (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    total, by_group = 0.0, {}
    for run in raw.runs:
        timing = _read_json(raw.root / run["name"] / "timing.json")
        threads = timing.get("threads", 1)
        secs = {
            k: timing["steps"].get(k, {}).get("seconds") for k in ("train", "convert", "evaluate", "geometry")
        }
        try:
            stats = run_stats(raw.root / run["name"])
        except (DataError, OSError, KeyError):
            stats = {}
        tps, tokens, segments = stats.get("tokens_per_s"), stats.get("tokens"), stats.get("segments")
        step_s = tokens / tps if tps and tokens else None
        counted = dict(secs)
        if segments and segments > 1 and step_s is not None:  # the marker saw the last segment only
            counted["train"] = max(secs["train"] or 0.0, step_s)
        hours = sum(s or 0.0 for s in counted.values()) * threads / 3600
        total += hours
        by_group[run["group"]] = by_group.get(run["group"], 0.0) + hours
        fmt = [secs["train"], step_s, secs["convert"], secs["evaluate"], secs["geometry"]]
        lines.append(
            f"| {run['name']} | {run['group']} | {segments or '-'} | "
            + " | ".join("-" if s is None else f"{s:,.0f}" for s in fmt)
            + f" | {hours:.2f} | {'-' if tps is None else f'{tps:,.0f}'} |"
        )
    lines += ["", "| group | CPU-hours |", "|---|---|"]
    lines += [f"| {g} | {h:.2f} |" for g, h in by_group.items()]
    lines += [f"| all {len(raw.runs)} runs | {total:.2f} |", ""]
    return "\n".join(lines) + "\n"


def write_report(raw_dir: Path, out_dir: Path, plots: bool = True) -> dict[str, Path]:
    """Write every table (markdown) and, with `plots`, the PNGs under `out_dir/plots/`."""
    raw = Raw(Path(raw_dir))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pages = {
        "groups.md": groups_markdown(raw),
        "variants.md": variants_markdown(raw, out, plots),
        "seeds.md": seeds_markdown(raw, out, plots),
        "equal_scale.md": equal_scale_markdown(raw, out, plots),
        "centred.md": centred_markdown(raw, out, plots),
        "decomposition.md": decomposition_markdown(raw),
        "geometry.md": geometry_markdown(raw, out, plots),
        "cost.md": cost_markdown(raw),
    }
    paths = {}
    for name, text in pages.items():
        paths[name] = out / name
        atomic_write_text(paths[name], text)
    return paths


REPORT_PAGES = (
    "groups.md",
    "variants.md",
    "seeds.md",
    "equal_scale.md",
    "centred.md",
    "decomposition.md",
    "geometry.md",
    "cost.md",
)
