"""Parameter counts of the input-embedding variants, and sizing of the baselines to match LEV.

`albert` has one free width `e` (each unit costs `V + D` parameters), so it is matched
to the nearest `e`; `flat_mlp` and `factorized_mlp` also choose their MLP hidden width,
which matches LEV's count to well within 1% at realistic sizes.
"""

from __future__ import annotations

from megatron_lev.config import ConfigError, LevConfig, ModelConfig
from megatron_lev.model.embeddings.lev import digit_base

VARIANTS = ("tied", "untied", "albert", "flat_mlp", "factorized_mlp", "lev")


def lev_parameter_count(vocab_size: int, hidden_size: int, lev: LevConfig) -> int:
    """`k*b*d_seed + h*(d_seed^2 + 2*d_seed + d_seed*kappa*r + r*D)` (+ `d_seed*D` with the residual)."""
    d = lev.d_seed
    per_head = d * d + 2 * d + d * lev.kappa * lev.rank + lev.rank * hidden_size
    count = lev.k * digit_base(vocab_size, lev.k) * d + lev.heads * per_head
    return count + (d * hidden_size if lev.residual else 0)


def albert_count(vocab_size: int, hidden_size: int, dim: int) -> int:
    return vocab_size * dim + dim * hidden_size


def mlp_count(table_rows: int, dim: int, hidden: int, hidden_size: int) -> int:
    """A `table_rows x dim` table (or codebooks) then a bias-free MLP `dim -> hidden -> D`."""
    return table_rows * dim + dim * hidden + hidden * hidden_size


def baseline_sizes(variant: str, vocab_size: int, hidden_size: int, model_cfg: ModelConfig) -> tuple[int, int]:
    """`(e, hidden)` of a compressed baseline; the ones not set in the config match LEV's count.

    albert: e (hidden unused, 0). flat_mlp: e (default: the table takes about half of
    LEV's budget) and hidden. factorized_mlp: e is `lev.d_seed` (the seed), and hidden.
    """
    target = lev_parameter_count(vocab_size, hidden_size, model_cfg.lev)
    V, D = vocab_size, hidden_size
    if variant == "albert":
        dim = model_cfg.baseline_dim or max(1, round(target / (V + D)))
        return dim, 0
    if variant == "flat_mlp":
        dim = model_cfg.baseline_dim or max(1, target // (2 * V))
        hidden = model_cfg.baseline_hidden or max(1, round((target - V * dim) / (dim + D)))
        return dim, hidden
    if variant == "factorized_mlp":
        lev = model_cfg.lev
        rows = lev.k * digit_base(V, lev.k)
        hidden = model_cfg.baseline_hidden or max(1, round((target - rows * lev.d_seed) / (lev.d_seed + D)))
        return lev.d_seed, hidden
    raise ConfigError(f"model.embedding={variant!r} has no sizes to match (only albert, flat_mlp, factorized_mlp)")


def input_parameter_count(variant: str, vocab_size: int, hidden_size: int, model_cfg: ModelConfig) -> int:
    """Parameters of the input embedding alone (the full model, summed over TP ranks)."""
    if variant in ("tied", "untied"):
        return vocab_size * hidden_size
    if variant == "lev":
        return lev_parameter_count(vocab_size, hidden_size, model_cfg.lev)
    dim, hidden = baseline_sizes(variant, vocab_size, hidden_size, model_cfg)
    if variant == "albert":
        return albert_count(vocab_size, hidden_size, dim)
    if variant == "flat_mlp":
        return mlp_count(vocab_size, dim, hidden, hidden_size)
    if variant == "factorized_mlp":
        lev = model_cfg.lev
        return mlp_count(lev.k * digit_base(vocab_size, lev.k), dim, hidden, hidden_size)
    raise ConfigError(f"model.embedding={variant!r} is not one of {', '.join(VARIANTS)}")


def parameter_counts(variant: str, vocab_size: int, hidden_size: int, model_cfg: ModelConfig) -> dict[str, int]:
    """`{"input", "output", "total_embedding"}`: output is the dense `V x D` head (0 extra when tied)."""
    inp = input_parameter_count(variant, vocab_size, hidden_size, model_cfg)
    out = 0 if variant == "tied" else vocab_size * hidden_size
    return {"input": inp, "output": out, "total_embedding": inp + out}
