"""`ParallelLayout`: the run's tensor (TP), pipeline (PP) and data (DP) parallel layout, as a value.

Rank order matches DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model; model
fastest): `rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank`. So a TP group is TP consecutive
ranks (one node, fast links), DP groups stride TP, PP groups stride DP * TP.

A layout is passed, never looked up: `parallel.state.initialize_model_parallel(tp, pp)` creates the
process groups and returns this rank's layout, and the run hands it to the model (the TP layers keep
it), the engine, the data loaders and the callbacks. Code that runs without process groups (the
run plan, converters, tests) makes one from sizes alone (`single()`, `from_sizes(...)`): it names
shards and shapes exactly as the real one does, and refuses any collective when a size is above 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lev.errors import ConfigError


class ParallelLayoutError(ConfigError):
    """The world size does not factor into TP x PP x DP, or a sizes-only layout was asked for a group."""


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    """The global rank at these coordinates (see the module doc)."""
    return pp_rank * dp * tp + dp_rank * tp + tp_rank


def data_parallel_size(world_size: int, tp: int, pp: int) -> int:
    """Validate `world = TP x PP x DP`; return DP. The one statement of the rule (the plan's checks,
    the DeepSpeed JSON's batch, a resume's batch and the layout itself use it)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ParallelLayoutError(
            f"world size {world_size!r} is out of range: must be an integer >= 1 (the number of processes)"
        )
    if tp < 1 or pp < 1:
        raise ParallelLayoutError(f"tensor ({tp}) and pipeline ({pp}) parallel sizes must be >= 1")
    if world_size % (tp * pp):
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size = {tp} x {pp}; "
            "world = TP x PP x DP: change parallel.tensor_model_parallel_size, "
            "parallel.pipeline_model_parallel_size, or the number of processes"
        )
    return world_size // (tp * pp)


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's four groups: TP, PP, DP, and model-parallel (TP x PP, one replica)."""

    tp: object
    pp: object
    dp: object
    mp: object


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes, this rank's coordinates and rank tuples, and (when created by `initialize_model_parallel`)
    its process groups. Frozen: nothing changes it after it is made."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    tp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's TP group, in TP-rank order
    pp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)
    groups: ProcessGroups | None = None  # None: a sizes-only layout (names and shapes, no collectives)

    @classmethod
    def single(cls) -> ParallelLayout:
        """One process: TP = PP = DP = 1, no groups needed."""
        return cls()

    @classmethod
    def from_sizes(
        cls, tp: int = 1, pp: int = 1, dp: int = 1, rank: int = 0, groups: ProcessGroups | None = None
    ) -> ParallelLayout:
        """The layout of global `rank` in a TP x PP x DP world (sizes only unless `groups` are given)."""
        data_parallel_size(tp * pp * dp, tp, pp)  # checks the sizes are >= 1
        if dp < 1 or not 0 <= rank < tp * pp * dp:
            raise ParallelLayoutError(f"rank {rank} is outside a world of TP {tp} x PP {pp} x DP {dp}")
        tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        return cls(
            tp=tp,
            pp=pp,
            dp=dp,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            dp_rank=dp_rank,
            tp_ranks=tuple(rank_of(pp_rank, dp_rank, t, tp, dp) for t in range(tp)),
            pp_ranks=tuple(rank_of(p, dp_rank, tp_rank, tp, dp) for p in range(pp)),
            dp_ranks=tuple(rank_of(pp_rank, d, tp_rank, tp, dp) for d in range(dp)),
            groups=groups,
        )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return rank_of(self.pp_rank, self.dp_rank, self.tp_rank, self.tp, self.dp)

    @property
    def has_groups(self) -> bool:
        return self.groups is not None

    def _group(self, axis: str, size: int):
        if self.groups is not None:
            return getattr(self.groups, axis)
        if size == 1:
            return None  # nothing to communicate with
        raise ParallelLayoutError(
            f"this ParallelLayout (TP {self.tp}, PP {self.pp}, DP {self.dp}) was made from sizes alone and "
            f"has no {axis.upper()} process group: it names shards but cannot run collectives; pass the "
            "layout parallel.state.initialize_model_parallel(tp, pp) returned"
        )

    @property
    def tp_group(self):
        return self._group("tp", self.tp)

    @property
    def pp_group(self):
        return self._group("pp", self.pp)

    @property
    def dp_group(self):
        return self._group("dp", self.dp)

    @property
    def mp_group(self):
        """All model-parallel ranks of this replica (TP x PP)."""
        return self._group("mp", self.tp * self.pp)

    def __deepcopy__(self, memo) -> ParallelLayout:
        return self  # immutable, and process groups are handles, not data: a model's deep copy shares it

    def __repr__(self) -> str:
        where = f"tp_rank={self.tp_rank}, pp_rank={self.pp_rank}, dp_rank={self.dp_rank}"
        kind = "groups" if self.groups is not None else "sizes only"
        return f"ParallelLayout(tp={self.tp}, pp={self.pp}, dp={self.dp}, {where}, {kind})"


SINGLE = ParallelLayout.single()

__all__ = [
    "SINGLE",
    "ParallelLayout",
    "ParallelLayoutError",
    "ProcessGroups",
    "data_parallel_size",
    "rank_of",
]
