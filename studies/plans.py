"""The study's plans: which runs each experiment on the study runner makes (`PLANS`), and how they
are named, selected and dealt to lanes. The study itself is the small grid's six variants rerun with
several seeds, equal-scale and centred LEV controls, a LAMBADA-style task and the embedding geometry
at every saved checkpoint; the pilot, the regime, the clip and the token-id order experiments are
other plans on the same runner.

    plan = study_plan()                              # 19 StudyRun(name, group, variant, seed, overrides)
    run_study(Study(data_dir, out, lanes=2))         # studies.runner: data steps once, runs on 2 lanes
    collect_study(out, raw)                          # studies.collect: small raw files of finished runs
    write_report(raw, out_dir)                       # studies.study_report: every table, from raw alone

Every run uses the study config (`experiments/small/study.yaml`), the same data, tokenizer and data
order (`data.seed`, fixed); a run's seed is `train.seed`, which sets the model's initialisation only
(no dropout in these configs). Each step is a `megatron-lev` command run through `StepRunner`; the
runs' steps are split over lanes, each a subprocess with one thread and its own `StepRunner` over
the same output directory (distinct step names), so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatron_lev.errors import ConfigError

STUDY_CONFIG = Path("pretrain/configs/experiments/small/study.yaml")
SEEDS = (1234, 1235, 1236)
# model.input_init_rms of both equal-scale groups: TIED's own table init (normal, std model.init_std
# = 0.02) has an output RMS of about 0.02, so TIED-EQ is TIED at (exactly) its own scale and LEV-EQ
# is LEV started at TIED's scale.
EQUAL_SCALE_RMS = 0.02
LAMBADA_MAX_PASSAGES = 500
RUN_STEPS = ("train", "convert", "evaluate", "geometry")  # a run's steps, in order

# The study measured LEV as the spec defines it; its config's LEV now defaults to the pilot's setting
# (docs/results/pilot/selection.md), so its LEV groups set the spec's back and its raw files stay
# reproducible with this plan.
SPEC_LEV = ("model.lev.centre_reference=0", "model.lev.seed_lr_mult=1")
# group, model.embedding, seeds, overrides beyond train.seed
GROUPS: tuple[tuple[str, str, tuple[int, ...], tuple[str, ...]], ...] = (
    ("TIED", "tied", SEEDS, ()),
    ("LEV", "lev", SEEDS, SPEC_LEV),
    ("UNTIED", "untied", SEEDS[:1], ()),
    ("ALBERT", "albert", SEEDS[:1], ()),
    ("FLAT-MLP", "flat_mlp", SEEDS[:1], ()),
    ("FACT-MLP", "factorized_mlp", SEEDS[:1], ()),
    ("TIED-EQ", "tied", SEEDS, (f"model.input_init_rms={EQUAL_SCALE_RMS}",)),
    ("LEV-EQ", "lev", SEEDS, (*SPEC_LEV, f"model.input_init_rms={EQUAL_SCALE_RMS}")),
    ("LEV-C", "lev", SEEDS, (*SPEC_LEV, "model.lev.centred=true")),
)
VARIANT_GROUPS = ("TIED", "UNTIED", "ALBERT", "FLAT-MLP", "FACT-MLP", "LEV")

Group = tuple[str, str, tuple[int, ...], tuple[str, ...]]  # group, model.embedding, seeds, overrides

# The LEV pilot (docs/results/pilot/README.md states its questions and selection rules): 300 steps of
# the study's model; LEV as is, the remedies, a 10% warm-up for both, and a learning-rate sweep for both.
PILOT_CONFIG = Path("pretrain/configs/experiments/small/pilot.yaml")
PILOT_SEEDS = (1234, 1235)
CENTRE_REFERENCE = "model.lev.centre_reference=256"
WARMUP_10 = "train.lr_warmup_fraction=0.1"
LAYER_LR_X01 = 'train.param_groups=[{pattern: "embedding.*", lr_mult: 0.1}]'
# W_out at lr / (h r): the h r = 72 rows of the study's LEV (h 4, r 18) then move G by about lr per step
OUT_LR = "train.param_groups=[{pattern: embedding.out_proj, lr_mult: 0.0139}]"
SEED_LR_X01 = (
    'train.param_groups=[{pattern: "embedding.codebooks.*", lr_mult: 0.1}, '
    "{pattern: embedding.proj, lr_mult: 0.1}]"
)


def _lr(lr: float) -> tuple[str, str]:
    """The peak learning rate and its cosine floor (10%, as in the study's config)."""
    return (f"train.lr={lr:g}", f"train.min_lr={lr / 10:g}")


PILOT_GROUPS: tuple[Group, ...] = (
    ("TIED", "tied", PILOT_SEEDS, ()),
    ("TIED-LR1", "tied", PILOT_SEEDS[:1], _lr(1e-3)),
    ("TIED-LR4", "tied", PILOT_SEEDS[:1], _lr(4e-3)),
    ("TIED-W10", "tied", PILOT_SEEDS[:1], (WARMUP_10,)),
    ("LEV", "lev", PILOT_SEEDS, ()),
    ("LEV-LR1", "lev", PILOT_SEEDS[:1], _lr(1e-3)),
    ("LEV-LR4", "lev", PILOT_SEEDS[:1], _lr(4e-3)),
    ("LEV-W10", "lev", PILOT_SEEDS[:1], (WARMUP_10,)),
    ("LEV-X01", "lev", PILOT_SEEDS[:1], (LAYER_LR_X01,)),
    ("LEV-O", "lev", PILOT_SEEDS[:1], (OUT_LR,)),
    ("LEV-R", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE,)),
    ("LEV-RS", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE, "model.lev.seed_init_scale=10")),
    ("LEV-RG", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE, SEED_LR_X01)),
    # the amendment (docs/results/pilot/README.md): the learning-rate sweep with the 10% warm-up
    ("TIED-W10-LR1", "tied", PILOT_SEEDS[:1], (WARMUP_10, *_lr(1e-3))),
    ("TIED-W10-LR4", "tied", PILOT_SEEDS[:1], (WARMUP_10, *_lr(4e-3))),
    # the chosen setting (LEV-RG, selection.md) with the 10% warm-up at the three learning rates
    ("LEV-RG-W10", "lev", PILOT_SEEDS, (CENTRE_REFERENCE, SEED_LR_X01, WARMUP_10)),
    ("LEV-RG-W10-LR1", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE, SEED_LR_X01, WARMUP_10, *_lr(1e-3))),
    ("LEV-RG-W10-LR4", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE, SEED_LR_X01, WARMUP_10, *_lr(4e-3))),
)


