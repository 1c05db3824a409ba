"""One validation per run, and its result handed down: `validate_run(cfg, world_size) -> RunPlan`.

    plan = validate_run(cfg, world_size, cuda=torch.cuda.is_available())  # before anything heavy
    ...                                                                    # process group, tokenizer
    plan = plan.with_vocab(tokenizer.vocab_size)                          # the vocabulary's rules
    layout = initialize_model_parallel(tp, pp)                            # parallel.state: the groups
    model = build_model(plan.model_spec, layout)
    engine = build_engine(plan, model, layout)

Each rule runs once per run, here and nowhere else on the way to the trainer:
`RunConfig.validate` (the config's generic rules), the variant's own (`check_config`, the
optimizer and clip groups its keys imply, and `check_vocab` at the padded vocabulary once it is
known), and the trainer's (device, token budget, evaluation split, data and tokenizer paths).
The padded vocabulary, the batch layout and the DeepSpeed JSON are computed once and travel in
the `RunPlan`; so does the config with what the run derives into it (`model.lev.id_order_counts`
for a `frequency` token order): `plan.cfg` is the config the run records and builds from.

`validate_config` is the part that does not depend on training (generic and variant rules),
for commands that read a run config without training it. `param_group_rules` and
`clip_group_rules` are the optimizer's groups by parameter name: the variant's, then the config's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lev.ckpt.layout import iteration_of, list_checkpoints
from megatron_lev.config import GLOBAL_CLIP_GROUP, ClipGroupRule, ParamGroupRule, RunConfig
from megatron_lev.data.manifest import manifest_path
from megatron_lev.errors import ConfigError
from megatron_lev.model.embeddings import REGISTRY, embedding_class
from megatron_lev.model.vocab import padded_vocab_size
from megatron_lev.plan.ds_config import batch_layout, build_ds_config, data_parallel_size
from megatron_lev.plan.spec import ModelSpec


@dataclass(frozen=True)
class RunPlan:
    """A validated run: the config and everything derived from it once.

    `true_vocab` (the vocabulary the model covers: `model.vocab_size`, else the tokenizer's) and
    `padded_vocab` are None until the tokenizer is read (`with_vocab`); with `model.vocab_size`
    set they are known from the start.
    """

    cfg: RunConfig
    world_size: int
    micro_batch: int  # sequences per rank per micro-batch
    gas: int  # gradient accumulation steps (micro-batches per optimizer step)
    global_batch: int  # sequences per optimizer step
    ds_config: dict[str, Any]  # the DeepSpeed JSON the engine runs with
    true_vocab: int | None = None
    padded_vocab: int | None = None  # true_vocab rounded up to make_vocab_size_divisible_by x TP
    tokenizer_vocab: int | None = None  # set by `with_vocab`
    cuda: bool = False  # the run trains on GPUs (the memory check warns instead of refusing)
    # the optimizer's groups and the clip groups by parameter name (`param_group_rules`,
    # `clip_group_rules`): resolved once when the plan is made, read by the engine
    param_rules: tuple[ParamGroupRule, ...] | None = None
    clip_rules: tuple[ClipGroupRule, ...] | None = None

    def __post_init__(self) -> None:
        if self.param_rules is None:
            object.__setattr__(self, "param_rules", tuple(param_group_rules(self.cfg)))
        if self.clip_rules is None:
            object.__setattr__(self, "clip_rules", tuple(clip_group_rules(self.cfg)))

    @property
    def model_spec(self) -> ModelSpec:
        """What building this run's model reads (`engine.build.build_model`)."""
        if self.padded_vocab is None or self.true_vocab is None:
            raise ValueError("the plan has no vocabulary yet: call plan.with_vocab(tokenizer_vocab) first")
        return ModelSpec.of(self.cfg, self.padded_vocab, self.true_vocab)

    @property
    def save_dir(self) -> str:
        """Where the run saves its checkpoints (and resumes from, unless train.load)."""
        return save_dir_of(self.cfg)

    @property
    def data_parallel_size(self) -> int:
        return data_parallel_size(self.cfg, self.world_size)

    def with_global_batch(self, global_batch: int) -> RunPlan:
        """The plan with `train.global_batch_size` set (a resume on another DP size keeps the
        checkpoint's): the gradient accumulation and the DeepSpeed JSON's batch keys follow."""
        cfg = dataclasses.replace(
            self.cfg, train=dataclasses.replace(self.cfg.train, global_batch_size=global_batch)
        )
        micro, gas, global_batch = batch_layout(
            cfg, self.world_size
        )  # refuses a batch the layout cannot make
        ds_config = {
            **self.ds_config,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
            "train_batch_size": global_batch,
        }
        return dataclasses.replace(
            self, cfg=cfg, micro_batch=micro, gas=gas, global_batch=global_batch, ds_config=ds_config
        )

    def with_vocab(self, tokenizer_vocab: int) -> RunPlan:
        """The plan with the tokenizer's vocabulary checked and the model's (padded) vocabulary set."""
        if self.tokenizer_vocab is not None:
            if tokenizer_vocab != self.tokenizer_vocab:
                raise ValueError(
                    f"the plan was checked against a tokenizer vocabulary of {self.tokenizer_vocab}, "
                    f"not {tokenizer_vocab}"
                )
            return self
        true_vocab = check_vocab(self.cfg, tokenizer_vocab)
        padded = self.padded_vocab  # model.vocab_size set: padded and checked by validate_run
        if padded is None:
            padded = _vocab_rules(self.cfg, true_vocab)
        _memory_rules(self.cfg, self.world_size, padded, self.cuda)  # the vocabulary sizes the logits
        return dataclasses.replace(
            self, true_vocab=true_vocab, padded_vocab=padded, tokenizer_vocab=tokenizer_vocab
        )


def validate_config(cfg: RunConfig, world_size: int | None = None) -> RunConfig:
    """The rules a config must pass to describe a model: `RunConfig.validate`'s generic ones and the
    variant's (`check_config`; `check_vocab` too when `model.vocab_size` fixes the vocabulary).
    `world_size` adds the layout checks. Returns `cfg`."""
    _model_rules(cfg, world_size)
    if world_size is not None:
        batch_layout(cfg, world_size)  # the global batch over DP (a run's is in its DeepSpeed JSON)
    return cfg


def validate_run(
    cfg: RunConfig, world_size: int, *, cuda: bool, tokenizer_vocab: int | None = None
) -> RunPlan:
    """Check everything a training run needs from `cfg` before anything heavy, once, and compute the
    padded vocabulary, the batch layout and the DeepSpeed JSON. `tokenizer_vocab` given: the
    vocabulary's rules too (else `plan.with_vocab` once the tokenizer is read)."""
    padded = _model_rules(cfg, world_size)
    _training_rules(cfg, cuda)
    cfg = with_id_order_counts(cfg)
    plan = _plan(
        cfg,
        world_size,
        true_vocab=cfg.model.vocab_size if padded is not None else None,
        padded_vocab=padded,
        cuda=cuda,
    )
    return plan.with_vocab(tokenizer_vocab) if tokenizer_vocab is not None else plan


def _plan(cfg: RunConfig, world_size: int, **fields) -> RunPlan:
    """The `RunPlan` of a validated `cfg` over `world_size` processes: its DeepSpeed JSON (which refuses
    a template that conflicts with the run) and the batch layout as that JSON has it
    (`plan.ds_config.batch_layout`), with `fields` (the vocabulary, the device)."""
    ds_config = build_ds_config(cfg, world_size)
    return RunPlan(
        cfg=cfg,
        world_size=world_size,
        micro_batch=ds_config["train_micro_batch_size_per_gpu"],
        gas=ds_config["gradient_accumulation_steps"],
        global_batch=ds_config["train_batch_size"],
        ds_config=ds_config,
        **fields,
    )


def check_vocab(cfg: RunConfig, tokenizer_vocab: int) -> int:
    """The vocabulary the model must cover: the tokenizer's, or model.vocab_size if set (and large enough)."""
    want = cfg.model.vocab_size
    if want is not None and want < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={want} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}, "
            f"{cfg.data.tokenizer_path}): token ids up to {tokenizer_vocab - 1} would be out of range; "
            "unset model.vocab_size (it is taken from the tokenizer) or use the matching tokenizer"
        )
    return want if want is not None else tokenizer_vocab


