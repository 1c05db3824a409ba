"""One capacity report per embedding matrix: exact eps, all four formulas, class, caveats; JSON/markdown/PNG.

eps is exact over all pairs (the Gram identity, float64); the histogram is over all pairs or a stated
seeded row sample, and every output says which.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from megatron_lev.analysis.cosine import cosine_stats
from megatron_lev.analysis.formulas import CAVEATS, CLASS_NOTE, REPRODUCES_TABLE, capacity_table, eps_class


def capacity_report(
    matrix: torch.Tensor | np.ndarray,
    name: str,
    sample: int | None = None,
    block: int = 4096,
    bins: int = 2000,
    hist_stride: int | None = None,
    seed: int = 0,
    histogram: str = "sample",
    hist_rows: int = 10_000,
    device: str | None = None,
    progress: bool = False,
) -> dict:
    """Measure eps of a (V, d) matrix and evaluate the capacity formulas; a JSON-ready dict.

    The histogram is kept under "histogram" for the PNG written by `write_report`.
    """
    stats = cosine_stats(
        matrix,
        block=block,
        bins=bins,
        histogram=histogram,
        hist_rows=hist_rows,
        sample=sample,
        seed=seed,
        hist_stride=hist_stride,
        device=device,
        progress=progress,
    )
    cls = eps_class(stats.eps)
    shape = tuple(matrix.shape)
    measured = stats.to_dict()
    return {
        "name": name,
        "shape": list(shape),
        "d": stats.dim,
        **measured,
        "class": cls,
        "class_note": CLASS_NOTE[cls],
        "capacity": capacity_table(stats.dim, stats.eps),
        "capacity_meaningful": cls == "low-eps",
        "table_form": REPRODUCES_TABLE,
        "caveats": CAVEATS,
        "eps_source": eps_source(measured),
        "histogram_source": histogram_source(measured),
        "histogram": {"edges": stats.hist_edges.tolist(), "counts": stats.hist_counts.tolist()},
    }


def eps_source(r: dict) -> str:
    """Where eps comes from, in words: exact over all pairs, or over a seeded row sample."""
    rows = "all rows" if r["exact"] else f"a sample of {r['sampled_rows']:,} rows (seed {r['seed']})"
    return f"exact over the {r['pairs']:.3g} pairs of {rows} (Gram identity, float64)"


def histogram_source(r: dict) -> str:
    """Which pairs the histogram is over, in words."""
    if r["hist_mode"] == "off":
        return "no histogram"
    stride = "" if r["hist_stride"] == 1 else f", every k-th row of a block, k = {r['hist_stride']}"
    if r["hist_mode"] == "full":
        return f"all {r['hist_pairs']:.3g} pairs{stride}"
    return (
        f"{r['hist_pairs']:.3g} pairs of a sample of {r['hist_rows']:,} rows (seed {r['hist_seed']}){stride}"
    )


def report_markdown(reports: list[dict]) -> str:
    """Per matrix: eps line, then the four formulas side by side (log10 capacity)."""
    lines = [
        "| matrix | V x d | pairs | mu | sigma | eps | class | JL proven | JL tight | adjusted (1 const) "
        "| fitted (4 const, paper table) |",
        "|---" * 11 + "|",
    ]
    sources = []
    for r in reports:
        caps = {c["key"]: c["capacity"] for c in r["capacity"]}
        pairs = f"{r['pairs']:.3g}" + ("" if r["exact"] else f" (sample of {r['sampled_rows']} rows)")
        lines.append(
            f"| {r['name']} | {r['shape'][0]} x {r['shape'][1]} | {pairs} | {r['mean']:.5f} "
            f"| {r['std']:.5f} | {r['eps']:.5f} | {r['class']} | {caps['jl_proven']} "
            f"| {caps['jl_tight']} | {caps['adjusted']} | {caps['fitted']} |"
        )
        cross = (
            ""
            if r.get("eps_pairs") is None
            else f"; the all-pairs pass (float32 products) gives {r['eps_pairs']:.8f}"
        )
        sources.append(
            f"- {r['name']}: eps {r['eps']:.8f}, {eps_source(r)}{cross}; histogram: {histogram_source(r)}."
        )
    notes = sorted({f"- {r['class']}: {r['class_note']}" for r in reports})
    return "\n".join(lines + ["", *sources, "", *notes, "", REPRODUCES_TABLE, "", CAVEATS]) + "\n"


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "matrix"


def plot_histogram(report: dict, path: Path) -> Path:
    """Histogram of pairwise cosines with mu and eps marked (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = np.asarray(report["histogram"]["edges"])
    counts = np.asarray(report["histogram"]["counts"], dtype=np.float64)
    nz = np.nonzero(counts)[0]
    lo, hi = (edges[nz[0]], edges[nz[-1] + 1]) if len(nz) else (-1.0, 1.0)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.stairs(counts, edges, fill=True, alpha=0.6)
    ax.axvline(report["mean"], color="k", ls="--", label=f"mu = {report['mean']:.4f}")
    ax.axvline(report["eps"], color="r", label=f"eps = mu + 2 sigma = {report['eps']:.4f}")
    ax.set_xlim(min(lo, report["mean"]) - 0.02, max(hi, report["eps"]) + 0.02)
    ax.set_xlabel("cosine similarity of row pairs")
    ax.set_ylabel("pairs" if report["hist_mode"] == "full" else "pairs in the row sample")
    ax.set_title(
        f"{report['name']} ({report['class']})\nmu, eps: exact over all {report['pairs']:.3g} pairs"
        f"{'' if report['exact'] else ' of the row sample'}; histogram: {histogram_source(report)}",
        fontsize=8,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(reports: list[dict], out_dir: str | Path) -> dict[str, Path]:
    """Write capacity.json, capacity.md and one histogram PNG per matrix that has one (atomically)."""
    from megatron_lev.utils.io import atomic_write_json, atomic_write_text

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for r in reports:
        if r["hist_mode"] == "off":
            continue
        png = out / f"cosine_hist_{_slug(r['name'])}.png"
        tmp = png.with_suffix(".tmp.png")
        plot_histogram(r, tmp)
        tmp.replace(png)
        paths[r["name"]] = png
    atomic_write_json(out / "capacity.json", {"reports": reports})
    atomic_write_text(out / "capacity.md", report_markdown(reports))
    paths["json"], paths["markdown"] = out / "capacity.json", out / "capacity.md"
    return paths
