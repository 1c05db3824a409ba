"""Loss curves (tokens, loss) from TensorBoard event files or JSON/CSV, and tokens-to-target."""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_lev.errors import DataError

DEFAULT_TAGS = ("valid/loss", "train/loss")


@dataclass
class Curve:
    x: np.ndarray  # (n,) tokens (or steps, see x_label), increasing
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
        have = (
            f"it has {sorted(tags)}"
            if tags
            else "it holds no TensorBoard scalars (no event files, or a run that logged nothing yet)"
        )
        raise DataError(f"{path}: no scalar tag {tag or ' or '.join(DEFAULT_TAGS)}; {have}")
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
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a UTF-8 text file; give a JSON or CSV of (tokens, loss)") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}: not valid JSON ({exc}); expected {{'tokens': [...], 'loss': [...]}}"
            ) from None
        if isinstance(data, dict):
            if not isinstance(data.get("tokens"), list) or not isinstance(data.get("loss"), list):
                raise DataError(f"{path}: expected lists 'tokens' and 'loss', got keys {sorted(data)}")
            if len(data["tokens"]) != len(data["loss"]):
                raise DataError(
                    f"{path}: 'tokens' has {len(data['tokens'])} values but 'loss' has "
                    f"{len(data['loss'])}; they must pair up"
                )
            pairs = list(zip(data["tokens"], data["loss"]))
        else:
            pairs = data
    else:
        rows = [r for r in csv.reader(text.splitlines()) if r]
        if rows and not _is_number(rows[0][0]):
            head = [h.strip() for h in rows[0]]
            if "tokens" not in head or "loss" not in head:
                raise DataError(f"{path}: CSV header needs 'tokens' and 'loss' columns, got {head}")
            cols = (head.index("tokens"), head.index("loss"))
            short = next((i for i, r in enumerate(rows[1:], 2) if len(r) <= max(cols)), None)
            if short is not None:
                raise DataError(f"{path}: line {short} has too few columns")
            rows = [(r[cols[0]], r[cols[1]]) for r in rows[1:]]
        pairs = rows
    try:
        arr = np.asarray(pairs, dtype=np.float64)
    except (TypeError, ValueError):
        raise DataError(
            f"{path}: expected (tokens, loss) pairs of numbers, every row with two values"
        ) from None
    if arr.ndim != 2 or arr.shape[1] != 2 or len(arr) == 0:
        raise DataError(f"{path}: expected (tokens, loss) pairs, got shape {arr.shape}")
    return Curve(arr[:, 0], arr[:, 1], "tokens", str(path))


def read_curve(
    path: str | Path,
    tag: str | None = None,
    tokens_tag: str = "train/tokens",
    tokens_per_step: float | None = None,
) -> Curve:
    """A loss curve from a TensorBoard log dir / event file, or a JSON / CSV of (tokens, loss)."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"{path}: loss curve not found (give a TensorBoard log directory, or a JSON/CSV of "
            "(tokens, loss))"
        )
    if tokens_per_step is not None and not (math.isfinite(tokens_per_step) and tokens_per_step > 0):
        raise DataError(f"--tokens-per-step {tokens_per_step}: must be a finite number > 0")
    if path.suffix in (".json", ".csv"):
        curve = _from_table(path)
    else:
        curve = _from_tensorboard(path, tag, tokens_tag, tokens_per_step)
    if not len(curve.loss):
        raise DataError(
            f"{curve.source}: the loss curve is empty; the run logged no {tag or 'loss'} values yet"
        )
    bad = ~(np.isfinite(curve.x) & np.isfinite(curve.loss))
    if bad.all():
        raise DataError(
            f"{curve.source}: no finite (tokens, loss) point; the run diverged or the file is damaged"
        )
    if bad.any():  # e.g. a logging window whose steps were all skipped
        print(
            f"warning: {curve.source}: dropped {int(bad.sum())} of {len(bad)} points that are not finite",
            file=sys.stderr,
        )
        curve.x, curve.loss = curve.x[~bad], curve.loss[~bad]
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