def _model_rules(cfg: RunConfig, world_size: int | None) -> int | None:
    """Generic, layout and variant rules; the padded vocabulary when `model.vocab_size` fixes it (else
    None)."""
    cfg.validate()
    if world_size is not None:
        data_parallel_size(cfg, world_size)  # world = TP x PP x DP
    # the variant's own rules (and the error for an unknown model.embedding) come from its class
    variant = embedding_class(cfg.model.embedding)
    _implied_group_rules(cfg, variant)
    variant.check_config(cfg.model, cfg.parallel.tensor_model_parallel_size)
    if cfg.model.vocab_size is None:
        return None  # the vocabulary's rules wait for the tokenizer
    return _vocab_rules(cfg, cfg.model.vocab_size)


def param_group_rules(cfg: RunConfig) -> list[ParamGroupRule]:
    """The optimizer's rules by parameter name: those the variant's keys imply (e.g. LEV's
    `model.lev.seed_lr_mult`) before `train.param_groups`. Every reader of the optimizer's groups
    (the engine, the optimizer files of a checkpoint) takes them from here."""
    return [*embedding_class(cfg.model.embedding).param_group_rules(cfg), *cfg.train.param_groups]


def clip_group_rules(cfg: RunConfig) -> list[ClipGroupRule]:
    """The clip groups by parameter name: those the variant's keys imply (e.g. LEV's
    `model.lev.seed_clip_grad`, named `lev_seed`) before `train.clip_groups`, each with its threshold
    resolved. Every reader of the optimizer's groups (the engine, the optimizer files of a
    checkpoint) takes them from here."""
    return [*embedding_class(cfg.model.embedding).clip_group_rules(cfg), *cfg.train.clip_group_rules()]


