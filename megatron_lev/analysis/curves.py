"""Loss curves (tokens, loss) from TensorBoard event files or JSON/CSV, and tokens-to-target."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_TAGS = ("valid/loss", "train/loss")


@dataclass
class Curve:
    x: np.ndarray     # (n,) tokens (or steps, see x_label), increasing
    loss: np.ndarray  # (n,)
    x_label: str
    source: str


def _from_tensorboard(path: Path, tag: str | None, tokens_tag: str, tokens_per_step: float | None) -> Curve:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    tag = tag or next((t for t in DEFAULT_TAGS if t in tags), None)
    if tag not in tags:
        raise ValueError(f"{path}: no scalar tag {tag or ' or '.join(DEFAULT_TAGS)}; it has {sorted(tags)}")
    events = acc.Scalars(tag)
    steps = np.array([e.step for e in events], dtype=np.float64)
    loss = np.array([e.value for e in events], dtype=np.float64)
    if tokens_tag in tags:
        tok = acc.Scalars(tokens_tag)
        x = np.interp(steps, [e.step for e in tok], [e.value for e in tok])
        label = "tokens"
    elif tokens_per_step:
        x, label = steps * tokens_per_step, "tokens"
    else:
        x, label = steps, "steps"
    return Curve(x, loss, label, f"{path}:{tag}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _from_table(path: Path) -> Curve:
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        pairs = list(zip(data["tokens"], data["loss"])) if isinstance(data, dict) else data
    else:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if rows and not _is_number(rows[0][0]):
            head = [h.strip() for h in rows[0]]
            if "tokens" not in head or "loss" not in head:
                raise ValueError(f"{path}: CSV header needs 'tokens' and 'loss' columns, got {head}")
            rows = [(r[head.index("tokens")], r[head.index("loss")]) for r in rows[1:]]
        pairs = rows
    arr = np.asarray(pairs, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 2 or len(arr) == 0:
        raise ValueError(f"{path}: expected (tokens, loss) pairs, got shape {arr.shape}")
    return Curve(arr[:, 0], arr[:, 1], "tokens", str(path))


def read_curve(path: str | Path, tag: str | None = None, tokens_tag: str = "train/tokens",
               tokens_per_step: float | None = None) -> Curve:
    """A loss curve from a TensorBoard log dir / event file, or a JSON / CSV of (tokens, loss)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: loss curve not found")
    if path.suffix in (".json", ".csv"):
        curve = _from_table(path)
    else:
        curve = _from_tensorboard(path, tag, tokens_tag, tokens_per_step)
    order = np.argsort(curve.x, kind="stable")
    curve.x, curve.loss = curve.x[order], curve.loss[order]
    return curve


def tokens_to_target(curve: Curve, target: float) -> float | None:
    """First x where the loss reaches `target`, linearly interpolated; None if it never does."""
    hit = np.nonzero(curve.loss <= target)[0]
    if not len(hit):
        return None
    i = int(hit[0])
    if i == 0:
        return float(curve.x[0])
    x0, x1, y0, y1 = curve.x[i - 1], curve.x[i], curve.loss[i - 1], curve.loss[i]
    return float(x0 + (y0 - target) / (y0 - y1) * (x1 - x0))