@dataclass(frozen=True)
class Plan:
    """A set of runs `python -m studies` runs on resumable lanes: the study's, or another experiment
    on the same machinery (`PLANS`)."""

    name: str
    config: Path  # the run config every run starts from
    groups: tuple[Group, ...]
    seeds: tuple[int, ...]  # the seed order of `assign_lanes` (first seeds first)
    tokenizer_hint: str | None = None  # the plan needs `--tokenizer` (this file of the shared data)
    lambada: bool = True  # the LAMBADA-style passages and their evaluation
    about: str = ""
    max_chars_per_subset: int | None = None  # the split's size per subset (None: the runner's default)
    # train each run in stages in one directory, each resuming the last and ending at these evenly
    # spaced iterations (the full run's length, train.exit_interval the spacing), evaluated at each
    stages: tuple[int, ...] = ()
    tokens_per_step: int = 0  # the config's global batch x sequence length (staged plans)
    # a staged plan's cool-down: from each stage's checkpoint a branch that decays the rate (WSD) over
    # this share of the stage's steps, in its own directory, exported and evaluated like the stage
    cooldown: float = 0.0

    def cooldown_iters(self, stage: int) -> int:
        """The length of the cool-down branch from the checkpoint at iteration `stage` (0: none)."""
        return round(stage * self.cooldown)


