"""Reproducible randomness under tensor parallelism.

Two streams, as in Megatron:
- the *default* torch RNG is seeded identically on every TP rank, so replicated
  work (and `init_sharded_`, which draws full tensors) is the same everywhere and
  TP = N initialises exactly like TP = 1;
- a *model-parallel* stream, seeded `seed + 2718 + tp_rank`, is used (via
  `rng.fork()`) for randomness that must differ between TP ranks, e.g. dropout on a
  rank's own attention heads.
`fork()` swaps the CPU generator, and the current CUDA device's when CUDA is in use.

The model-parallel stream belongs to the model: `engine.build_model` makes one tracker per model
(`tp_rng_tracker`), hands it to every attention module and to the recompute wrapper, and leaves it
on the model as `model.rng`, where a checkpoint saves and restores it. No tracker is process-wide.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_lev.parallel.layout import ParallelLayout

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if _cuda() else None)


def _set_state(states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None and _cuda():
        torch.cuda.set_rng_state(cuda)


class RNGStatesTracker:
    """Named RNG states that code can temporarily switch to with `fork(name)`."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.seeds: set[int] = set()

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        if seed in self.seeds:
            raise ValueError(f"seed {seed} is already used by another RNG state")
        # the states `torch.manual_seed(seed)` would give the default generators, made on private ones so
        # that no generator of the process is touched (all CUDA devices' included)
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = torch.Generator(device="cuda").manual_seed(seed).get_state() if _cuda() else None
        self.states[name] = (cpu, cuda)
        self.seeds.add(seed)

    def get_states(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """A copy of every named state (for checkpoints)."""
        return {k: (c.clone(), g.clone() if g is not None else None) for k, (c, g) in self.states.items()}

    def set_states(self, states: dict) -> None:
        self.states = dict(states)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on the named stream; the default stream is left untouched."""
        if name not in self.states:
            raise KeyError(
                f"RNG state {name!r} was not added; make the tracker with tp_rng_tracker(seed, layout)"
            )
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


def tp_rng_tracker(seed: int, layout: ParallelLayout) -> RNGStatesTracker:
    """A tracker holding this TP rank's model-parallel stream (`seed + 2718 + layout.tp_rank`); the
    default streams are left as they are."""
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + layout.tp_rank)
    return tracker


def manual_seed(seed: int) -> None:
    """Seed the default streams (CPU, and CUDA when present) with `seed`: the same on every TP rank."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the default CPU stream seeded to `seed`, restoring it afterwards.

    Used to initialise each layer from its own seed, so a layer's weights do not depend
    on which pipeline stage builds it.
    """
    saved = torch.get_rng_state()
    torch.random.default_generator.manual_seed(seed)  # CPU only: parameters are initialised on CPU
    try:
        yield
    finally:
        torch.set_rng_state(saved)
