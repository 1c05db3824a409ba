"""`train.param_groups`: per-pattern learning-rate multipliers, weight decay and Adam epsilon.

Membership follows the first matching rule (canonical names, also under a pipeline's layer
prefixes); without rules the groups are the two they always were. Through a real DeepSpeed engine,
a rule with `lr_mult: 0.5` halves the first AdamW update of exactly the parameters it names and
leaves every other one as without the rule. A pattern that matches nothing is a config error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_lev.config import ParamGroupRule, load_config
from megatron_lev.engine.optimizer_files import FILLER, _group_names
from megatron_lev.errors import CheckpointDataError, ConfigError
from megatron_lev.optim import group_name, param_groups
from megatron_lev.plan import param_group_rules, validate_run
from megatron_lev.testing import run_distributed
from tests.convert.ds_checkpoints import SEQ


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.out_proj = nn.Parameter(torch.zeros(3, 4))
        self.embedding.norm_weight = nn.Parameter(torch.ones(4))
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.final_norm = nn.LayerNorm(4)


def _groups(rules=(), **kw):
    """({group name: sorted parameter names}, {group name: group}) of a fresh Toy."""
    model = Toy()
    lookup = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, 0.1, rules=rules, **kw)
    return {g["name"]: sorted(lookup[id(p)] for p in g["params"]) for g in groups}, {
        g["name"]: g for g in groups
    }


def test_without_rules_the_two_groups_are_unchanged():
    names, groups = _groups()
    assert list(groups) == ["decay", "no_decay"]
    assert names == {
        "decay": ["embedding.out_proj", "layers.0.weight", "layers.1.weight"],
        "no_decay": [
            "embedding.norm_weight",
            "final_norm.bias",
            "final_norm.weight",
            "layers.0.bias",
            "layers.1.bias",
        ],
    }
    assert [g["weight_decay"] for g in groups.values()] == [0.1, 0.0]
    assert all("lr_mult" not in g and "eps" not in g for g in groups.values())


def test_the_first_matching_rule_names_the_group_and_its_settings():
    rules = [
        ParamGroupRule("embedding.*", lr_mult=0.1, weight_decay=0.0, adam_eps=1e-6),
        ParamGroupRule("layers.*", lr_mult=2.0),
        ParamGroupRule("embedding.out_proj", lr_mult=9.0),  # shadowed by the first rule
    ]
    names, groups = _groups(rules)
    assert names["rule0.decay"] == ["embedding.out_proj"]
    assert names["rule0.no_decay"] == ["embedding.norm_weight"]
    assert names["rule1.decay"] == ["layers.0.weight", "layers.1.weight"]
    assert names["rule1.no_decay"] == ["layers.0.bias", "layers.1.bias"]
    assert names["no_decay"] == ["final_norm.bias", "final_norm.weight"]
    assert "decay" not in groups and "rule2.decay" not in groups  # empty groups are dropped
    assert groups["rule0.decay"]["weight_decay"] == 0.0 and groups["rule0.decay"]["eps"] == 1e-6
    assert groups["rule0.decay"]["lr_mult"] == 0.1
    assert groups["rule1.decay"]["weight_decay"] == 0.1 and groups["rule1.no_decay"]["weight_decay"] == 0.0
    assert groups["rule1.decay"]["lr_mult"] == 2.0 and "eps" not in groups["rule1.decay"]


def test_pipeline_prefixes_are_stripped_before_matching():
    rule = [ParamGroupRule("embedding.*")]
    assert group_name("embedding.out_proj", 2, rule) == "rule0.decay"
    names, groups = _groups(
        rule, canonical=lambda n: n.replace("embedding.norm", "stage.norm"), keep_empty=True
    )
    assert list(groups) == ["decay", "no_decay", "rule0.decay", "rule0.no_decay"]  # kept for a stage to fill
    assert names["rule0.decay"] == ["embedding.out_proj"] and names["rule0.no_decay"] == []


def test_the_checkpoint_reader_maps_rule_groups_back_to_names():
    rules = [ParamGroupRule("layers.0.*")]
    names = [("layers.1.weight", 2), ("layers.1.bias", 1)]  # a stage without layers.0
    saved = [
        {"name": n, "params": [0] * k}
        for n, k in (("decay", 1), ("no_decay", 1), ("rule0.decay", 1), ("rule0.no_decay", 1))
    ]
    got = _group_names(names, saved, "x", (rules, ()))
    assert got == [["layers.1.weight"], ["layers.1.bias"], [FILLER], [FILLER]]
    with pytest.raises(CheckpointDataError, match="rule0.decay"):
        _group_names(names, [*saved[:2], {"name": "rule0.decay", "params": [0, 1]}], "x", (rules, ()))


def test_the_checkpoint_reader_maps_clip_groups_back_to_names():
    from megatron_lev.config import ClipGroupRule

    clip = [ClipGroupRule("seed", ["embedding.proj", "embedding.codebooks.*"], 1.0)]
    names = [("embedding.proj", 2), ("embedding.norm_weight", 1), ("output_head.weight", 2)]
    saved = [
        {"name": n, "params": [0] * k}
        for n, k in (("decay", 1), ("no_decay", 1), ("decay@seed", 1), ("no_decay@seed", 1))
    ]
    got = _group_names(names, saved, "x", ((), clip))
    assert got == [["output_head.weight"], ["embedding.norm_weight"], ["embedding.proj"], [FILLER]]


def _cfg(*extra):
    return load_config(
        ["tests/configs/tiny.yaml"],
        ["model.embedding=lev", "data.data_path=[x]", "data.tokenizer_path=t", *extra],
        validate=False,
    )


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.param_groups=[{pattern: embeding.*}]",
            r"param_groups\[0\].pattern='embeding.\*' matches no parameter",
        ),
        ("train.param_groups=[{pattern: ''}]", r"param_groups\[0\].pattern is empty"),
        ("train.param_groups=[{pattern: 'embedding.*', lr_mult: 0}]", r"lr_mult=0.0 must be > 0"),
        (
            "train.param_groups=[{pattern: 'embedding.*', weight_decay: -1}]",
            r"weight_decay=-1.0 must be >= 0",
        ),
        ("train.param_groups=[{pattern: 'embedding.*', adam_eps: 0}]", r"adam_eps=0.0 must be > 0"),
        ("train.param_groups=[{pattern: 'embedding.*', lr: 1}]", r"lr"),
        ("model.lev.seed_lr_mult=0", r"model.lev.seed_lr_mult"),
        (
            ("model.lev.seed_lr_mult=0.1", "train.param_groups=[{pattern: 'embedding.*', lr_mult: 0.5}]"),
            r"seed_lr_mult=0.1 and train.param_groups\[0\] \(pattern 'embedding.\*'\) both set the "
            r"learning rate of embedding.codebooks.weight",
        ),
    ],
)
def test_bad_rules_are_config_errors(override, message):
    overrides = override if isinstance(override, tuple) else (override,)
    with pytest.raises(ConfigError, match=message):
        validate_run(_cfg(*overrides), 1, cuda=False)


def test_seed_lr_mult_is_two_rules_for_lev_only():
    """model.lev.seed_lr_mult puts the pilot's two rules (codebooks and W_l at a tenth, LEV-RG's
    train.param_groups) before the user's; other embeddings ignore it, so one config file serves
    every variant."""
    from studies.plans import SEED_LR_X01

    pilot = param_group_rules(_cfg(SEED_LR_X01))
    assert [r.pattern for r in pilot] == ["embedding.codebooks.*", "embedding.proj"]
    assert param_group_rules(_cfg("model.lev.seed_lr_mult=0.1")) == pilot
    user = "train.param_groups=[{pattern: 'embedding.out_proj', lr_mult: 0.5}]"
    both = param_group_rules(_cfg("model.lev.seed_lr_mult=0.1", user))
    assert both[:2] == pilot and both[2].pattern == "embedding.out_proj"
    tied = load_config(
        ["tests/configs/tiny.yaml"],
        ["model.embedding=tied", "data.data_path=[x]", "data.tokenizer_path=t", "model.lev.seed_lr_mult=0.1"],
        validate=False,
    )
    assert param_group_rules(tied) == []
    validate_run(tied, 1, cuda=False)  # no rule to match a parameter TIED does not have


def test_a_good_rule_passes():
    plan = validate_run(
        _cfg("train.param_groups=[{pattern: 'embedding.out_proj', lr_mult: 0.1}]"), 1, cuda=False
    )
    assert plan.cfg.train.param_groups[0].lr_mult == 0.1


def _one_step(tokenizer: str, extra: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Runs in a gloo process: one AdamW step of a tiny LEV model; each parameter's update."""
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine, disable_cpu_shm_comm
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_plan
    from tests.convert.ds_checkpoints import run_config

    disable_cpu_shm_comm()
    cfg = run_config("lev", tokenizer, 1, 1, 1, extra=extra)
    torch.manual_seed(cfg.train.seed)
    plan = model_plan(cfg, 1, 50277)
    model = build_model(plan.model_spec, SINGLE)
    engine = build_engine(plan, model, SINGLE)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.set_lr(1e-3)
    ids = torch.randint(0, 50277, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    engine.train_batch(iter([(ids[:, :-1], ids[:, 1:])]))
    return {n: (p.detach() - before[n]) for n, p in model.named_parameters()}


@pytest.mark.multiprocess
def test_lr_mult_halves_the_update_of_exactly_the_named_parameters(tokenizer_path):
    base = run_distributed(_one_step, world_size=1, args=(tokenizer_path, ()), timeout=600)[0]
    rule = ("train.param_groups=[{pattern: 'embedding.*', lr_mult: 0.5}]",)
    half = run_distributed(_one_step, world_size=1, args=(tokenizer_path, rule), timeout=600)[0]
    named = [n for n in base if n.startswith("embedding.")]
    assert named and len(named) < len(base)
    for name, delta in base.items():
        assert delta.abs().max() > 0, name  # every parameter moved in the first step
        want = 0.5 * delta if name in named else delta
        # fp32 differences of weights near 1 round at ~6e-8; the updates are ~1e-3
        torch.testing.assert_close(half[name], want, rtol=1e-4, atol=2e-7, msg=name)
    seed = run_distributed(
        _one_step, world_size=1, args=(tokenizer_path, ("model.lev.seed_lr_mult=0.1",)), timeout=600
    )[0]
    for name, delta in base.items():  # Adam's first step is lr x sign: a tenth of it, exactly there
        want = 0.1 * delta if name in ("embedding.codebooks.weight", "embedding.proj") else delta
        torch.testing.assert_close(seed[name], want, rtol=1e-4, atol=2e-7, msg=name)
