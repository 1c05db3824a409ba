"""The LEV pilot's tables and plots, regenerated from its raw files alone (`python -m studies collect`).

    write_pilot_report("results/pilot/raw", "docs/results/pilot")

Per run the raw directory holds `eval.json` (the final checkpoint on the validation shard and the
zero-shot documents, with per-document NLL sums), `metrics.jsonl` (the training dynamics every
`logging.log_interval` steps), `geometry.json` and `config.yaml`; `study.json` lists the runs.
The rules the tables apply are those `docs/results/pilot/README.md` fixed before the runs
(`COLLAPSE_*`, `TIE_NATS`, the group orders below). The output is deterministic (fixed bootstrap
seed, plan order, fixed formats).
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_lev.errors import DataError
from studies.plan_raw import (
    BOOTSTRAP,
    BOOTSTRAP_SEED,
    LEVEL,
    TABLE_KEYS,
    PlanRaw,
    fmt_value,
    paired_interval,
    write_pages,
)

# the rules of docs/results/pilot/README.md
COLLAPSE_MEAN_ROW = 0.9  # mean-row ratio above this at the last step: collapsed
COLLAPSE_RANK_FRACTION = 0.5  # centred effective rank below this share of its value at step 10: collapsed
TIE_NATS = 0.01
SPEC_ORDER = ("LEV", "LEV-W10", "LEV-X01", "LEV-O", "LEV-R", "LEV-RS", "LEV-RG")  # nearest the spec first
BASE_LR = 2e-3
LR_SUFFIX = {"-LR1": 1e-3, "-LR4": 4e-3}
STEPS_SHOWN = (10, 50, 150, 300)
INPUT_TENSORS = ("codebooks.weight", "proj", "norm_weight", "norm_bias", "delta", "out_proj", "table.weight")
PAGES = ("runs.md", "collapse.md", "gradients.md", "selection.md")


def learning_rate(group: str) -> float:
    return next((lr for suffix, lr in LR_SUFFIX.items() if group.endswith(suffix)), BASE_LR)


def mean_nll(result: dict) -> float:
    return float(result["mean_nll"])


def _cell(point: float, lo: float, hi: float) -> str:
    return f"{point:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def collapsed(raw: PlanRaw, run: dict) -> bool | None:
    """The README's rule: at the last logged step, mean-row ratio > 0.9 or centred effective rank
    below half its value at step 10 (None where the run logged no table statistics)."""
    rows = [r for r in raw.train_rows(run) if "input_table/mean_row_ratio" in r]
    first = next((r for r in rows if r["iteration"] == 10), None)
    if not rows or first is None:
        return None
    last = rows[-1]
    low_rank = last["input_table/effective_rank_centred"] < (
        COLLAPSE_RANK_FRACTION * first["input_table/effective_rank_centred"]
    )
    return bool(last["input_table/mean_row_ratio"] > COLLAPSE_MEAN_ROW or low_rank)


def runs_markdown(raw: PlanRaw) -> str:
    lines = [
        "# Pilot: validation and zero-shot loss of every run at step 300",
        "",
        "Mean NLL in nats per token of the final checkpoint (`megatron-lev evaluate`). Differences: "
        "this run minus the reference run with the same seed where there is one (seed 1234 "
        f"otherwise), over the same documents; brackets: {LEVEL:.0%} bootstrap interval over "
        f"documents ({BOOTSTRAP} resamples, seed {BOOTSTRAP_SEED}).",
        "",
        "| run | group | seed | peak lr | validation NLL | vs LEV | vs TIED | zero-shot NLL | vs LEV | "
        "vs TIED | collapsed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in raw.runs:
        cells = [run["name"], run["group"], str(run["seed"]), f"{learning_rate(run['group']):g}"]
        for kind in ("mmidx", "text"):
            res = raw.result(run, kind)
            cells.append(f"{mean_nll(res):.4f}")
            for ref_group in ("LEV", "TIED"):
                ref = raw.run(ref_group, run["seed"]) or raw.run(ref_group)
                if ref is None or ref["name"] == run["name"]:
                    cells.append("-")
                    continue
                cells.append(_cell(*paired_interval(res, raw.result(ref, kind))))
        c = collapsed(raw, run)
        cells.append("-" if c is None else ("yes" if c else "no"))
        lines.append("| " + " | ".join(cells) + " |")
    seeds = _seed_spread(raw)
    if seeds:
        lines += ["", "Seed to seed (same group, train.seed 1234 vs 1235, validation NLL):", ""]
        lines += [f"- {g}: {a:.4f} and {b:.4f}, spread {abs(a - b):.4f} nats" for g, (a, b) in seeds.items()]
    return "\n".join(lines) + "\n"


def _seed_spread(raw: PlanRaw) -> dict[str, tuple[float, float]]:
    out = {}
    for group, runs in raw.groups().items():
        by_seed = {r["seed"]: r for r in runs}
        if 1234 in by_seed and 1235 in by_seed:
            out[group] = (mean_nll(raw.result(by_seed[1234])), mean_nll(raw.result(by_seed[1235])))
    return out


def collapse_markdown(raw: PlanRaw) -> str:
    lines = [
        "# Pilot: the input table over training",
        "",
        "From each run's `metrics.jsonl` (the training dynamics, over the fixed sample of "
        "`logging.dynamics_sample_ids` token ids): RMS of the sample rows, mean-row ratio (norm of the "
        "mean row / mean row norm), effective rank of the rows and of the rows minus their mean, and how "
        "far the logged step moved the rows (|T_after - T_before| / |T_before|).",
        "",
        "| run | step | RMS | mean-row ratio | eff. rank | centred eff. rank | step moved | clipped steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in raw.runs:
        rows = raw.train_rows(run)
        clipped = [r.get("clipped") for r in rows if r.get("clipped") is not None]
        share = f"{sum(clipped)}/{len(clipped)}" if clipped else "-"
        for step in STEPS_SHOWN:
            r = raw.at(run, step)
            if r is None:
                continue
            vals = [r.get(f"input_table/{k}") for k in TABLE_KEYS]
            lines.append(
                f"| {run['name']} | {step} | {fmt_value(vals[0], '.4f')} | {fmt_value(vals[1], '.4f')} | "
                f"{fmt_value(vals[2], '.1f')} | {fmt_value(vals[3], '.1f')} | {fmt_value(vals[4], '.4f')} | "
                f"{share if step == STEPS_SHOWN[-1] else ''} |"
            )
    lines += [
        "",
        "Clipped steps: logged steps whose global gradient norm was above `train.clip_grad` (1.0), of "
        "the logged steps.",
    ]
    return "\n".join(lines) + "\n"


def gradients_markdown(raw: PlanRaw) -> str:
    lines = [
        "# Pilot: gradient norms and update ratios of the input layer",
        "",
        "Unclipped gradient norm `||g||` and update ratio `||dw|| / ||w||` of each input-layer tensor "
        "on the logged step, and the global gradient norm (`grad_norm/global`).",
        "",
        "| run | step | tensor | grad norm | update ratio | global grad norm |",
        "|---|---|---|---|---|---|",
    ]
    for run in raw.runs:
        for step in STEPS_SHOWN:
            r = raw.at(run, step)
            if r is None:
                continue
            for t in INPUT_TENSORS:
                g = r.get(f"grad_norm/embedding.{t}")
                if g is None:
                    continue
                u = r.get(f"update_ratio/embedding.{t}")
                lines.append(
                    f"| {run['name']} | {step} | {t} | {fmt_value(g, '.4f')} | {fmt_value(u, '.5f')} | "
                    f"{fmt_value(r.get('grad_norm/global'), '.3f')} |"
                )
    return "\n".join(lines) + "\n"


def _pick(candidates: list[tuple[str, float]], order: list[str]) -> tuple[str, list[str]]:
    """The candidate with the lowest NLL; those within TIE_NATS of it are tied and the first of them
    in `order` wins. Returns the winner and the tied set."""
    best = min(v for _, v in candidates)
    tied = [g for g, v in candidates if v - best <= TIE_NATS]
    return min(tied, key=order.index), tied


def warmed(group: str) -> str:
    """The group with the 10% warm-up (the amendment of the README): LEV-W10 for LEV as is."""
    if group == "LEV":
        return "LEV-W10"
    return group if group.endswith("-W10") else f"{group}-W10"


def selection(raw: PlanRaw) -> dict:
    """The README's rules applied: the chosen LEV setting, each side's learning rate, the default."""
    present = {g for g in raw.groups()}
    settings = [(g, mean_nll(raw.result(raw.run(g)))) for g in SPEC_ORDER if g in present]
    if not settings:
        raise DataError("no LEV group at the study's learning rate was collected")
    chosen, tied = _pick(settings, list(SPEC_ORDER))
    out = {"settings": settings, "chosen": chosen, "tied": tied, "lr": {}}
    # the amendment: both sides' sweeps run with the 10% warm-up
    for side, base in (("TIED", "TIED-W10"), ("LEV", warmed(chosen))):
        options = [(base, BASE_LR)] + [(f"{base}{sfx}", lr) for sfx, lr in LR_SUFFIX.items()]
        have = [(g, lr) for g, lr in options if g in present]
        if len(have) < len(options):
            out["lr"][side] = None  # not every rate was run yet
            continue
        vals = [(g, mean_nll(raw.result(raw.run(g)))) for g, _ in have]
        nearer = sorted((g for g, _ in have), key=lambda g: abs(math.log(learning_rate(g) / BASE_LR)))
        out["lr"][side] = _pick(vals, nearer)
    as_is, pick = raw.run("LEV"), raw.run(chosen)
    spread = _seed_spread(raw).get("LEV")
    margin = max(TIE_NATS, abs(spread[0] - spread[1]) if spread else 0.0)
    if chosen == "LEV":
        out["default"] = (False, "LEV as the spec defines it is the chosen setting")
    else:
        point, lo, hi = paired_interval(raw.result(pick), raw.result(as_is))
        ok = collapsed(raw, pick) is False and -point > margin and hi < 0
        out["default"] = (ok, f"{chosen} - LEV = {_cell(point, lo, hi)} nats, margin {margin:.4f}")
    return out


def selection_markdown(raw: PlanRaw) -> str:
    sel = selection(raw)
    lines = [
        "# Pilot: the rules of the README applied",
        "",
        "## The LEV setting",
        "",
        "| group | validation NLL | collapsed |",
        "|---|---|---|",
    ]
    for g, v in sel["settings"]:
        c = collapsed(raw, raw.run(g))
        lines.append(f"| {g} | {v:.4f} | {'-' if c is None else ('yes' if c else 'no')} |")
    lines += [
        "",
        f"Lowest: {min(sel['settings'], key=lambda x: x[1])[0]}; within {TIE_NATS} nats of it: "
        f"{', '.join(sel['tied'])}; chosen (nearest the spec among those): **{sel['chosen']}**.",
        "",
        "## The learning rate",
        "",
    ]
    for side, got in sel["lr"].items():
        if got is None:
            lines.append(f"- {side}: not every rate of the sweep has been run yet.")
        else:
            winner, tied = got
            lines.append(
                f"- {side}: {winner} (peak lr {learning_rate(winner):g}); within {TIE_NATS} nats: "
                f"{', '.join(tied)}."
            )
    if all(sel["lr"].get(side) for side in ("TIED", "LEV")):
        tied, lev = raw.run(sel["lr"]["TIED"][0]), raw.run(sel["lr"]["LEV"][0])
        lines += [
            "",
            "## Each side at its chosen setting",
            "",
            f"{sel['lr']['LEV'][0]} minus {sel['lr']['TIED'][0]} (seed 1234, the same documents; 95% "
            "bootstrap interval over documents):",
            "",
        ]
        for kind, label in (("mmidx", "validation"), ("text", "zero-shot")):
            point, lo, hi = paired_interval(raw.result(lev, kind), raw.result(tied, kind))
            lines.append(f"- {label}: {_cell(point, lo, hi)} nats")
    ok, why = sel["default"]
    lines += [
        "",
        "## The default",
        "",
        f"{'Becomes the default' if ok else 'Does not become the default'}: {why}.",
    ]
    return "\n".join(lines) + "\n"


def write_plots(raw: PlanRaw, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = out / "plots"
    d.mkdir(parents=True, exist_ok=True)
    seed1 = [r for r in raw.runs if r["seed"] == 1234]
    palette = plt.get_cmap("tab20").colors  # one colour per group (up to 20), the same in every panel
    colour = {r["group"]: palette[i % len(palette)] for i, r in enumerate(seed1)}
    panels = [
        ("loss", "training loss", False),
        ("input_table/rms", "input table RMS", True),
        ("input_table/mean_row_ratio", "mean-row ratio", False),
        ("input_table/effective_rank_centred", "centred effective rank", True),
        ("grad_norm/global", "global gradient norm", True),
    ]
    paths = []
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (key, title, log) in zip(axes, panels):
        for run in seed1:
            xs, ys = raw.series(run, key)
            if xs:
                style = "--" if run["variant"] == "tied" else "-"
                ax.plot(xs, ys, style, color=colour[run["group"]], label=run["group"], linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(d / "dynamics.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    levs = [r for r in seed1 if r["variant"] == "lev"]
    tensors = [t for t in INPUT_TENSORS if t != "table.weight"]
    fig, axes = plt.subplots(1, len(tensors), figsize=(4.2 * len(tensors), 4.0), sharey=True)
    for ax, t in zip(axes, tensors):
        for run in levs:
            xs, ys = raw.series(run, f"grad_norm/embedding.{t}")
            if xs:
                ax.plot(xs, ys, color=colour[run["group"]], label=run["group"], linewidth=1.2)
        ax.set_title(f"grad norm: {t}")
        ax.set_xlabel("step")
        ax.set_yscale("log")
    handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
    if handles:
        axes[0].legend(list(handles.values()), list(handles), fontsize=7)
    fig.tight_layout()
    paths.append(d / "gradients.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_pilot_report(raw_dir: Path, out_dir: Path, plots: bool = True) -> dict[str, Path]:
    raw = PlanRaw(Path(raw_dir))
    out = Path(out_dir)
    paths = write_pages(
        out,
        {
            "runs.md": runs_markdown(raw),
            "collapse.md": collapse_markdown(raw),
            "gradients.md": gradients_markdown(raw),
            "selection.md": selection_markdown(raw),
        },
    )
    if plots:
        write_plots(raw, out)
    return paths
