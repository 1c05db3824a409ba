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

Adding a variant: subclass `InputEmbedding` in one file of this package and add
one line to `REGISTRY` in `megatron_lev/model/embeddings/__init__.py`.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from megatron_lev.config import ModelConfig


class InputEmbedding(nn.Module, abc.ABC):
    """Token ids -> `(B, S, D)`; see the module docstring."""

    name: str  # the value of `model.embedding`
    label: str  # the paper's name of the variant (tables, plots, grid runs)
    ties_output_head: bool = False  # the output head reuses this table (`tied_output_weight()`)
    dense_table: bool = False  # the input table is a dense `(V, D)` `table.weight`, exported as is

    vocab_size: int
    hidden_size: int

    @classmethod
    @abc.abstractmethod
    def from_config(cls, model_cfg: ModelConfig, vocab_size: int) -> InputEmbedding:
        """Build the variant for the (padded) `vocab_size` from `model_cfg`."""

    @classmethod
    @abc.abstractmethod
    def parameter_count(cls, model_cfg: ModelConfig, vocab_size: int) -> int:
        """Parameters of this input embedding alone (the full model, summed over TP ranks)."""

    @classmethod
    def check_config(cls, model_cfg: ModelConfig, tensor_parallel: int) -> None:
        """Raise ConfigError, naming the keys, when this variant cannot run `model_cfg` at this TP size
        (`RunConfig.validate` calls it; the rule lives only here)."""

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

    def tied_output_weight(self) -> nn.Parameter | None:
        """The (vocab-parallel) table the output head reuses when `ties_output_head`; else None."""
        return None


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse ids outside [0, vocab_size) (instead of a silent wrong row), without a host sync.

    Host tensors: an IndexError naming the id. Device tensors: a device-side assert, which
    does not make the host wait; the training loader has already checked every batch on
    the host (`training.batches.token_batches`), so there it is a backstop.
    """
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"token ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.numel() == 0:
        return
    if input_ids.device.type != "cpu":
        inside = ((input_ids >= 0) & (input_ids < vocab_size)).all()
        torch._assert_async(inside, f"a token id is outside the vocabulary [0, {vocab_size})")
        return
    ids = input_ids.detach().numpy()  # host memory: reading it waits for nothing
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size}); check that the "
            "tokenizer matches model.vocab_size"
        )