# The regime experiment (docs/results/regime/README.md): GPT-NeoX's vocabulary, a model whose input
# table is 80% of it. Each side runs as the pilot chose (docs/results/pilot/selection.md): LEV in the
# chosen setting at LEV's chosen learning rate, TIED, ALBERT and UNTIED at TIED's, all with the 10%
# warm-up (the amendment). tests/experiments/test_pilot.py checks these names against the rules
# applied to the committed pilot raw files.
REGIME_CONFIG = Path("pretrain/configs/experiments/regime/regime.yaml")
REGIME_SEEDS = SEEDS
PILOT_TIED_CHOICE = "TIED-W10-LR1"
PILOT_LEV_CHOICE = "LEV-RG-W10-LR1"
_PILOT_OVERRIDES = {group: extra for group, _, _, extra in PILOT_GROUPS}
TIED_SETTING: tuple[str, ...] = _PILOT_OVERRIDES[PILOT_TIED_CHOICE]
LEV_SETTING: tuple[str, ...] = _PILOT_OVERRIDES[PILOT_LEV_CHOICE]
REGIME_GROUPS: tuple[Group, ...] = (
    ("TIED", "tied", REGIME_SEEDS, TIED_SETTING),
    ("LEV", "lev", REGIME_SEEDS, LEV_SETTING),
    ("ALBERT-32", "albert", REGIME_SEEDS[:1], ("model.baseline_dim=32", *TIED_SETTING)),
    ("UNTIED", "untied", REGIME_SEEDS[:1], TIED_SETTING),
    ("LEV-RANDOM", "lev", REGIME_SEEDS[:1], (*LEV_SETTING, "model.lev.id_order=random")),
)

# LEV's token-id order on the pilot's config: the chosen setting in bpe, random and frequency order.
ORDER_GROUPS: tuple[Group, ...] = tuple(
    (f"LEV-{name}", "lev", SEEDS, (*LEV_SETTING, f"model.lev.id_order={order}"))
    for name, order in (("BPE", "bpe"), ("RANDOM", "random"), ("FREQUENCY", "frequency"))
)

# The clip experiment (docs/results/clip/README.md, plan and criteria fixed before its runs): the
# regime's comparison with LEV's seed side clipped on its own (`model.lev.seed_clip_grad`, at the
# global threshold), TIED rerun on the same code (its clipping is now the project's), one seed of each
# without clipping as controls, and UNTIED's seeds 1235 and 1236 for a head-matched comparison.
SEED_CLIP = "model.lev.seed_clip_grad=1"
NO_CLIP = "train.clip_grad=0"
CLIP_GROUPS: tuple[Group, ...] = (
    ("TIED", "tied", REGIME_SEEDS, TIED_SETTING),
    ("LEV-SC", "lev", REGIME_SEEDS, (*LEV_SETTING, SEED_CLIP)),
    ("TIED-C0", "tied", REGIME_SEEDS[:1], (*TIED_SETTING, NO_CLIP)),
    ("LEV-C0", "lev", REGIME_SEEDS[:1], (*LEV_SETTING, NO_CLIP)),
    ("UNTIED", "untied", REGIME_SEEDS[1:], TIED_SETTING),
)


# The lower learning rate (docs/results/lr/README.md, plan and criteria fixed before its runs): the
# regime's TIED and LEV at half the rate (5e-4, floor 5e-5), one seed each, so that the regime's 1e-3
# is not the edge of what was tried for either side. LEV is the regime's (the clip experiment's
# preliminary choice; its seed-side clip did not help on seed 1234).
def _at_lr(setting: tuple[str, ...], lr: float) -> tuple[str, ...]:
    """`setting` with its peak rate and floor replaced by `lr` and `lr / 10`."""
    return (*(o for o in setting if not o.startswith(("train.lr=", "train.min_lr="))), *_lr(lr))


LR_GROUPS: tuple[Group, ...] = (
    ("TIED-LR05", "tied", REGIME_SEEDS[:1], _at_lr(TIED_SETTING, 5e-4)),
    ("LEV-LR05", "lev", REGIME_SEEDS[:1], _at_lr(LEV_SETTING, 5e-4)),
)

