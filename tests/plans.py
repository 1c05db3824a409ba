"""`RunPlan`s for tests that build a model or an engine from a model-only config."""

from __future__ import annotations

import dataclasses

from megatron_lev.config import RunConfig
from megatron_lev.engine.plan import RunPlan, validate_run


def plan_for(cfg: RunConfig, vocab: int | None, world: int = 1) -> RunPlan:
    """`validate_run(cfg, world, cuda=False)` with the tokenizer's `vocab` (None: no vocabulary, for an
    engine over a toy model); a config that names no data or tokenizer (the model alone is under test)
    gets placeholders, which nothing reads."""
    data = dataclasses.replace(
        cfg.data,
        data_path=cfg.data.data_path or ["unused-data"],
        tokenizer_path=cfg.data.tokenizer_path or "unused-tokenizer",
    )
    return validate_run(dataclasses.replace(cfg, data=data), world, cuda=False, tokenizer_vocab=vocab)