def _implied_group_rules(cfg: RunConfig, variant: type) -> None:
    """No `train.clip_groups` rule takes the name of a clip group a variant implies (whichever variant
    runs, so a config file serves every variant), nor a parameter the running variant's own rules set."""
    for i, rule in enumerate(cfg.train.clip_groups):
        for name, cls in REGISTRY.items():
            if rule.name in cls.implied_clip_groups:
                raise ConfigError(
                    f"train.clip_groups[{i}].name={rule.name!r} is the clip group "
                    f"{cls.implied_clip_groups[rule.name]} implies (model.embedding={name}): give it "
                    f"a name other than {rule.name!r} and {GLOBAL_CLIP_GROUP!r}, e.g. 'head'"
                )
    variant.check_group_rules(cfg)


def _vocab_rules(cfg: RunConfig, vocab: int) -> int:
    """Pad `vocab` for this TP size and run the variant's rules at the padded vocabulary."""
    padded = padded_vocab_size(vocab, cfg.model, cfg.parallel.tensor_model_parallel_size)
    # e.g. a compressed baseline's minimum width
    embedding_class(cfg.model.embedding).check_vocab(cfg.model, padded)
    return padded


def id_order_counts_path(cfg: RunConfig) -> str:
    """The counts file a `frequency` token order ranks ids by: `model.lev.id_order_counts`, else
    `<first data.data_path prefix>.counts.npy` (what `megatron-lev preprocess` writes)."""
    if cfg.model.lev.id_order_counts is not None:
        return cfg.model.lev.id_order_counts
    paths = cfg.data.data_path
    return f"{paths[0] if len(paths) == 1 else paths[1]}.counts.npy"  # [prefix] or [w, prefix, ...]