# Adam's eps (docs/results/eps/README.md, plan and criteria fixed before its runs): the regime's LEV
# on this code, and the same with train.adam_eps=1e-10, one seed. Tests whether the regime LEV's lead
# on never-seen targets comes from its global clip factor meeting Adam's eps in the rows of the output
# head whose token is never a target (docs/results/clip/rows.md).
SMALL_EPS = "train.adam_eps=1e-10"
EPS_GROUPS: tuple[Group, ...] = (
    ("LEV", "lev", REGIME_SEEDS[:1], LEV_SETTING),
    ("LEV-EPS", "lev", REGIME_SEEDS[:1], (*LEV_SETTING, SMALL_EPS)),
)

# Is the zero-shot lead the input layer's? (docs/results/controls/README.md, plan and criteria fixed
# before its runs): the head-matched controls the clip and eps experiments lack, UNTIED without
# clipping (to pair with the clip experiment's LEV-C0) and UNTIED and TIED at Adam's eps 1e-10 (to
# pair with the eps experiment's LEV-EPS), seed 1234 first; then seed 1235 of the eps pair. Their
# partners computed the loss through the logits, so these do too (model.fused_loss=false).
LOGITS_LOSS = "model.fused_loss=false"
CONTROL_GROUPS: tuple[Group, ...] = (
    ("UNTIED-C0", "untied", REGIME_SEEDS[:1], (*TIED_SETTING, NO_CLIP, LOGITS_LOSS)),
    ("UNTIED-EPS", "untied", REGIME_SEEDS[:2], (*TIED_SETTING, SMALL_EPS, LOGITS_LOSS)),
    ("TIED-EPS", "tied", REGIME_SEEDS[:1], (*TIED_SETTING, SMALL_EPS, LOGITS_LOSS)),
    ("LEV-EPS", "lev", REGIME_SEEDS[1:2], (*LEV_SETTING, SMALL_EPS, LOGITS_LOSS)),
)

# The budget curve (docs/results/budget/README.md, plan and criteria fixed before its runs): the
# regime's TIED and LEV trained four times as long on a split four times larger (no sample seen twice),
# at a constant rate after a fixed 100-step warm-up, so that every evaluated stage is a prefix of the
# longer run; exported and evaluated by band at 1000, 2000, 3000 and 4000 steps. One seed each.
BUDGET_STAGES = (1000, 2000, 3000, 4000)
REGIME_TOKENS_PER_STEP = 2048  # 8 sequences x 256 tokens (regime.yaml; a test checks it)
BUDGET_MAX_CHARS = 5_000_000  # about 9M training tokens with GPT-NeoX's tokenizer: one epoch covers 8.2M
CONSTANT_AFTER_WARMUP = ("train.lr_decay_style=constant", "train.lr_warmup_iters=100")


def _constant_rate(setting: tuple[str, ...]) -> tuple[str, ...]:
    """`setting` with a fixed 100-step warm-up (the regime's 10% of 1000) and a constant rate after
    it: no schedule depends on the run's length."""
    return (*(o for o in setting if not o.startswith("train.lr_warmup_fraction=")), *CONSTANT_AFTER_WARMUP)


BUDGET_GROUPS: tuple[Group, ...] = (
    ("TIED", "tied", REGIME_SEEDS[:1], _constant_rate(TIED_SETTING)),
    ("LEV", "lev", REGIME_SEEDS[:1], _constant_rate(LEV_SETTING)),
)

# The budget curve cooled down (docs/results/cooldown/README.md, plan and criteria fixed before its
# runs): the budget plan's runs, the same commands, on its seed and one more; from each stage's
# checkpoint a branch decays the rate to the floor over 10% of the stage's steps (WSD, linear), and
# the branch is evaluated by band as the stage is. The budget's runs computed the loss through the
# logits, so these do too: seed 1234's stages are the budget's commands (on this code their losses
# match the budget's to about 1e-7, not bit for bit; docs/results/cooldown/README.md).
COOLDOWN_SHARE = 0.1
COOLDOWN_GROUPS: tuple[Group, ...] = (
    ("TIED", "tied", REGIME_SEEDS[:2], (*_constant_rate(TIED_SETTING), LOGITS_LOSS)),
    ("LEV", "lev", REGIME_SEEDS[:2], (*_constant_rate(LEV_SETTING), LOGITS_LOSS)),
)

