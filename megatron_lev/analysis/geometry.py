"""How the geometry of a run's embeddings changes over training, checkpoint by checkpoint.

    rows = run_geometry("runs/lev")                    # one row per (checkpoint, matrix)
    write_geometry([*rows_a, *rows_b], "out/")          # geometry.md, .csv, .json and .png

For every complete training checkpoint (`iter_XXXXXXX` with its `complete` marker) under a
run's save directory, the input table (dense, or materialised by the model's own
`InputEmbedding.materialize` for LEV and the compressed baselines) and the output head
(the same table for a tied model) are measured:

- `eps`, `mu`, `sigma` of the pairwise cosines, exact from the Gram matrix (`cosine.cosine_stats`);
  `mu` is the mean pairwise cosine;
- `mean_row_ratio`: the norm of the mean row over the mean row norm (0 for rows spread in all
  directions, 1 when every row is the same vector);
- `effective_rank`: `exp(H)`, H the Shannon entropy of the singular values normalised to sum 1
  (Roy & Vetterli, 2007); `rank_bound` is the most the table's construction allows (LEV:
  `h * r`, plus `d_seed` with the residual path; ALBERT: `e`; otherwise `min(V, D)`).

Rows beyond the tokenizer's vocabulary (padding) are left out, as in the export.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_lev.analysis.cosine import cosine_stats
from megatron_lev.ckpt.layout import COMPLETE_MARKER, list_checkpoints
from megatron_lev.ckpt.record import config_beside
from megatron_lev.errors import DataError
from megatron_lev.utils import matrix as matrix_stats

METRICS = ("eps", "mu", "sigma", "mean_row_ratio", "effective_rank")
RANK_NOTE = (
    "LEV's input table `sum_l M_l W_out_l` has rank at most h x r (plus d_seed with the residual "
    "path), whatever the vocabulary; ALBERT's at most e; `rank_bound` gives each bound."
)


class GeometryError(DataError):
    """A run directory holds nothing to measure (no complete training checkpoint)."""


@dataclass
class GeometryRow:
    run: str  # the run directory's name
    embedding: str  # model.embedding
    iteration: int
    tokens: int | None  # tokens trained on at this checkpoint (None when unknown)
    matrix: str  # "input" or "output"
    rows: int  # rows of the table (the tokenizer's vocabulary)
    pair_rows: int  # non-zero rows the pairwise statistics are over (fewer with --sample)
    dim: int
    eps: float
    mu: float
    sigma: float
    mean_row_ratio: float
    effective_rank: float
    rank_bound: int


def checkpoint_tags(run_dir: str | Path) -> tuple[Path, list[tuple[int, str]]]:
    """The save directory of `run_dir` and its complete trainer tags `[(iteration, tag)]`, in order.

    `run_dir` is a run's output directory (its config.yaml names `train.save`; default
    `<run_dir>/checkpoints`) or the save directory itself.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise GeometryError(f"{run_dir}: not a directory; pass a run's output or save directory")
    save_dir = run_dir
    if not _tags(run_dir):
        save_dir = run_dir / "checkpoints"
        config = config_beside(run_dir)
        if config is not None:
            from megatron_lev.config import load_config

            save = load_config([config], validate=False).train.save
            save_dir = Path(save) if save else save_dir
    tags = _tags(save_dir)
    if not tags:
        raise GeometryError(
            f"{run_dir}: no complete training checkpoint (iter_XXXXXXX with a '{COMPLETE_MARKER}' "
            f"marker) under {save_dir}"
        )
    return save_dir, tags


def _tags(save_dir: Path) -> list[tuple[int, str]]:
    return [(c.iteration, c.tag) for c in list_checkpoints(save_dir) if c.complete]


def tokens_by_iteration(run_dir: Path) -> dict[int, int]:
    """`{iteration: tokens}` from the run's metrics.jsonl train lines (empty when there is none)."""
    path = run_dir / "metrics.jsonl"
    out: dict[int, int] = {}
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(row, dict) and row.get("kind") == "train" and "tokens" in row and "iteration" in row:
            out[int(row["iteration"])] = int(row["tokens"])
    return out


def effective_rank(matrix: torch.Tensor, chunk: int = 16384) -> float:
    """`exp(-sum p log p)`, p the singular values of `matrix (V, d)` over their sum, from the float64
    Gram matrix (its eigenvalues are the squared singular values); `utils.matrix.effective_rank`."""
    return float(matrix_stats.effective_rank(matrix, chunk))


def mean_row_ratio(matrix: torch.Tensor) -> float:
    """`|mean_i x_i| / mean_i |x_i|` in float64 (0 for a zero matrix); `utils.matrix.mean_row_ratio`."""
    return float(matrix_stats.mean_row_ratio(matrix))


def matrix_geometry(matrix: torch.Tensor, sample: int | None = None, seed: int = 0) -> dict[str, float]:
    """eps, mu, sigma (`cosine_stats`, no histogram), mean_row_ratio and effective_rank of `(V, d)`."""
    stats = cosine_stats(matrix, histogram="off", sample=sample, seed=seed)
    return {
        "rows": matrix.shape[0],
        "pair_rows": stats.rows,
        "dim": stats.dim,
        "eps": stats.eps,
        "mu": stats.mean,
        "sigma": stats.std,
        "mean_row_ratio": mean_row_ratio(matrix),
        "effective_rank": effective_rank(matrix),
    }


