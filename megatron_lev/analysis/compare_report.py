"""The comparison written out: the markdown tables of `compare_results`' output and its plots
(loss curves, perplexity by bucket, the changes against the baseline with their intervals)."""

from __future__ import annotations

from pathlib import Path

from megatron_lev.analysis.curves import Curve
from megatron_lev.analysis.paired_intervals import LEVEL


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}%"


def mean_sd_cell(stats: dict) -> str:
    if stats["mean"] is None:
        return "-"
    if stats["sd"] is None:
        return f"{stats['mean']:+.2f}% (1 seed)"
    return f"{stats['mean']:+.2f}% ± {stats['sd']:.2f}"


def _bucket_cell(bucket: dict) -> str:
    """A bucket's label with its target-token count: a change over a handful of tokens reads as such."""
    n = bucket.get("tokens")
    return bucket["bucket"] if n is None else f"{bucket['bucket']} ({n:,} token{'' if n == 1 else 's'})"


def interval_cell(ci: list[float] | None, why: str) -> str:
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
                f"| {r['name']} | {label} | {mean_sd_cell(stats)} | "
                f"{interval_cell(stats['seed_interval'], seed_why)} | "
                f"{interval_cell(stats['bootstrap_interval'], boot_why)} |"
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
                f"| {t['term']} | {t['variant']} vs {t['reference']} | {mean_sd_cell(g)} | "
                f"{interval_cell(g['seed_interval'], seed_why)} | "
                f"{interval_cell(g['bootstrap_interval'], boot_why)} | {paper} |"
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
