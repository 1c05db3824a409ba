"""The one interface every input-embedding variant implements.

An `InputEmbedding` maps token ids `(B, S)` to hidden states `(B, S, D)` — the
full width `D` on every tensor-parallel rank — and can `materialize()` its dense
`(V, D)` table (for export, evaluation and the capacity analysis).

The class is the single description of a variant: its config name (`name`), the
paper's name (`label`), whether the output head reuses its table
(`ties_output_head`, then `tied_output_weight()` returns it), whether its input
table is a dense `(V, D)` `table.weight` (`dense_table`), how to build it
(`from_config`) and how many parameters it has (`parameter_count`). Everything
else (the model, the pipeline, checkpoints, sizing, the grid) asks the class.

Its rules on the run config are classmethods too, asked by `plan`: `check_config` and
`check_vocab`; the optimizer rules and clip groups its own keys imply (`param_group_rules`,
`clip_group_rules`, named in `implied_clip_groups`), put before `train.param_groups` /
`train.clip_groups`; and `check_group_rules`, which refuses a config rule that takes a parameter
one of them sets. The config package knows none of a variant's rules.

Equal-scale initialisation (`model.input_init_rms`): a variant names the parameters of its
final linear map in `output_parameters` (its output is linear in them taken together), and
`rescale_output_` multiplies them so that the output RMS over the vocabulary (`output_rms`)
equals the target. Nothing new is stored: checkpoints and exports are unchanged.

Adding a variant: subclass `InputEmbedding` in one file of this package and add
one line to `REGISTRY` in `megatron_lev/model/embeddings/__init__.py`.
"""

from __future__ import annotations

import abc
import math

import torch
from torch import nn

from megatron_lev.config import ClipGroupRule, ModelConfig, ParamGroupRule, RunConfig
from megatron_lev.errors import ConfigError
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.utils.tensors import check_token_ids  # noqa: F401 (part of the embedding interface)

RMS_SAMPLE_IDS = 65536  # larger vocabularies: `output_rms` averages over this many fixed-seed ids
RMS_SAMPLE_SEED = 0