def rank_bound(model_cfg, vocab_size: int) -> int:
    """The most the input table's construction allows (see the module docstring)."""
    bound = min(vocab_size, model_cfg.hidden_size)
    if model_cfg.embedding == "lev":
        lev = model_cfg.lev
        return min(bound, lev.heads * lev.rank + (lev.d_seed if lev.residual else 0))
    if model_cfg.embedding == "albert":
        from megatron_lev.model.embeddings import baseline_sizes

        return min(bound, baseline_sizes("albert", vocab_size, model_cfg.hidden_size, model_cfg)[0])
    return bound


def checkpoint_matrices(save_dir: Path, tag: str) -> tuple[object, torch.Tensor, torch.Tensor]:
    """`(source checkpoint, input table (V, D), output head (V, D))` of one tag, fp32, padding rows cut.

    The input table is rebuilt with the model's own code (`InputEmbedding.materialize`).
    """
    from megatron_lev.convert.hf_export import materialized_table
    from megatron_lev.convert.source import load_canonical_state, open_checkpoint

    src = open_checkpoint(save_dir, tag=tag)
    state = load_canonical_state(src, progress=False)
    params = {k[len("embedding.") :]: v for k, v in state.items() if k.startswith("embedding.")}
    table = materialized_table(src, params).float()
    head = state.get("output_head.weight")
    head = table if head is None else head[: src.vocab_size].float()
    return src, table, head


def run_geometry(run_dir: str | Path, sample: int | None = None, seed: int = 0) -> list[GeometryRow]:
    """One `GeometryRow` per (complete checkpoint, matrix) of the run, in iteration order."""
    run_dir = Path(run_dir)
    save_dir, tags = checkpoint_tags(run_dir)
    tokens = tokens_by_iteration(run_dir)
    rows = []
    for iteration, tag in tags:
        src, table, head = checkpoint_matrices(save_dir, tag)
        model_cfg = src.cfg.model
        bounds = {"input": rank_bound(model_cfg, src.vocab_size), "output": min(head.shape)}
        for name, matrix in (("input", table), ("output", head)):
            rows.append(
                GeometryRow(
                    run=run_dir.resolve().name,
                    embedding=model_cfg.embedding,
                    iteration=iteration,
                    tokens=tokens.get(iteration),
                    matrix=name,
                    rank_bound=bounds[name],
                    **matrix_geometry(matrix, sample, seed),
                )
            )
    return rows


def geometry_markdown(rows: list[GeometryRow]) -> str:
    columns = ("run", "embedding", "iteration", "tokens", "matrix", "eps", "mu", "sigma")
    columns += ("mean row / row norm", "eff. rank", "rank bound")
    head = "| " + " | ".join(columns) + " |"
    lines = ["# Embedding geometry over training", "", head, "|" + "---|" * len(columns)]
    for r in rows:
        tokens = f"{r.tokens:,}" if r.tokens is not None else "-"
        lines.append(
            f"| {r.run} | {r.embedding} | {r.iteration} | {tokens} | {r.matrix} | {r.eps:.4f} | {r.mu:.4f} | "
            f"{r.sigma:.4f} | {r.mean_row_ratio:.4f} | {r.effective_rank:.1f} | {r.rank_bound} |"
        )
    lines += [
        "",
        "mu is the mean pairwise cosine; eps = mu + 2 sigma, exact over all pairs of the measured rows "
        "(all rows, or `pair_rows` seeded rows with --sample; Gram matrix). "
        "Effective rank: exp of the Shannon entropy of the normalised singular values.",
        RANK_NOTE,
        "",
    ]
    return "\n".join(lines)


def plot_geometry(rows: list[GeometryRow], path: Path, x: str = "iteration") -> Path:
    """One panel per metric against `x` ("iteration" or "tokens"); a line per run and matrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4), squeeze=False)
    series: dict[tuple[str, str], list[GeometryRow]] = {}
    for r in rows:
        series.setdefault((r.run, r.matrix), []).append(r)
    runs = list(dict.fromkeys(r.run for r in rows))
    cmap = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20")
    colour = {run: cmap(i % cmap.N) for i, run in enumerate(runs)}  # a run's input and output share it
    for ax, metric in zip(axes[0], METRICS, strict=True):
        for (run, matrix), points in series.items():
            xs = [getattr(p, x) if getattr(p, x) is not None else p.iteration for p in points]
            ax.plot(
                xs,
                [getattr(p, metric) for p in points],
                marker="o",
                markersize=3,
                color=colour[run],
                linestyle="-" if matrix == "input" else "--",
                label=f"{run} {matrix}",
            )
        ax.set_title(metric)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_geometry(rows: list[GeometryRow], out_dir: str | Path, x: str = "iteration") -> dict[str, Path]:
    """geometry.md, geometry.csv, geometry.json and geometry.png under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"geometry.{kind}" for kind in ("md", "csv", "json", "png")}
    paths["md"].write_text(geometry_markdown(rows))
    fields = list(GeometryRow.__dataclass_fields__)
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    paths["json"].write_text(json.dumps({"rows": [asdict(r) for r in rows], "note": RANK_NOTE}, indent=1))
    plot_geometry(rows, paths["png"], x)
    return paths