def with_id_order_counts(cfg: RunConfig) -> RunConfig:
    """`cfg` with `model.lev.id_order_counts` filled in for `model.lev.id_order=frequency` (recorded in the
    run's config.yaml); refused in one line when the file is missing and the run starts fresh.

    Only a fresh model reads the file (the order is stored with the weights), so it is not needed
    when the save or load directory holds a complete checkpoint to resume; nor refused when the
    counts would come from the training data and that is not there yet either (a grid checks its
    runs before it preprocesses the data; the dataset reports missing data)."""
    lev = cfg.model.lev
    if lev.id_order != "frequency":
        return cfg
    path = id_order_counts_path(cfg)
    if not Path(path).is_file() and not _has_checkpoint(cfg):
        prefix = path.removesuffix(".counts.npy")
        derived = lev.id_order_counts is None
        if not derived or manifest_path(prefix).is_file() or Path(f"{prefix}.idx").is_file():
            how = (
                f"the training data {prefix} has no {Path(path).name} (written by `megatron-lev preprocess`)"
                if derived
                else "it is not there"
            )
            raise ConfigError(
                f"model.lev.id_order=frequency ranks token ids by their training counts, but "
                f"model.lev.id_order_counts={path!r}: {how}; rerun `megatron-lev preprocess`, set "
                "model.lev.id_order_counts to the training split's counts.npy, or choose another "
                "model.lev.id_order"
            )
    if lev.id_order_counts is not None:
        return cfg
    model = dataclasses.replace(cfg.model, lev=dataclasses.replace(lev, id_order_counts=path))
    return dataclasses.replace(cfg, model=model)


def save_dir_of(cfg: RunConfig) -> str:
    """`train.save`, else `<logging.output_dir>/checkpoints`: the one statement of the default."""
    return cfg.train.save or str(Path(cfg.logging.output_dir) / "checkpoints")


def _has_checkpoint(cfg: RunConfig) -> bool:
    """Whether the run's save or load directory holds a complete checkpoint (it would resume)."""
    save = save_dir_of(cfg)
    load = cfg.train.load
    if load and iteration_of(Path(load).name) is not None:  # train.load names one checkpoint
        named = any(c.complete and c.tag == Path(load).name for c in list_checkpoints(Path(load).parent))
        return named or any(c.complete for c in list_checkpoints(save))
    return any(c.complete for root in (save, load) if root for c in list_checkpoints(root))


def _memory_rules(cfg: RunConfig, world_size: int, padded_vocab: int, cuda: bool) -> None:
    """Refuse (CPU) or warn about (GPU) a run whose estimated memory does not fit (`plan.memory`),
    before the model or the data indices are built."""
    from megatron_lev.log import get_logger
    from megatron_lev.plan.memory import check_memory, estimate_memory
    from megatron_lev.utils import dist as ranks

    est = estimate_memory(cfg, world_size, padded_vocab, cuda=cuda)
    device_bytes = None
    if cuda:
        import torch

        device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    warning = check_memory(est, cfg, cuda=cuda, device_bytes=device_bytes)
    if ranks.rank() == 0:
        log = get_logger(__name__)
        log.info("memory estimate: %s", est.text())
        if warning:
            log.warning("%s", warning)


def _training_rules(cfg: RunConfig, cuda: bool) -> None:
    """What only the trainer needs: the device, the token budget, the evaluation split, data and tokenizer."""
    t, p = cfg.train, cfg.parallel
    if t.precision == "fp16" and not cuda:
        raise ConfigError(
            "train.precision=fp16 needs CUDA (DeepSpeed's loss scaler); use bf16 or fp32 on CPU"
        )
    if p.distributed_backend == "nccl" and not cuda:
        raise ConfigError("parallel.distributed_backend=nccl needs CUDA; use gloo on CPU")
    if t.chinchilla and t.train_tokens is not None:
        raise ConfigError("train.chinchilla=true and train.train_tokens both set a token budget: keep one")
    if t.eval_interval > 0 and not cfg.data.valid_data_path:
        valid_weight = float(cfg.data.split.split(",")[1])
        if valid_weight <= 0:
            raise ConfigError(
                f"train.eval_interval={t.eval_interval} but data.split={cfg.data.split!r} has no "
                "validation part and data.valid_data_path is empty: give the split a validation "
                "weight, set data.valid_data_path, or set train.eval_interval=0"
            )
    if not cfg.data.data_path:
        raise ConfigError(
            "data.data_path is empty: give the preprocessed prefix(es), e.g. "
            "data.data_path=[data/pile_text_document]"
        )
    if not cfg.data.tokenizer_path and cfg.data.tokenizer_type != "tiktoken":
        raise ConfigError("data.tokenizer_path is not set: the tokenizer defines the vocabulary and EOD")
    _param_group_rules(cfg)


