"""The regime experiment's tables, plots and verdict, regenerated from its raw files alone.

    write_regime_report("results/regime/raw", "docs/results/regime")

The criteria are those `docs/results/regime/README.md` fixed before the runs; `verdict` applies them.
Bands are `evaluate`'s training-count bands of the target and of the input token
(`analysis.perplexity.COUNT_EDGES`). Deterministic output (fixed bootstrap seed, plan order, formats).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from megatron_lev.analysis.perplexity import COUNT_EDGES, count_band_labels
from megatron_lev.errors import DataError
from studies.plan_raw import (
    BOOTSTRAP,
    BOOTSTRAP_SEED,
    COUNT_SCOPE,
    LEVEL,
    TABLE_KEYS,
    PlanRaw,
    fmt_value,
    paired_differences,
    save_plot,
    seed_interval,
    write_pages,
)

BASE, LEV, ALBERT = "TIED", "LEV", "ALBERT-32"
RARE_BAND = 1  # the band of ids seen 1-9 times
CORPORA = (("mmidx", "validation"), ("text", "zero-shot"))
SIDES = (("target", "target_band"), ("input", "input_band"))
PAGES = ("overall.md", "bands.md", "curve.md", "dynamics.md", "verdict.md")
DYNAMICS_STEPS = (10, 100, 300, 600, 1000)  # the logged steps the dynamics page shows
SEED_SIDE = ("embedding.codebooks.weight", "embedding.proj")  # LEV's codebooks and W_l


def _seeds(raw: PlanRaw, group: str) -> dict[int, dict]:
    return {r["seed"]: r for r in raw.runs if r["group"] == group}


def comparison(raw: PlanRaw, a: str, b: str, kind: str, band: tuple[str, int] | None = None) -> dict | None:
    """`a` minus `b` over the seeds both have: per-seed differences, their mean, the seed-paired and
    the document interval; None where the groups share no seed."""
    sa, sb = _seeds(raw, a), _seeds(raw, b)
    common = sorted(set(sa) & set(sb))
    if not common:
        return None
    pairs = [(raw.result(sa[s], kind), raw.result(sb[s], kind)) for s in common]
    diffs, interval = paired_differences(pairs, band)
    if not diffs:
        return {"seeds": common, "diffs": [], "mean": None, "document": None, "seed": None}
    return {
        "seeds": common,
        "diffs": diffs,
        "mean": statistics.fmean(diffs),
        "document": interval,
        "seed": seed_interval(diffs),
    }


def _interval(iv) -> str:
    return "-" if iv is None else f"[{iv[0]:+.3f}, {iv[1]:+.3f}]"


def _diff_cells(c: dict | None) -> list[str]:
    if c is None or c["mean"] is None:
        return ["-", "-", "-", "-"]
    return [
        f"{c['mean']:+.3f}",
        _interval(c["document"]),
        _interval(c["seed"]),
        ", ".join(f"{d:+.3f}" for d in c["diffs"]),
    ]


def _mean_nll(raw: PlanRaw, group: str, kind: str) -> list[float]:
    return [float(raw.result(r, kind)["mean_nll"]) for r in _seeds(raw, group).values()]


def _fmt_seeds(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def seed_noise(raw: PlanRaw) -> float | None:
    vals = _mean_nll(raw, BASE, "mmidx")
    return statistics.stdev(vals) if len(vals) > 1 else None


def overall_markdown(raw: PlanRaw) -> str:
    lines = [
        "# Regime: overall validation and zero-shot loss",
        "",
        "Mean NLL (nats per predicted token) of each group's final checkpoints, mean ± sd over seeds.",
        "",
        "| group | seeds | validation NLL | zero-shot NLL |",
        "|---|---|---|---|",
    ]
    for group in dict.fromkeys(r["group"] for r in raw.runs):
        seeds = ", ".join(str(s) for s in sorted(_seeds(raw, group)))
        cells = [_fmt_seeds(_mean_nll(raw, group, kind)) for kind, _ in CORPORA]
        lines.append(f"| {group} | {seeds} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Differences (nats; negative: the first group is ahead), over the seeds both groups have: "
        f"document bootstrap {LEVEL:.0%} ({BOOTSTRAP} resamples of the documents, seed {BOOTSTRAP_SEED}, "
        "the same resample for every seed pair) and seed-paired Student-t.",
        "",
        "| comparison | corpus | difference | document 95% | seed-paired 95% | per seed |",
        "|---|---|---|---|---|---|",
    ]
    for a, b in (
        (LEV, BASE),
        (ALBERT, BASE),
        ("UNTIED", BASE),
        (LEV, ALBERT),
        (LEV, "UNTIED"),
        ("LEV-RANDOM", LEV),
    ):
        for kind, label in CORPORA:
            c = comparison(raw, a, b, kind)
            if c is not None:
                lines.append(f"| {a} - {b} | {label} | " + " | ".join(_diff_cells(c)) + " |")
    noise = seed_noise(raw)
    if noise is not None:
        lines += ["", f"Seed noise (sd of TIED's validation NLL over its seeds): {noise:.4f} nats."]
    return "\n".join(lines) + "\n"


def bands_markdown(raw: PlanRaw) -> str:
    labels = count_band_labels(COUNT_EDGES)
    lines = [
        "# Regime: loss by how often the training data held the token",
        "",
        "Bands of the training count (in the training split's `counts.npy`) of the **target** (the "
        "predicted token) and of the **input** (the token before it, the one the input layer embeds). "
        "Tokens: predicted tokens of the band in the first seed's evaluation (the same for every run). "
        f"{COUNT_SCOPE}",
    ]
    for kind, label in CORPORA:
        for side, key in SIDES:
            lines += [
                "",
                f"## {label}, by {side} count",
                "",
                "| band | tokens | vocab ids | TIED NLL | LEV - TIED | document 95% | seed-paired 95% "
                "| per seed | LEV - ALBERT-32 | document 95% | ALBERT-32 - TIED | LEV - UNTIED "
                "| document 95% |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            first = next(iter(_seeds(raw, BASE).values()), None)
            if first is None:
                lines.append("Not available: no TIED run.")
                continue
            rows = raw.result(first, kind).get("count_bands", {}).get(side)
            if rows is None:
                lines.append("Not available: the evaluation has no count bands.")
                continue
            tied = {b: [] for b in range(len(labels))}
            for r in _seeds(raw, BASE).values():
                for b, row in enumerate(raw.result(r, kind)["count_bands"][side]):
                    if row["mean_nll"] is not None:
                        tied[b].append(row["mean_nll"])
            for b, band_label in enumerate(labels):
                c = comparison(raw, LEV, BASE, kind, (key, b))
                la = comparison(raw, LEV, ALBERT, kind, (key, b))
                at = comparison(raw, ALBERT, BASE, kind, (key, b))
                lu = comparison(raw, LEV, "UNTIED", kind, (key, b))
                cells = [
                    band_label,
                    f"{rows[b]['tokens']:,}",
                    f"{rows[b]['vocab_ids']:,}",
                    _fmt_seeds(tied[b]),
                    *_diff_cells(c),
                    *_diff_cells(la)[:2],
                    _diff_cells(at)[0],
                    *_diff_cells(lu)[:2],
                ]
                lines.append("| " + " | ".join(cells) + " |")
        lines += paper_bucket_lines(raw, kind, label)
    return "\n".join(lines) + "\n"


PAPER_BUCKETS = "bucket"  # evaluate's buckets of the target's training frequency (count / tokens)


def paper_bucket_lines(raw: PlanRaw, kind: str, label: str) -> list[str]:
    """The paper's definition of rare tokens: buckets of the **target's** frequency in the training
    data (< 1e-7, ..., >= 1e-4), LEV - TIED and LEV - UNTIED over the seeds each pair has."""
    first = next(iter(_seeds(raw, BASE).values()), None)
    buckets = raw.result(first, kind).get("buckets") if first is not None else None
    if not buckets:
        return []
    lines = [
        "",
        f"## {label}, by the target's training frequency (the paper's buckets)",
        "",
        "The paper's rare tokens are targets rarer than 1 in 10^7 of the training tokens. This "
        "training split holds a few million tokens, so that bucket holds only targets never seen in "
        "training (on validation, the same tokens as target band 0): there a target's loss measures "
        "how the output head treats ids it never saw, not the input layer, and it decides no "
        "criterion. Tokens: the first TIED seed's predicted tokens of the bucket.",
        "",
        "| bucket | tokens | LEV - TIED | document 95% | seed-paired 95% | per seed | LEV - UNTIED | "
        "document 95% | seed-paired 95% |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b, bucket in enumerate(buckets):
        c = comparison(raw, LEV, BASE, kind, (PAPER_BUCKETS, b))
        u = comparison(raw, LEV, "UNTIED", kind, (PAPER_BUCKETS, b))
        cells = [str(bucket["bucket"]), f"{bucket['tokens']:,}", *_diff_cells(c), *_diff_cells(u)[:3]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def curve_markdown(raw: PlanRaw) -> str:
    """The trainer's validation loss (its `eval_iters` batches) over steps, and the LEV-TIED gap."""
    per_group: dict[str, dict[int, list[float]]] = {}
    for r in raw.runs:
        for rec in raw.valid_rows(r):
            per_group.setdefault(r["group"], {}).setdefault(rec["iteration"], []).append(rec["loss"])
    steps = sorted({s for g in per_group.values() for s in g})
    groups = list(per_group)
    lines = [
        "# Regime: validation loss over training",
        "",
        "The trainer's validation loss (`train.eval_iters` batches of the validation shard) at every "
        "`train.eval_interval`, mean over each group's seeds; the gap is LEV's mean minus TIED's.",
        "",
        "| step | " + " | ".join(groups) + " | LEV - TIED |",
        "|---|" + "---|" * (len(groups) + 1),
    ]
    for s in steps:
        vals = {g: statistics.fmean(per_group[g][s]) for g in groups if s in per_group[g]}
        gap = f"{vals[LEV] - vals[BASE]:+.3f}" if LEV in vals and BASE in vals else "-"
        lines.append(
            f"| {s} | " + " | ".join(f"{vals[g]:.3f}" if g in vals else "-" for g in groups) + f" | {gap} |"
        )
    return "\n".join(lines) + "\n"


