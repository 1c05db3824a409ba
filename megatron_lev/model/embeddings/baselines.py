"""The five baseline input embeddings of the paper's comparison (spec: LEV.md, "Baselines").

tied / untied: a dense vocab-parallel `V x D` table (tied shares it with the head).
albert: `V x e` table then a linear `e -> D`. flat_mlp: `V x e` table then an MLP
`e -> hidden -> D`. factorized_mlp: LEV's codebook seed `z(i)` then an MLP
`d_seed -> hidden -> D`. Widths not set in the config are matched to LEV's count
(each class's `widths`). The compressed variants run their projection only on
the unique ids of the batch. Small projections/MLPs are replicated across TP ranks;
the tables are vocab-parallel. No biases, like the transformer blocks.
"""

from __future__ import annotations

import abc
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.config import LevConfig, ModelConfig
from megatron_lev.errors import ConfigError
from megatron_lev.model.embeddings.base import InputEmbedding, check_token_ids
from megatron_lev.model.embeddings.lev import Codebooks, digit_base
from megatron_lev.model.embeddings.sizing import albert_count, lev_parameter_count, mlp_count
from megatron_lev.parallel.layers import VocabParallelEmbedding
from megatron_lev.parallel.layout import SINGLE, ParallelLayout


class DenseEmbedding(InputEmbedding):
    """A dense vocab-parallel `V x D` table; `tied=True` lets the output head reuse it."""

    dense_table = True
    output_parameters = ("table.weight",)  # equal-scale init (`InputEmbedding.rescale_output_`)

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        init_std: float = 0.02,
        tied: bool = False,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ):
        super().__init__()
        self.vocab_size, self.hidden_size, self.tied = vocab_size, hidden_size, tied
        self.base_vocab = base_vocab
        self.table = VocabParallelEmbedding(
            vocab_size, hidden_size, init_std=init_std, layout=layout, init_rows=base_vocab
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, D)
        check_token_ids(input_ids, self.vocab_size)
        return self.table(input_ids)

    def tied_output_weight(self) -> nn.Parameter | None:
        return self.table.weight if self.tied else None

    @torch.no_grad()
    def sample_rows(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, D)
        return self.table(ids)

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        vocab_size: int,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ) -> DenseEmbedding:
        """The subclass's table; the head reuses it when the class `ties_output_head`."""
        return cls(
            vocab_size,
            model_cfg.hidden_size,
            model_cfg.init_std,
            tied=cls.ties_output_head,
            layout=layout,
            base_vocab=base_vocab,
        )

    @classmethod
    def parameter_count(cls, model_cfg: ModelConfig, vocab_size: int) -> int:
        return vocab_size * model_cfg.hidden_size


class TiedEmbedding(DenseEmbedding):
    """`tied`: the dense table, shared with the output head."""

    name, label, ties_output_head = "tied", "TIED", True


class UntiedEmbedding(DenseEmbedding):
    """`untied`: the dense table; the head has its own."""

    name, label = "untied", "UNTIED"


def _linear(fan_in: int, fan_out: int, init_std: float) -> nn.Linear:
    layer = nn.Linear(fan_in, fan_out, bias=False)
    nn.init.normal_(layer.weight, 0.0, init_std)
    return layer