def _param_group_rules(cfg: RunConfig) -> None:
    """Every `train.param_groups` pattern and every `train.clip_groups` pattern matches some parameter
    of the model (a typo would silently leave the rule unused); names are the canonical ones, the same
    on every layout."""
    if not cfg.train.param_groups and not cfg.train.clip_groups:
        return
    import fnmatch

    from megatron_lev.model.canonical import canonical_state_dict_spec

    specs = canonical_state_dict_spec(cfg.model, cfg.model.make_vocab_size_divisible_by)
    names = [name for name, spec in specs.items() if not spec.buffer]
    shown = ", ".join(sorted({n.rsplit(".", 1)[0] for n in names if not n.startswith("layers.")})[:6])
    patterns = [(f"train.param_groups[{i}].pattern", r.pattern) for i, r in enumerate(cfg.train.param_groups)]
    for i, rule in enumerate(cfg.train.clip_groups):
        patterns += [(f"train.clip_groups[{i}].patterns[{j}]", p) for j, p in enumerate(rule.patterns)]
    for key, pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ConfigError(
                f"{key}={pattern!r} matches no parameter of this model "
                f"(model.embedding={cfg.model.embedding}); names look like layers.0.attention.qkv.weight, "
                f"{shown}: e.g. 'embedding.*' or 'embedding.out_proj'"
            )


def model_plan(cfg: RunConfig, world: int, vocab: int | None, *, cuda: bool = False) -> RunPlan:
    """The plan of a model laid out over `world` processes that is not trained from data here (a
    reshard's target; the engine of a test or a benchmark): the model's rules (`validate_config`), the
    padded vocabulary of `vocab` (None: no vocabulary, for an engine over another module) and the
    DeepSpeed JSON; no training or data rules, and no data or tokenizer path is needed."""
    validate_config(cfg)
    if vocab is None:
        return _plan(cfg, world, cuda=cuda)
    return _plan(
        cfg,
        world,
        true_vocab=vocab,
        padded_vocab=padded_vocab_size(vocab, cfg.model, cfg.parallel.tensor_model_parallel_size),
        tokenizer_vocab=vocab,
        cuda=cuda,
    )


def model_spec(cfg: RunConfig, vocab: int, world: int | None = None) -> ModelSpec:
    """The spec of a model that is not trained here (converters, tests, benchmarks): the model's rules
    (`validate_config`'s; with `world`, that it is TP x PP x DP), the vocabulary's at the padded size
    of the tokenizer's `vocab`, and the id-order counts a `frequency` order ranks by. No training or
    data rule, and nothing faked: a config that names no data builds its model as it is."""
    lev = cfg.model.lev
    if lev.id_order == "frequency" and lev.id_order_counts is None and not cfg.data.data_path:
        raise ConfigError(
            "model.lev.id_order=frequency ranks token ids by training counts: set model.lev.id_order_counts "
            "to a training split's counts.npy (or data.data_path) to build this model"
        )
    padded = _model_rules(cfg, world)  # padded and checked already when model.vocab_size fixes it
    cfg = with_id_order_counts(cfg)
    true_vocab = check_vocab(cfg, vocab)
    return ModelSpec.of(cfg, padded or _vocab_rules(cfg, true_vocab), true_vocab)
