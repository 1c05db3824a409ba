"""Measurements on trained models: representational capacity of embedding spaces,
frequency-stratified perplexity, and comparison of runs.

Public entry points (others call these; the CLI wraps them):
`capacity_report`, `write_report`, `cosine_stats`, `capacity_table`,
`per_token_losses`, `frequency_buckets`, `evaluation_result`, `compare_results`.
"""

from megatron_lev.analysis.capacity import capacity_report, write_report
from megatron_lev.analysis.cosine import CosineStats, cosine_stats
from megatron_lev.analysis.formulas import capacity_table, eps_class
from megatron_lev.analysis.perplexity import (
    TokenLosses,
    evaluation_result,
    frequency_buckets,
    per_token_losses,
)

__all__ = [
    "CosineStats",
    "TokenLosses",
    "capacity_report",
    "capacity_table",
    "cosine_stats",
    "eps_class",
    "evaluation_result",
    "frequency_buckets",
    "per_token_losses",
    "write_report",
]
