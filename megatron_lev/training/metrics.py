"""What a run reports: TensorBoard scalars, `metrics.jsonl`, and the throughput arithmetic.

`metrics.jsonl` has one JSON object a line, `{"kind": "train" | "valid" | "event", "iteration": ...}`;
the evaluation and comparison tools read it. Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"


def throughput(
    tokens: int, seconds: float, flops_per_token: float | None, n_devices: int, peak_tflops: float
) -> dict[str, float]:
    """tokens/s (whole job), TFLOP/s per device and MFU against `peak_tflops` per device."""
    out = {"tokens_per_s": tokens / seconds if seconds > 0 else 0.0}
    if flops_per_token:
        tflops = out["tokens_per_s"] * flops_per_token / n_devices / 1e12
        out["tflops_per_device"] = tflops
        out["mfu"] = tflops / peak_tflops
    return out


def memory_stats() -> dict[str, float]:
    """Peak accelerator memory in GiB since the last call (CPU: resident set size)."""
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return {"mem_peak_gib": peak}
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return {"mem_rss_gib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30}
    except (OSError, ValueError):
        return {}


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


class MetricsWriter:
    """Appends to `output_dir/metrics.jsonl` and writes TensorBoard scalars; a no-op off rank 0."""

    def __init__(self, output_dir: str | os.PathLike, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / METRICS_FILE
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))

    def record(self, kind: str, iteration: int, values: dict[str, Any], tokens: int | None = None) -> None:
        """One line in metrics.jsonl; every number also as `kind/name` in TensorBoard at `iteration`."""
        if not self.enabled:
            return
        row = {
            "kind": kind,
            "iteration": iteration,
            **({"tokens": tokens} if tokens is not None else {}),
            **values,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=float) + "\n")
            f.flush()
        if self._tb is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{kind}/{name}", value, iteration)
            if tokens is not None and "loss" in values:
                self._tb.add_scalar(f"{kind}/loss_vs_tokens", values["loss"], tokens)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl (optionally one kind); a torn last line (killed writer) is ignored."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if kind is None or row.get("kind") == kind:
            rows.append(row)
    return rows