class _CompressedEmbedding(InputEmbedding):
    """A small per-token code (table row or seed) then a projection, run once per unique id."""

    # what `(e, hidden)` of `widths` are, for messages ("" where there is no such width)
    width_names: tuple[str, str] = ("table width e (model.baseline_dim)", "")

    @classmethod
    @abc.abstractmethod
    def widths(cls, model_cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        """`(e, hidden)`: the code width and the MLP hidden width (0 without an MLP); the ones
        not set in the config (`model.baseline_dim`, `model.baseline_hidden`) match LEV's count."""

    @classmethod
    def narrow_widths(cls, model_cfg: ModelConfig, vocab_size: int) -> list[tuple[str, int]]:
        """`(what, width)` of every width below `model.min_compressed_width` at the padded `vocab_size`."""
        least = model_cfg.min_compressed_width
        return [
            (what, width)
            for what, width in zip(cls.width_names, cls.widths(model_cfg, vocab_size))
            if what and width < least
        ]

    @classmethod
    def check_vocab(cls, model_cfg: ModelConfig, vocab_size: int) -> None:
        """Refuse a width below `model.min_compressed_width`: a degenerate bottleneck (e = 1) makes the
        comparison meaningless. The message names the variant, the width and the LEV size that fits."""
        narrow = cls.narrow_widths(model_cfg, vocab_size)
        if not narrow:
            return
        what, width = narrow[0]
        least = model_cfg.min_compressed_width
        lev = lev_parameter_count(vocab_size, model_cfg.hidden_size, model_cfg.lev)
        raise ConfigError(
            f"model.embedding={cls.name}: its {what} is {width}, below model.min_compressed_width={least} "
            f"(LEV has {lev:,} parameters at the padded vocabulary {vocab_size:,} and "
            f"model.hidden_size={model_cfg.hidden_size}); {cls._what_fits(model_cfg, vocab_size, what)}, "
            "or lower model.min_compressed_width"
        )

    @classmethod
    def _what_fits(cls, model_cfg: ModelConfig, vocab_size: int, what: str, max_factor: int = 256) -> str:
        """What would fit: a larger width set in the config, or the smallest `model.lev.heads` (LEV's
        count, which the other widths match, is linear in it) at which every width fits."""
        lev, least = model_cfg.lev, model_cfg.min_compressed_width
        for key, value in (
            ("model.lev.d_seed", lev.d_seed),
            ("model.baseline_dim", model_cfg.baseline_dim),
            ("model.baseline_hidden", model_cfg.baseline_hidden),
        ):
            if key in what and value is not None:
                return f"set {key} to at least {least}"
        for heads in range(lev.heads + 1, lev.heads * max_factor + 1):
            wider = dataclasses.replace(model_cfg, lev=dataclasses.replace(lev, heads=heads))
            if not cls.narrow_widths(wider, vocab_size):
                count = lev_parameter_count(vocab_size, model_cfg.hidden_size, wider.lev)
                return (
                    f"it fits with model.lev.heads={heads} or more (now {lev.heads}; LEV then has "
                    f"{count:,} parameters), or a smaller vocabulary"
                )
        return (
            f"no model.lev.heads up to {lev.heads * max_factor} fits: set model.baseline_dim / "
            f"model.baseline_hidden to at least {model_cfg.min_compressed_width}"
        )

    @abc.abstractmethod
    def code(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) -> (N, e)
        """The per-token code: a table row or the codebook seed."""

    @abc.abstractmethod
    def project(self, code: torch.Tensor) -> torch.Tensor:  # (N, e) -> (N, D)
        """The projection to the model width."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, D)
        check_token_ids(input_ids, self.vocab_size)
        unique, inverse = torch.unique(input_ids.reshape(-1), return_inverse=True)
        return self.project(self.code(unique))[inverse].view(*input_ids.shape, self.hidden_size)

    @torch.no_grad()
    def sample_rows(self, ids: torch.Tensor) -> torch.Tensor:  # (N,) distinct ids -> (N, D)
        return self.project(self.code(ids))


class AlbertEmbedding(_CompressedEmbedding):
    """`albert`: a vocab-parallel `V x e` table then a linear `e -> D` (linear compression)."""

    name, label = "albert", "ALBERT"
    output_parameters = ("proj.weight",)

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dim: int,
        init_std: float = 0.02,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ):
        super().__init__()
        self.vocab_size, self.hidden_size, self.dim = vocab_size, hidden_size, dim
        self.base_vocab = base_vocab
        self.table = VocabParallelEmbedding(
            vocab_size, dim, init_std=init_std, layout=layout, init_rows=base_vocab
        )
        self.proj = _linear(dim, hidden_size, init_std)

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        vocab_size: int,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ) -> AlbertEmbedding:
        dim, _ = cls.widths(model_cfg, base_vocab or vocab_size)
        return cls(vocab_size, model_cfg.hidden_size, dim, model_cfg.init_std, layout, base_vocab)

    @classmethod
    def widths(cls, model_cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        target = lev_parameter_count(vocab_size, model_cfg.hidden_size, model_cfg.lev)
        return model_cfg.baseline_dim or max(1, round(target / (vocab_size + model_cfg.hidden_size))), 0

    @classmethod
    def parameter_count(cls, model_cfg: ModelConfig, vocab_size: int) -> int:
        return albert_count(vocab_size, model_cfg.hidden_size, cls.widths(model_cfg, vocab_size)[0])

    def code(self, ids):
        return self.table(ids)

    def project(self, code):
        return self.proj(code)


class _MlpHead(nn.Module):
    """`e -> hidden -> D` with a GELU between, no biases."""

    def __init__(self, dim: int, hidden: int, hidden_size: int, init_std: float):
        super().__init__()
        self.up, self.down = _linear(dim, hidden, init_std), _linear(hidden, hidden_size, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, e) -> (N, D)
        return self.down(F.gelu(self.up(x)))


class FlatMlpEmbedding(_CompressedEmbedding):
    """`flat_mlp`: a vocab-parallel `V x e` table then an MLP (adds non-linearity)."""

    name, label = "flat_mlp", "FLAT-MLP"
    width_names = ("table width e (model.baseline_dim)", "MLP hidden width (model.baseline_hidden)")
    output_parameters = ("mlp.down.weight",)

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dim: int,
        hidden: int,
        init_std: float = 0.02,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ):
        super().__init__()
        self.vocab_size, self.hidden_size, self.dim, self.hidden = vocab_size, hidden_size, dim, hidden
        self.base_vocab = base_vocab
        self.table = VocabParallelEmbedding(
            vocab_size, dim, init_std=init_std, layout=layout, init_rows=base_vocab
        )
        self.mlp = _MlpHead(dim, hidden, hidden_size, init_std)

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        vocab_size: int,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ) -> FlatMlpEmbedding:
        dim, hidden = cls.widths(model_cfg, base_vocab or vocab_size)
        return cls(vocab_size, model_cfg.hidden_size, dim, hidden, model_cfg.init_std, layout, base_vocab)

    @classmethod
    def widths(cls, model_cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        """e defaults to the table taking about half of LEV's budget; hidden takes the rest."""
        V, D = vocab_size, model_cfg.hidden_size
        target = lev_parameter_count(V, D, model_cfg.lev)
        dim = model_cfg.baseline_dim or max(1, target // (2 * V))
        return dim, model_cfg.baseline_hidden or max(1, round((target - V * dim) / (dim + D)))

    @classmethod
    def parameter_count(cls, model_cfg: ModelConfig, vocab_size: int) -> int:
        return mlp_count(vocab_size, *cls.widths(model_cfg, vocab_size), model_cfg.hidden_size)

    def code(self, ids):
        return self.table(ids)

    def project(self, code):
        return self.mlp(code)


class FactorizedMlpEmbedding(_CompressedEmbedding):
    """`factorized_mlp`: LEV's compositional codebook seed `z(i)` then an MLP `d_seed -> hidden -> D`."""

    name, label = "factorized_mlp", "FACT-MLP"
    width_names = ("seed width e (model.lev.d_seed)", "MLP hidden width (model.baseline_hidden)")
    output_parameters = ("mlp.down.weight",)

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        k: int,
        d_seed: int,
        hidden: int,
        init_std: float = 0.02,
        lev: LevConfig | None = None,
    ):
        super().__init__()
        self.vocab_size, self.hidden_size, self.hidden = vocab_size, hidden_size, hidden
        # replicated; LEV's token-id order (`lev.id_order`) too, so the seed z(i) is LEV's
        self.codebooks = Codebooks(vocab_size, k, d_seed, init_std, lev)
        self.mlp = _MlpHead(d_seed, hidden, hidden_size, init_std)

    @classmethod
    def from_config(
        cls,
        model_cfg: ModelConfig,
        vocab_size: int,
        layout: ParallelLayout = SINGLE,
        base_vocab: int | None = None,
    ) -> FactorizedMlpEmbedding:
        vocab_size = base_vocab or vocab_size  # replicated: its ids live in the one-process vocabulary
        _, hidden = cls.widths(model_cfg, vocab_size)
        lev = model_cfg.lev
        return cls(vocab_size, model_cfg.hidden_size, lev.k, lev.d_seed, hidden, model_cfg.init_std, lev)

    @classmethod
    def widths(cls, model_cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
        """e is LEV's seed width `lev.d_seed` (not configurable); hidden takes the rest of the budget."""
        lev, D = model_cfg.lev, model_cfg.hidden_size
        target = lev_parameter_count(vocab_size, D, lev)
        rows = cls._codebook_rows(model_cfg, vocab_size)
        return lev.d_seed, model_cfg.baseline_hidden or max(
            1, round((target - rows * lev.d_seed) / (lev.d_seed + D))
        )

    @classmethod
    def parameter_count(cls, model_cfg: ModelConfig, vocab_size: int) -> int:
        rows = cls._codebook_rows(model_cfg, vocab_size)
        return mlp_count(rows, *cls.widths(model_cfg, vocab_size), model_cfg.hidden_size)

    @staticmethod
    def _codebook_rows(model_cfg: ModelConfig, vocab_size: int) -> int:
        return model_cfg.lev.k * digit_base(vocab_size, model_cfg.lev.k)

    def code(self, ids):
        return self.codebooks(ids)

    def project(self, code):
        return self.mlp(code)
