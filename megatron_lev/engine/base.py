"""`Engine`: what the loop, the checkpointer and resharding ask of an engine (OLMo-core's `TrainModule`,
as a Protocol).

`DeepSpeedEngine` (`engine/deepspeed_engine.py`) is the one implementation; a second engine (e.g.
FSDP) implements the same members and nothing outside `engine/` changes. Everything returned as a
tensor stays on the device: the caller decides when the host reads it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

GROUP_PREFIX = "group/"  # StepMeasurement.names: a parameter group, not a tensor


@dataclass
class StepMeasurement:
    """Norms of one optimizer step, of the full tensors (summed over every rank that holds a part of
    one, each part counted once), the same on every rank. Float64 device tensors `(len(names),)`:
    the parameter groups first (`group/<name>`, over all their parameters on every pipeline stage),
    then the measured tensors by canonical name (`embedding.delta`, ...).

    `grad`: the gradient the optimizer received (reduced over data-parallel ranks, unscaled, before
    clipping); `weight`: the weights before the step (the optimizer's fp32 master where it keeps one);
    `update`: `|w_after - w_before|`.
    """

    names: tuple[str, ...]
    grad: torch.Tensor
    weight: torch.Tensor
    update: torch.Tensor


@runtime_checkable
class Engine(Protocol):
    """An engine runs optimizer steps and writes and reads its checkpoint files.

    `train_batch` returns a `StepOutput`-like object with `loss` (device `()`), `skipped` (host bool:
    the update was held back), `scaler_overflow` (host bool), `grad_norm` (device `()` or None: the
    norm clipping used) and `clip` (device: the clip groups' norms then factors, or None).
    """

    @property
    def module(self) -> nn.Module:
        """This rank's model (the whole model, or the stages of a pipeline it holds)."""
        ...

    @property
    def global_steps(self) -> int:
        """The optimizer steps taken (what the engine writes into its checkpoint)."""
        ...

    @global_steps.setter
    def global_steps(self, value: int) -> None: ...

    def train_batch(self, batches: Iterator) -> Any:
        """One optimizer step over one global batch of micro-batches from `batches`."""
        ...

    def eval_batch(self, batches: Iterator) -> torch.Tensor:
        """The mean loss `()` of one global batch (no update); StopIteration when `batches` runs out."""
        ...

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean per-token loss of one batch `(B, S)` without a step (every rank gets it)."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def train(self) -> None: ...

    def eval(self) -> None: ...

    def weights_finite(self) -> torch.Tensor:
        """A device bool `()`: every weight this rank's optimizer updates is finite (no host read)."""
        ...

    def weights_squared_norm(self) -> torch.Tensor:
        """A device float32 `()`: the sum of squares of the weights this rank's optimizer updates (no
        host read); the trainer compares it before and after a step (`train.max_update_ratio`)."""
        ...

    def owned_files(self) -> tuple[str, ...]:
        """Names the engine writes into a save directory beside the checkpoint tags."""
        ...

    def save(self, root: str | os.PathLike, tag: str, client_state: dict[str, Any]) -> None:
        """Collective: this rank's files of checkpoint `root/tag`."""
        ...

    def load(self, root: str | os.PathLike, tag: str) -> dict[str, Any]:
        """Collective: model and optimizer from `root/tag`; returns the client state."""
        ...

    def measure_next_step(self, prefixes: Sequence[str]) -> None:
        """Measure the next `train_batch`'s optimizer step: per parameter group and per tensor whose
        canonical name starts with one of `prefixes`. Every rank must ask for the same steps (the
        measurement ends in one all-reduce); a step not asked for costs nothing."""
        ...

    def step_measurement(self) -> StepMeasurement | None:
        """The measurement of the last step asked for (None when none was taken)."""
        ...

    def clip_record(self) -> Any:
        """The last step's clipping (`engine.clipping.ClipRecord`: norms and factors by clip group, device
        tensors), None before the first step. `train_batch`'s output carries the same as `clip`."""
        ...

    def full_parameters(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which `module`'s parameters are whole on this rank (ZeRO-3 gathers them;
        collective over the data-parallel group), for running a part of the model outside a step."""
        ...

    def load_optimizer_moments(
        self, shards: dict[torch.nn.Parameter, dict[str, torch.Tensor]], step: torch.Tensor
    ) -> None:
        """Set this rank's Adam moments (`exp_avg`, `exp_avg_sq`, optionally `master`) per parameter."""
        ...


__all__ = ["GROUP_PREFIX", "Engine", "StepMeasurement"]
