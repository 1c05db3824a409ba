"""`RunPlan`s for tests that build a model or an engine from a model-only config."""

from __future__ import annotations

from megatron_lev.config import RunConfig
from megatron_lev.plan import RunPlan, plan_for_model


def plan_for(cfg: RunConfig, vocab: int | None, world: int = 1) -> RunPlan:
    """`plan.plan_for_model` on the CPU: `validate_run(cfg, world, cuda=False)` with the
    tokenizer's `vocab`, placeholder data and tokenizer paths for a config that names none."""
    return plan_for_model(cfg, vocab, world)