BUDGET_PLAN = Plan(
    "budget",
    REGIME_CONFIG,
    BUDGET_GROUPS,
    REGIME_SEEDS,
    tokenizer_hint="tokenizers/gpt-neox-20b.json",
    lambada=False,
    about="the regime's TIED and LEV at 4x the tokens, constant rate, evaluated at 1k-4k steps",
    max_chars_per_subset=BUDGET_MAX_CHARS,
    stages=BUDGET_STAGES,
    tokens_per_step=REGIME_TOKENS_PER_STEP,
)

PLANS: dict[str, Plan] = {
    "study": Plan(
        "study", STUDY_CONFIG, GROUPS, SEEDS, about="the small grid's variants with seeds and LEV controls"
    ),
    "pilot": Plan(
        "pilot",
        PILOT_CONFIG,
        PILOT_GROUPS,
        PILOT_SEEDS,
        lambada=False,
        about="300 steps of LEV as is, its remedies, warm-up and learning rates, against TIED",
    ),
    "regime": Plan(
        "regime",
        REGIME_CONFIG,
        REGIME_GROUPS,
        REGIME_SEEDS,
        tokenizer_hint="tokenizers/gpt-neox-20b.json",
        lambada=False,
        about="GPT-NeoX vocabulary, 4 x 192 model: LEV against TIED, ALBERT-32 and UNTIED by count band",
    ),
    "clip": Plan(
        "clip",
        REGIME_CONFIG,
        CLIP_GROUPS,
        REGIME_SEEDS,
        tokenizer_hint="tokenizers/gpt-neox-20b.json",
        lambada=False,
        about="the regime with LEV's seed side clipped on its own, TIED rerun, no-clip controls, UNTIED",
    ),
    "lr": Plan(
        "lr",
        REGIME_CONFIG,
        LR_GROUPS,
        REGIME_SEEDS,
        tokenizer_hint="tokenizers/gpt-neox-20b.json",
        lambada=False,
        about="the regime's TIED and LEV at half its learning rate (5e-4), one seed each",
    ),
    "eps": Plan(
        "eps",
        REGIME_CONFIG,
        EPS_GROUPS,
        REGIME_SEEDS,
        tokenizer_hint="tokenizers/gpt-neox-20b.json",
        lambada=False,
        about="the regime's LEV on this code and with Adam's eps at 1e-10, seed 1234",
    ),
    "controls": Plan(
        "controls",
        REGIME_CONFIG,
        CONTROL_GROUPS,
        REGIME_SEEDS,
        tokenizer_hint="tokenizers/gpt-neox-20b.json",
        lambada=False,
        about="UNTIED without clipping, UNTIED and TIED at Adam's eps 1e-10, LEV-EPS seed 1235",
    ),
    "budget": BUDGET_PLAN,
    "cooldown": dataclasses.replace(
        BUDGET_PLAN,
        name="cooldown",
        groups=COOLDOWN_GROUPS,
        about="the budget plan's runs on two seeds, each stage also cooled down (WSD over 10% of its steps)",
        cooldown=COOLDOWN_SHARE,
    ),
    "order": Plan(
        "order",
        PILOT_CONFIG,
        ORDER_GROUPS,
        SEEDS,
        lambada=False,
        about="LEV's token-id order (bpe, random, frequency) on the pilot's config, three seeds",
    ),
}


