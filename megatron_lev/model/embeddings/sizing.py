"""Parameter-count formulas shared by the variants, and how the baselines are sized to match LEV.

Each variant counts its own parameters (`InputEmbedding.parameter_count`); the compressed
baselines also choose their widths there (`widths`). `albert` has one free width `e`
(each unit costs `V + D` parameters), so it is matched to the nearest `e`; `flat_mlp` and
`factorized_mlp` also choose their MLP hidden width, which matches LEV's count to well
within 1% at realistic sizes.
"""

from __future__ import annotations

from megatron_lev.model.embeddings.lev import lev_parameter_count

__all__ = ["albert_count", "lev_parameter_count", "mlp_count"]


def albert_count(vocab_size: int, hidden_size: int, dim: int) -> int:
    """A `V x e` table then a linear `e -> D`."""
    return vocab_size * dim + dim * hidden_size


def mlp_count(table_rows: int, dim: int, hidden: int, hidden_size: int) -> int:
    """A `table_rows x dim` table (or codebooks) then a bias-free MLP `dim -> hidden -> D`."""
    return table_rows * dim + dim * hidden + hidden * hidden_size
