"""Adam's state of the output layer's rows, by how often each row's token was a training target
(`python -m studies rows runs/clip results/clip/raw`).

A row whose token never occurs in training gets only the softmax's push-down, `p_j * h`, whose size
falls as the row's logit falls. Adam divides each element's first moment by `sqrt(v) + eps`; once
`sqrt(v)` is near `eps` (1e-8), the step shrinks. A clip factor `f` scales `sqrt(v)` by `f`, so for
these rows (and only these) a constant factor does not cancel. This file measures, from a run's final
checkpoint, how near `eps` each band's rows are: per training-count band of the row's token (the
evaluation's bands, `analysis.perplexity.COUNT_EDGES`), the quantiles of `sqrt(v_hat)`, the median
share of `eps` in the denominator, the median size of Adam's step per element (`|m_hat| / (sqrt(v_hat)
+ eps)`, before the learning rate) and the median L2 norm of the rows.

The output layer is `output_head.weight` (LEV, UNTIED, ALBERT) or the tied table (TIED). Rows past
the tokenizer's vocabulary (the padding) are left out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_lev.analysis.perplexity import COUNT_EDGES, count_band_labels
from megatron_lev.errors import DataError
from megatron_lev.utils.io import atomic_write_json

FILE = "output_rows.json"  # in a run's raw directory
QUANTILES = (0.1, 0.5, 0.9)
HEAD, TABLE = "output_head.weight", "embedding.table.weight"


def band_stats(
    weight: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    counts: np.ndarray,
    step: int,
    eps: float,
    betas: tuple[float, float] = (0.9, 0.95),
) -> list[dict]:
    """One entry per training-count band: rows, sqrt(v_hat) quantiles, the median eps share, the median
    Adam step per element and the median row norm. `weight` and the moments are (rows, width) with at
    least `len(counts)` rows; only the first `len(counts)` (the tokenizer's ids) are read."""
    vocab = len(counts)
    if weight.shape[0] < vocab or exp_avg.shape != weight.shape or exp_avg_sq.shape != weight.shape:
        raise DataError(
            f"the output layer's shapes {weight.shape}, {exp_avg.shape}, {exp_avg_sq.shape} do not hold "
            f"the {vocab:,} ids the training counts have"
        )
    m_hat = exp_avg[:vocab] / (1 - betas[0] ** step)
    sqrt_v = np.sqrt(exp_avg_sq[:vocab] / (1 - betas[1] ** step))
    band = np.searchsorted(np.asarray(COUNT_EDGES), counts, side="right")
    out = []
    for b, label in enumerate(count_band_labels(COUNT_EDGES)):
        rows = np.nonzero(band == b)[0]
        if rows.size == 0:
            out.append({"band": label, "rows": 0})
            continue
        s = sqrt_v[rows].ravel()
        out.append(
            {
                "band": label,
                "rows": int(rows.size),
                "sqrt_v": {f"q{int(q * 100)}": float(np.quantile(s, q)) for q in QUANTILES},
                "eps_share_median": float(np.median(eps / (s + eps))),
                "adam_step_median": float(np.median(np.abs(m_hat[rows]).ravel() / (s + eps))),
                "row_norm_median": float(np.median(np.linalg.norm(weight[rows], axis=1))),
            }
        )
    return out


def adam_eps_of(cfg, name: str) -> float:
    """The `eps` AdamW used for parameter `name`: the first optimizer rule matching it
    (`plan.param_group_rules`) that sets one, else `train.adam_eps`."""
    from fnmatch import fnmatchcase

    from megatron_lev.plan import param_group_rules

    rule = next((r for r in param_group_rules(cfg) if fnmatchcase(name, r.pattern)), None)
    return float(rule.adam_eps if rule is not None and rule.adam_eps is not None else cfg.train.adam_eps)


def output_rows(path: Path, counts: np.ndarray, tag: str | None = None) -> dict:
    """The band statistics (`band_stats`) of a checkpoint (a save directory and `tag`, default its
    latest, or a tag directory), merged over its TP/PP/DP shards, with what they were read from."""
    from megatron_lev.convert.optimizer_state import read_optimizer_state
    from megatron_lev.convert.source import open_checkpoint

    src = open_checkpoint(path, tag, vocab_size=len(counts))
    tag_dir = src.tag_dir
    state = read_optimizer_state(src)
    name = HEAD if HEAD in state.moments else TABLE
    if name not in state.moments:
        raise DataError(f"{tag_dir}: neither {HEAD} nor {TABLE} has optimizer state")
    moments = state.moments[name]
    weight = state.master[name] if name in state.master else None
    if weight is None:
        raise DataError(f"{tag_dir}: no fp32 master weights of {name} (a ZeRO-1/2 checkpoint has them)")
    step = int(state.step)
    train = src.cfg.train
    eps, betas = adam_eps_of(src.cfg, name), (float(train.adam_beta1), float(train.adam_beta2))
    return {
        "tag": tag_dir.name,
        "step": step,
        "adam_eps": eps,
        "parameter": name,
        "bands": band_stats(
            weight.numpy(),
            moments["exp_avg"].numpy(),
            moments["exp_avg_sq"].numpy(),
            counts,
            step,
            eps,
            betas,
        ),
    }


def collect_rows(out: Path, raw: Path, tag: str | None = None, log=print) -> list[Path]:
    """`FILE` for every run of study directory `out` that has a raw directory in `raw` (it was
    collected) and a final checkpoint, from the training counts of `out/data`."""
    from megatron_lev.ckpt.layout import read_latest

    counts_path = Path(out) / "data" / "train_text_document.counts.npy"
    if not counts_path.is_file():
        raise DataError(f"{counts_path}: no training counts; give the study directory that `run` built")
    counts = np.load(counts_path)
    written = []
    for run_dir in sorted((Path(out) / "runs").iterdir()):
        dst = Path(raw) / run_dir.name
        root = run_dir / "checkpoints"
        if not dst.is_dir() or not root.is_dir():
            continue
        latest, problem = (None, None) if tag else read_latest(root)
        if problem:
            raise DataError(f"{run_dir.name}: {problem}; give --tag")
        if (tag or latest) is None:
            log(f"{run_dir.name}: no checkpoint, left out")
            continue
        rec = output_rows(root, counts, tag)
        atomic_write_json(dst / FILE, rec)
        log(f"{run_dir.name}: {rec['tag']}")
        written.append(dst / FILE)
    return written


__all__ = ["FILE", "band_stats", "collect_rows", "output_rows"]