def get_plan(plan: str | Plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if plan not in PLANS:
        raise ConfigError(f"--plan {plan}: unknown; the plans are {', '.join(PLANS)}")
    return PLANS[plan]


CORPORA = (
    ("mmidx", "validation", "held-out documents of the training subsets"),
    ("text", "zero-shot", "the held-out subset, never trained on"),
    ("lambada", "LAMBADA-style", "last word of passages cut from the held-out subset"),
)


@dataclass(frozen=True)
class StudyRun:
    name: str  # run directory and step names: <group>-s<seed>, lower case
    group: str
    variant: str  # model.embedding
    seed: int  # train.seed
    overrides: tuple[str, ...]  # train.seed first, then the group's own


def stage_suffix(iterations: int) -> str:
    """The suffix of a staged run's step names and its `hf`/`eval` directories at a stage."""
    return f"-i{iterations}"


def cooldown_name(run: StudyRun | str, iterations: int) -> str:
    """The name (step names, run directory) of `run`'s cool-down branch from the stage at
    `iterations`: `<run>-cool-i<iterations>`."""
    return f"{getattr(run, 'name', run)}-cool{stage_suffix(iterations)}"


def run_step_names(run: StudyRun, plan: str | Plan = "study") -> dict[str, str]:
    """{marker label: step name} of one run: `train`, `convert`, `evaluate`, `geometry`, or for a
    staged plan each of the first three per stage (`train-i2000`, ...) and `geometry` once."""
    spec = get_plan(plan)
    stages = spec.stages
    if not stages:
        return {kind: f"{kind}-{run.name}" for kind in RUN_STEPS}
    names = {
        f"{kind}{stage_suffix(n)}": f"{kind}-{run.name}{stage_suffix(n)}"
        for n in stages
        for kind in RUN_STEPS[:3]
    }
    if spec.cooldown:
        names |= {
            f"{kind}-cool{stage_suffix(n)}": f"{kind}-{cooldown_name(run, n)}"
            for n in stages
            for kind in RUN_STEPS[:3]
        }
    return {**names, "geometry": f"geometry-{run.name}"}


def study_plan(plan: str | Plan = "study") -> list[StudyRun]:
    """A plan's runs (the study's 19 by default), in the order of its groups and seeds."""
    return [
        StudyRun(f"{group.lower()}-s{seed}", group, variant, seed, (f"train.seed={seed}", *extra))
        for group, variant, seeds, extra in get_plan(plan).groups
        for seed in seeds
    ]


def select_runs(names: list[str] | None, plan: str | Plan = "study") -> list[StudyRun]:
    """The plan's runs named, in the order named (a lane runs them in the order `assign_lanes` dealt
    them); all of them, in plan order, when `names` is empty. An unknown name is refused."""
    runs = study_plan(plan)
    if not names:
        return runs
    known = {r.name for r in runs}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"--runs: unknown {unknown}; the {get_plan(plan).name} plan's runs are {', '.join(sorted(known))}"
        )
    by_name = {r.name: r for r in runs}
    return [by_name[n] for n in dict.fromkeys(names)]


def assign_lanes(runs: list[StudyRun], lanes: int, plan: str | Plan = "study") -> list[list[StudyRun]]:
    """Runs dealt round-robin to `lanes` lanes, first seeds first: every group's first seed finishes
    before any group's second, so a study cut short still has every variant."""
    if lanes < 1:
        raise ConfigError(f"--lanes {lanes}: must be an integer >= 1")
    order = {seed: i for i, seed in enumerate(get_plan(plan).seeds)}
    plan_index = {r.name: i for i, r in enumerate(study_plan(plan))}
    ordered = sorted(runs, key=lambda r: (order.get(r.seed, len(order)), plan_index.get(r.name, 0)))
    return [ordered[k::lanes] for k in range(lanes)]


def plan_markdown(runs: list[StudyRun] | None = None, plan: str | Plan = "study") -> str:
    runs = study_plan(plan) if runs is None else runs
    lines = ["| run | group | model.embedding | train.seed | overrides |", "|---|---|---|---|---|"]
    for r in runs:
        extra = " ".join(f"`{o}`" for o in r.overrides[1:]) or "-"
        lines.append(f"| {r.name} | {r.group} | {r.variant} | {r.seed} | {extra} |")
    return "\n".join(lines) + "\n"