class InputEmbedding(nn.Module, abc.ABC):
    """Token ids -> `(B, S, D)`; see the module docstring."""

    name: str  # the value of `model.embedding`
    label: str  # the paper's name of the variant (tables, plots, grid runs)
    ties_output_head: bool = False  # the output head reuses this table (`tied_output_weight()`)
    dense_table: bool = False  # the input table is a dense `(V, D)` `table.weight`, exported as is

    # dotted names of the final linear map's parameters (absent ones are skipped): the output is
    # linear in them taken together, so scaling them all by c scales the output by c
    output_parameters: tuple[str, ...] = ()

    vocab_size: int
    hidden_size: int
    # a vocab-parallel table's rows padded as for one process (None: `vocab_size`): `output_rms`
    # measures these, so the padding a larger TP size adds changes no scale
    base_vocab: int | None = None

    @classmethod
    @abc.abstractmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        vocab_size: int,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ) -> InputEmbedding:
        """Build the variant for the (padded) `vocab_size` from `model_cfg`, sharded over `layout`.

        `base_vocab` (default `vocab_size`) is the vocabulary padded as for one process
        (`model.vocab.base_vocab_size`): a vocab-parallel table has `vocab_size` rows, but every
        width, digit base and id arithmetic derives from `base_vocab`, so TP changes no parameter."""

    @classmethod
    @abc.abstractmethod
    def parameter_count(cls, model_cfg: ModelConfig, vocab_size: int) -> int:
        """Parameters of this input embedding alone (the full model, summed over TP ranks)."""

    @classmethod
    def check_config(cls, model_cfg: ModelConfig, tensor_parallel: int) -> None:
        """Raise ConfigError, naming the keys, when this variant cannot run `model_cfg` at this TP size
        (`plan.validate_config` / `validate_run` call it once per run; the rule lives only here)."""

    @classmethod
    def check_vocab(cls, model_cfg: ModelConfig, vocab_size: int) -> None:
        """Raise ConfigError, naming the keys, when this variant cannot run `model_cfg` at the padded
        `vocab_size` (`plan` calls it once the vocabulary is known: from `model.vocab_size`
        when set, else from the tokenizer)."""

    # clip groups the variant's keys can imply, each with the key that implies it: no
    # train.clip_groups rule may take these names, whichever variant a config chooses
    implied_clip_groups: dict[str, str] = {}

    @classmethod
    def param_group_rules(cls, cfg: RunConfig) -> list[ParamGroupRule]:
        """Optimizer rules by parameter name that this variant's keys imply, put before
        `train.param_groups` (`plan.param_group_rules` asks; e.g. LEV's `seed_lr_mult`)."""
        return []

    @classmethod
    def clip_group_rules(cls, cfg: RunConfig) -> list[ClipGroupRule]:
        """Clip groups this variant's keys imply (named in `implied_clip_groups`), put before
        `train.clip_groups` (`plan.clip_group_rules` asks; e.g. LEV's `seed_clip_grad`)."""
        return []

    @classmethod
    def check_group_rules(cls, cfg: RunConfig) -> None:
        """Raise ConfigError when a `train.param_groups` or `train.clip_groups` rule takes a parameter
        one of this variant's implied rules sets (`plan` calls it with `check_config`)."""

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, D)
        """Embed `input_ids`; implementations call `check_token_ids` first."""

    @torch.no_grad()
    def materialize(self, chunk_size: int = 8192) -> torch.Tensor:
        """The dense `(V, D)` input table, computed in chunks without autograd.

        The default looks up every id in chunks; variants with a cheaper form override it.
        """
        device = next(self.parameters()).device
        rows = []
        for start in range(0, self.vocab_size, chunk_size):
            ids = torch.arange(start, min(start + chunk_size, self.vocab_size), device=device)
            rows.append(self.forward(ids.unsqueeze(0)).squeeze(0))
        return torch.cat(rows, dim=0)

    @torch.no_grad()
    def sample_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The input table's rows at `ids (N,)` (distinct, valid ids): `(N, D)`, the rows
        `materialize()` holds there, computed for these ids alone and without autograd.

        Under tensor parallelism it is collective (every TP rank calls it) and every rank gets the
        full rows, as `forward`. The training loop's dynamics measure a fixed sample of ids with it
        at every log line (`training.dynamics`). Variants with a cheaper per-id path override it.
        """
        return self.forward(ids.reshape(1, -1)).squeeze(0)

    def rms_ids(self) -> torch.Tensor:
        """The ids `output_rms` averages over: every id of the vocabulary padded for one process up to
        RMS_SAMPLE_IDS, else that many ids drawn without replacement with a fixed seed (the same
        ids on every rank and in every run)."""
        vocab = self.base_vocab or self.vocab_size
        if vocab <= RMS_SAMPLE_IDS:
            return torch.arange(vocab)
        gen = torch.Generator().manual_seed(RMS_SAMPLE_SEED)
        return torch.randperm(vocab, generator=gen)[:RMS_SAMPLE_IDS].sort().values

    @torch.no_grad()
    def output_rms(self, chunk_size: int = 8192) -> float:
        """RMS of the output over `rms_ids()` (float64 sums), the same value on every TP rank.

        It runs `forward`, which returns the full width on every rank, so under tensor parallelism
        it is collective (every TP rank must call it) and measures the full table, not a shard.
        """
        device = next(self.parameters()).device
        ids = self.rms_ids()
        total = 0.0
        for chunk in ids.split(chunk_size):
            out = self.forward(chunk.to(device).unsqueeze(0))
            total += float(out.double().square().sum())
        return math.sqrt(total / (len(ids) * self.hidden_size))

    @torch.no_grad()
    def rescale_output_(self, target: float) -> float | None:
        """Scale the `output_parameters` in place so that `output_rms()` equals `target`; returns the
        factor (None on the meta device, where there is nothing to measure, and when the module
        `awaits_checkpoint`, whose weights a checkpoint replaces). Collective under TP."""
        params = dict(self.named_parameters())
        names = [n for n in self.output_parameters if n in params]
        if not names:
            raise ConfigError(
                f"model.input_init_rms is set but model.embedding={self.name!r} names no final linear "
                "parameter to rescale (output_parameters); set model.input_init_rms: null"
            )
        if any(p.is_meta for p in params.values()) or self.awaits_checkpoint:
            return None
        rms = self.output_rms()
        if not (0.0 < rms < math.inf):
            raise ConfigError(
                f"model.input_init_rms: the {self.label} embedding's initial output RMS is {rms}, "
                "which cannot be rescaled"
            )
        factor = target / rms
        for name in names:
            params[name].mul_(factor)
        return factor

    @property
    def awaits_checkpoint(self) -> bool:
        """True when the module was built without something only a checkpoint supplies (a `frequency`
        token order whose counts file is not on this machine): it refuses to run until one is loaded."""
        return any(getattr(m, "order_pending", False) for m in self.modules())

    def tied_output_weight(self) -> nn.Parameter | None:
        """The (vocab-parallel) table the output head reuses when `ties_output_head`; else None."""
        return None


def find_input_embedding(model: nn.Module) -> InputEmbedding | None:
    """The first `InputEmbedding` among `model`'s modules (under a pipeline, the first stage's; the
    last stage may hold a tied copy), or None (a stage without one)."""
    return next((m for m in model.modules() if isinstance(m, InputEmbedding)), None)