def _seed_side_share(row: dict) -> float | None:
    """Share of the squared global gradient norm that LEV's codebooks and `W_l` carry (None when the
    run has no such tensors)."""
    parts = [row.get(f"grad_norm/{t}") for t in SEED_SIDE]
    total = row.get("grad_norm/global")
    if any(p is None for p in parts) or not total:
        return None
    return sum(p * p for p in parts) / (total * total)


def dynamics_markdown(raw: PlanRaw) -> str:
    """The input table and the input layer's gradients over training, from each run's `metrics.jsonl`."""
    lines = [
        "# Regime: the input layer over training",
        "",
        "From each run's `metrics.jsonl` (the trainer's dynamics, over the fixed sample of "
        "`logging.dynamics_sample_ids` token ids): RMS of the sample rows of the input table, mean-row "
        "ratio (norm of the mean row / mean row norm; 1 is every token the same vector), effective rank "
        "of the rows and of the rows minus their mean, and how far the logged step moved the rows "
        "(|T_after - T_before| / |T_before|). Clipped: logged steps whose global gradient norm was above "
        "`train.clip_grad`, of the logged steps up to that step.",
        "",
        "| run | step | RMS | mean-row ratio | eff. rank | centred eff. rank | step moved | clipped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in raw.runs:
        rows = raw.train_rows(run)
        for step in DYNAMICS_STEPS:
            r = raw.at(run, step)
            if r is None:
                continue
            upto = [x["clipped"] for x in rows if x["iteration"] <= step and x.get("clipped") is not None]
            vals = [r.get(f"input_table/{k}") for k in TABLE_KEYS]
            lines.append(
                f"| {run['name']} | {step} | {fmt_value(vals[0], '.4f')} | {fmt_value(vals[1], '.4f')} | "
                f"{fmt_value(vals[2], '.1f')} | {fmt_value(vals[3], '.1f')} | {fmt_value(vals[4], '.5f')} | "
                + (f"{sum(upto)}/{len(upto)}" if upto else "-")
                + " |"
            )
    lines += [
        "",
        "## Gradient norms of the input layer",
        "",
        "Unclipped gradient norm of each input-layer tensor on the logged step, the global gradient norm, "
        "and for LEV the share of the squared global norm carried by its codebooks and `W_l` (the seed "
        "side). Seed 1234 of each group.",
        "",
        "| run | step | global | seed-side share | input-layer tensors (grad norm) |",
        "|---|---|---|---|---|",
    ]
    for run in raw.runs:
        if run["seed"] != 1234:
            continue
        for step in DYNAMICS_STEPS:
            r = raw.at(run, step)
            if r is None:
                continue
            tensors = sorted(k for k in r if k.startswith("grad_norm/embedding."))
            cells = ", ".join(f"{k.removeprefix('grad_norm/embedding.')} {r[k]:.4f}" for k in tensors)
            share = _seed_side_share(r)
            lines.append(
                f"| {run['name']} | {step} | {fmt_value(r.get('grad_norm/global'), '.3f')} | "
                f"{fmt_value(share, '.3f')} | {cells or '-'} |"
            )
    return "\n".join(lines) + "\n"


def verdict(raw: PlanRaw) -> tuple[str, list[str]]:
    """The README's criteria applied to the validation shard: (verdict, the reasons)."""
    reasons, ahead, behind = [], [], []
    for side, key in SIDES:
        c = comparison(raw, LEV, BASE, "mmidx", (key, RARE_BAND))
        a = comparison(raw, LEV, ALBERT, "mmidx", (key, RARE_BAND))
        for name, cmp in ((f"LEV - TIED, {side} 1-9", c), (f"LEV - ALBERT-32, {side} 1-9", a)):
            if cmp is None or cmp["document"] is None:
                reasons.append(f"{name}: not available")
                continue
            lo, hi = cmp["document"]
            reasons.append(f"{name}: {cmp['mean']:+.3f} {_interval(cmp['document'])}")
            (ahead if hi < 0 else behind if lo > 0 else []).append(name)
    if behind:  # refute is checked first and decides whatever else holds (the README's order)
        return "refute", reasons
    overall = comparison(raw, LEV, BASE, "mmidx")
    noise = seed_noise(raw)
    if overall is None or noise is None:
        return "inconclusive", [*reasons, "overall LEV - TIED or the seed noise is not available"]
    worse = overall["mean"] > noise
    reasons.append(
        f"overall LEV - TIED: {overall['mean']:+.3f} against a seed noise of {noise:.4f} "
        f"({'worse' if worse else 'no worse'} beyond it)"
    )
    needed = [f"LEV - {o}, {s} 1-9" for o in ("TIED", "ALBERT-32") for s, _ in SIDES]
    tied_rare = [n for n in needed if n.startswith("LEV - TIED")]
    if all(n in ahead for n in needed) and not worse:
        return "support", reasons
    if all(n in ahead for n in tied_rare) and worse:
        return "trade-off", reasons
    missing = [n for n in needed if n not in ahead]
    return "inconclusive", [*reasons, "not ahead with an interval below zero: " + ", ".join(missing)]


SCALE_NOTE = (
    "The scale: a 4 x 192 model of 11.4M parameters (TIED) trained on 2.05M tokens, 0.18 tokens per "
    "parameter, about 1% of a compute-optimal budget, at a peak rate of 1e-3 for both sides (5e-4 is "
    "worse for both: `../lr/`) and with `train.clip_grad=1` clipping every LEV step (`../clip/`). The "
    'paper reports that at 200M "LEV starts behind and overtakes" TIED; a deficit this early in '
    "training is what that predicts. Over a 4x longer run at a constant rate the gap grows "
    "(`../budget/curve.md`, one seed); this verdict says nothing about the paper's scale."
)


def verdict_markdown(raw: PlanRaw) -> str:
    v, reasons = verdict(raw)
    lines = ["# Regime: the criteria of the README applied", ""]
    if preliminary := raw.preliminary():
        lines += [
            f"{preliminary} The criteria are applied to the runs collected, and the verdict may "
            "change when the rest are.",
            "",
        ]
    lines += [
        f"**{v}**, at this scale only",
        "",
        *[f"- {r}" for r in reasons],
        "",
        f"Validation shard; differences in nats, document bootstrap 95% over the seed pairs. {COUNT_SCOPE}",
        "",
        SCALE_NOTE,
    ]
    return "\n".join(lines) + "\n"


def write_plots(raw: PlanRaw, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = count_band_labels(COUNT_EDGES)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, (side, key) in zip(axes, SIDES):
        for other, color in ((BASE, "C0"), (ALBERT, "C1")):
            xs, ys, err = [], [], []
            for b in range(len(labels)):
                c = comparison(raw, LEV, other, "mmidx", (key, b))
                if c and c["mean"] is not None and c["document"] is not None:
                    xs.append(b + (0.1 if other == ALBERT else 0))
                    ys.append(c["mean"])
                    err.append([c["mean"] - c["document"][0], c["document"][1] - c["mean"]])
            if xs:
                ax.errorbar(xs, ys, yerr=list(zip(*err)), fmt="o", color=color, label=f"LEV - {other}")
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(f"validation, by {side} training count")
        ax.set_xlabel("training count band")
    axes[0].set_ylabel("NLL difference (nats)")
    axes[0].legend()
    save_plot(fig, out, "bands.png")

    groups = list(dict.fromkeys(r["group"] for r in raw.runs))
    colour = {g: plt.get_cmap("tab10").colors[i % 10] for i, g in enumerate(groups)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    curves: dict[str, dict[int, list[float]]] = {}
    for run in raw.runs:
        for rec in raw.valid_rows(run):
            curves.setdefault(run["group"], {}).setdefault(rec["iteration"], []).append(rec["loss"])
    for g, pts in curves.items():
        steps = sorted(pts)
        axes[0].plot(steps, [statistics.fmean(pts[s]) for s in steps], "o-", color=colour[g], label=g)
    if LEV in curves and BASE in curves:
        steps = sorted(set(curves[LEV]) & set(curves[BASE]))
        gap = [statistics.fmean(curves[LEV][s]) - statistics.fmean(curves[BASE][s]) for s in steps]
        axes[1].plot(steps, gap, "o-", color=colour[LEV])
    axes[0].set_title("validation loss (mean over seeds)")
    axes[1].set_title("LEV - TIED validation loss")
    axes[1].axhline(0, color="grey", linewidth=0.8)
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plots" / "curve.png", dpi=110)
    plt.close(fig)

    panels = [
        ("input_table/rms", "input table RMS", True),
        ("input_table/mean_row_ratio", "mean-row ratio", False),
        ("input_table/effective_rank_centred", "centred effective rank", True),
        ("grad_norm/global", "global gradient norm", True),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.0))
    for ax, (key, title, log) in zip(axes, panels):
        for run in raw.runs:
            if run["seed"] != 1234:
                continue
            xs, ys = raw.series(run, key)
            if xs:
                ax.plot(xs, ys, color=colour[run["group"]], label=run["group"], linewidth=1.1)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
    handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
    if handles:
        axes[0].legend(list(handles.values()), list(handles), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plots" / "dynamics.png", dpi=110)
    plt.close(fig)


ORDERS = ("LEV-BPE", "LEV-RANDOM", "LEV-FREQUENCY")


def order_markdown(raw: PlanRaw) -> str:
    """The token-id order experiment (plan `order`): each order against BPE order, overall and by the
    input token's training count."""
    lines = ["# LEV's token-id order", ""]
    if preliminary := raw.preliminary():
        lines += [preliminary, ""]
    lines += [
        "Mean NLL (nats per predicted token), mean ± sd over seeds; differences against BPE order "
        f"(the spec's) with the document bootstrap {LEVEL:.0%} over the seed pairs and the seed-paired "
        f"Student-t interval. Input bands: the input token's training count. {COUNT_SCOPE}",
        "",
        "| order | seeds | validation NLL | zero-shot NLL |",
        "|---|---|---|---|",
    ]
    for group in ORDERS:
        seeds = ", ".join(str(s) for s in sorted(_seeds(raw, group))) or "-"
        cells = [_fmt_seeds(_mean_nll(raw, group, kind)) for kind, _ in CORPORA]
        lines.append(f"| {group} | {seeds} | " + " | ".join(cells) + " |")
    labels = count_band_labels(COUNT_EDGES)
    lines += [
        "",
        "| comparison | corpus | input band | difference | document 95% | seed-paired 95% | per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for other in ORDERS[1:]:
        for kind, label in CORPORA:
            for b, band in ((None, "all"), *((("input_band", k), lab) for k, lab in enumerate(labels))):
                c = comparison(raw, other, ORDERS[0], kind, b)
                if c is not None:
                    lines.append(
                        f"| {other} - LEV-BPE | {label} | {band} | " + " | ".join(_diff_cells(c)) + " |"
                    )
    return "\n".join(lines) + "\n"


def write_order_report(raw_dir: Path, out_dir: Path, plots: bool = False) -> dict[str, Path]:
    return write_pages(Path(out_dir), {"order.md": order_markdown(PlanRaw(Path(raw_dir)))})


def write_regime_report(raw_dir: Path, out_dir: Path, plots: bool = True) -> dict[str, Path]:
    raw = PlanRaw(Path(raw_dir))
    if not any(r["group"] == BASE for r in raw.runs):
        raise DataError(f"{raw_dir}: no {BASE} run collected; the regime report compares against it")
    out = Path(out_dir)
    paths = write_pages(
        out,
        {
            "overall.md": overall_markdown(raw),
            "bands.md": bands_markdown(raw),
            "curve.md": curve_markdown(raw),
            "dynamics.md": dynamics_markdown(raw),
            "verdict.md": verdict_markdown(raw),
        },
    )
    if plots:
        write_plots(raw, out)
    return paths
