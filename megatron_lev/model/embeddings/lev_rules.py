"""LEV's own rules on the rest of the run config: the optimizer groups its keys imply.

LEV's seed side (the codebooks and `W_l`, canonical names below) is scale-free behind a LayerNorm,
so two `model.lev` keys give it its own optimizer settings:

- `model.lev.seed_lr_mult` is two optimizer rules (one per seed tensor) put before
  `train.param_groups`;
- `model.lev.seed_clip_grad` is a clip group named `lev_seed` put before `train.clip_groups`.

Both keys are ignored by the other variants, so one config file serves every variant. The run plan
asks the variant class of `model.embedding` for these (`plan.param_group_rules`,
`clip_group_rules`, and the conflict checks in `validate_config`); `LevEmbedding` takes them from
`LevRules`. The config package knows none of it.
"""

from __future__ import annotations

import fnmatch

from megatron_lev.config import ClipGroupRule, ParamGroupRule, RunConfig
from megatron_lev.errors import ConfigError

# The seed side of LEV (codebooks and W_l, canonical names): what model.lev.seed_lr_mult scales.
LEV_SEED_PARAMS = ("embedding.codebooks.*", "embedding.proj")
LEV_SEED_NAMES = ("embedding.codebooks.weight", "embedding.proj")
LEV_SEED_CLIP_GROUP = "lev_seed"  # the clip group model.lev.seed_clip_grad implies


class LevRules:
    """The `InputEmbedding` rule hooks of LEV (see `InputEmbedding.param_group_rules`)."""

    implied_clip_groups = {LEV_SEED_CLIP_GROUP: "model.lev.seed_clip_grad"}

    @classmethod
    def param_group_rules(cls, cfg: RunConfig) -> list[ParamGroupRule]:
        """`model.lev.seed_lr_mult` (unless 1) as one rule per seed tensor."""
        mult = cfg.model.lev.seed_lr_mult
        if mult == 1.0:
            return []
        return [ParamGroupRule(pattern, lr_mult=mult) for pattern in LEV_SEED_PARAMS]

    @classmethod
    def clip_group_rules(cls, cfg: RunConfig) -> list[ClipGroupRule]:
        """`model.lev.seed_clip_grad` (unless null) as the clip group `lev_seed` of the seed tensors."""
        max_norm = cfg.model.lev.seed_clip_grad
        if max_norm is None:
            return []
        return [ClipGroupRule(LEV_SEED_CLIP_GROUP, list(LEV_SEED_PARAMS), max_norm)]

    @classmethod
    def check_group_rules(cls, cfg: RunConfig) -> None:
        """Refuse a `train.param_groups` / `train.clip_groups` rule that takes a seed tensor LEV's own
        rule already sets: the first matching rule would win silently."""
        lev, t = cfg.model.lev, cfg.train
        if lev.seed_lr_mult != 1.0:
            for i, rule in enumerate(t.param_groups):
                hit = [n for n in LEV_SEED_NAMES if fnmatch.fnmatchcase(n, rule.pattern)]
                if hit:
                    raise ConfigError(
                        f"model.lev.seed_lr_mult={lev.seed_lr_mult} and train.param_groups[{i}] "
                        f"(pattern {rule.pattern!r}) both set the learning rate of {hit[0]}: set it in one "
                        "place (seed_lr_mult=1 to leave it to the rule, or a pattern that leaves it out)"
                    )
        if lev.seed_clip_grad is not None:
            for i, rule in enumerate(t.clip_groups):
                hit = [n for n in LEV_SEED_NAMES for pat in rule.patterns if fnmatch.fnmatchcase(n, pat)]
                if hit:
                    raise ConfigError(
                        f"model.lev.seed_clip_grad={lev.seed_clip_grad} and train.clip_groups[{i}] "
                        f"({rule.name!r}) both clip {hit[0]}: set it in one place (seed_clip_grad=null "
                        "to leave it to the rule, or patterns that leave it out)"
                    )
