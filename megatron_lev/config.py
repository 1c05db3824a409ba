"""Typed run configuration: dataclasses loaded from YAML, overridden with dotted keys.

A run is described by one `RunConfig` with five sections (model, parallel, data,
train, logging). `load_config(paths, overrides)` merges YAML files left to right,
applies `section.key=value` overrides, type-checks every value, refuses unknown
keys (with a suggestion), and validates the combination before any heavy work.

The rules here are the generic ones. An embedding variant's own rules belong to its class and
the trainer's to the run: both run in `engine.plan` (`validate_config`, `validate_run`), which
is why this module knows nothing of the model.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_lev.errors import ConfigError, check_choice
from megatron_lev.resources import config_path
from megatron_lev.utils.io import atomic_write_json, atomic_write_text  # noqa: F401  (re-exported)

PRECISIONS = ("fp32", "bf16", "fp16")
LR_DECAY_STYLES = ("cosine", "linear", "constant")
PARTITION_METHODS = ("parameters", "uniform")
TOKENIZER_TYPES = ("hf", "sentencepiece", "tiktoken")
# model.lev.id_order: which token gets which compositional digits (docs/model.md, "Token-id order")
LEV_ID_ORDERS = ("bpe", "random", "frequency")


# --------------------------------------------------------------------------- numeric ranges


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric key: finite, between `lo` and `hi` (None: unbounded)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # True: lo itself is not allowed
    hi_open: bool = False
    why: str = ""  # what the key is, shown with the error
    cap: float | None = None  # a sanity bound far above any real run (refuses typos and absurd values)

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        if self.cap is not None and value > self.cap:
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def text(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        cap = f" and <= {_number(self.cap)}" if self.cap is not None else ""
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}{cap}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo}{cap}"
        return f"{'<' if self.hi_open else '<='} {hi}" if self.hi is not None else f"finite{cap}"


def _number(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else f"{x:g}" if x is not None else ""


def _count(why: str = "", lo: int = 1, cap: int | None = None) -> Range:
    return Range(lo, why=why, cap=cap)


_POSITIVE = Range(0, lo_open=True)
_FRACTION = Range(0, 1, hi_open=True)  # dropout, warmup fraction, Adam betas
_SEED = Range(0, 2**32 - 1, why="seeds of numpy and torch")
# Upper bounds: far above any model this code trains (the 1.2B config has hidden 2048, 16 layers,
# sequences of 2048; the largest published dense models have hidden < 30,000, fewer than 200
# layers, vocabularies of about 256k), so they refuse only typos and absurd values, e.g. a
# hidden size of 2^20 (a 1e12-parameter layer) or an LR of 1e9. The memory estimate
# (`engine.memory`) judges what fits in between.
_K, _M = 1024, 1024 * 1024

# Every int/float key of every section, with the values it may take. A key missing here is a
# bug (tests check the table covers every numeric field). None (where a key allows it) is not checked.
RANGES: dict[str, Range] = {
    "model.num_layers": _count(cap=4 * _K),
    "model.hidden_size": _count("the model width; 2048 for the 1.2B config", cap=64 * _K),
    "model.num_attention_heads": _count(cap=4 * _K),
    "model.num_kv_heads": _count("or null for multi-head attention", cap=4 * _K),
    "model.ffn_hidden_size": _count("or null for the SwiGLU default", cap=256 * _K),
    "model.seq_length": _count("tokens per sample; the memory estimate judges what fits", cap=4 * _M),
    "model.vocab_size": _count("or null to take it from the tokenizer", cap=16 * _M),
    "model.make_vocab_size_divisible_by": _count(cap=64 * _K),
    "model.baseline_dim": _count("or null to size it like LEV", cap=256 * _K),
    "model.baseline_hidden": _count("or null to size it like LEV", cap=256 * _K),
    "model.min_compressed_width": _count("the narrowest width a compressed baseline may have", cap=256 * _K),
    "model.rope_theta": Range(0, lo_open=True, cap=1e12, why="the RoPE base, e.g. 10000"),
    "model.norm_eps": Range(0, lo_open=True, cap=1, why="added to the RMS before dividing, e.g. 1e-5"),
    "model.init_std": Range(
        0, lo_open=True, cap=1, why="standard deviation of the initial weights, e.g. 0.02"
    ),
    "model.hidden_dropout": _FRACTION,
    "model.attention_dropout": _FRACTION,
    "model.checkpoint_num_layers": _count(cap=4 * _K),
    "model.lev.k": _count(cap=64),
    "model.lev.d_seed": _count(cap=64 * _K),
    "model.lev.heads": _count(cap=4 * _K),
    "model.lev.kappa": _count("a quadratic B-spline needs at least 3 knots", lo=3, cap=64 * _K),
    "model.lev.rank": _count(cap=64 * _K),
    "model.lev.chunk_size": _count(cap=64 * _M),
    "model.lev.w_out_init_scale": Range(0, cap=1000, why="multiplies the init std of W_out"),
    "model.lev.seed_init_scale": Range(
        0, lo_open=True, cap=1000, why="multiplies the init std of the codebooks and W_l, e.g. 10"
    ),
    "model.lev.seed_lr_mult": Range(
        0, lo_open=True, cap=1000, why="multiplies the learning rate of the codebooks and W_l, e.g. 0.1"
    ),
    "model.lev.seed_clip_grad": Range(
        0, cap=1e6, why="the seed side's own clipping threshold (0: its own group, never clipped)"
    ),
    "model.lev.centre_reference": Range(
        0, 64 * _M, why="token ids whose mean modes are subtracted (0: off; e.g. 256)"
    ),
    "model.lev.id_order_seed": Range(0, 2**32 - 1, why="the seed of model.lev.id_order=random"),
    "model.input_init_rms": Range(
        0,
        lo_open=True,
        cap=1000,
        why="the input embedding's initial output RMS, or null for each variant's own init",
    ),
    "parallel.tensor_model_parallel_size": _count(cap=4 * _K),
    "parallel.pipeline_model_parallel_size": _count(cap=4 * _K),
    "parallel.zero_stage": Range(0, 3, why="the ZeRO stage 0, 1, 2 or 3"),
    "parallel.collective_timeout_s": Range(
        1, why="seconds the rendezvous and any collective may wait, e.g. 600"
    ),
    "parallel.heartbeat_timeout_s": Range(
        0, why="seconds a rank may stay silent before the job ends; 0 turns the watchdog off"
    ),
    "data.seed": _SEED,
    "data.num_workers": _count("0 loads batches in the training process", lo=0, cap=1024),
    "train.micro_batch_size": _count(cap=64 * _K),
    "train.global_batch_size": _count("or null for micro x DP", cap=64 * _M),
    "train.train_iters": _count("or null with train.train_tokens or train.chinchilla"),
    "train.train_tokens": _count(),
    "train.lr": Range(
        0, lo_open=True, cap=1, why="the peak learning rate: AdamW moves every weight by about lr per step"
    ),
    "train.min_lr": Range(0, cap=1),
    "train.lr_warmup_iters": _count(lo=0),
    "train.lr_warmup_fraction": _FRACTION,
    "train.weight_decay": Range(0, cap=100),
    "train.adam_beta1": _FRACTION,
    "train.adam_beta2": _FRACTION,
    "train.adam_eps": Range(0, lo_open=True, cap=1, why="0 divides by zero for rows without gradient"),
    "train.clip_grad": Range(0, why="0 turns clipping off"),
    "train.seed": _SEED,
    "train.save_interval": _count("0 saves only at the end", lo=0),
    "train.keep_last": _count(),
    "train.eval_interval": _count("0 turns evaluation off", lo=0),
    "train.eval_iters": _count(),
    "train.max_consecutive_skips": _count(),
    "train.max_update_ratio": Range(
        1, lo_open=True, why="how much one update may grow the weight norm, or null to turn the check off"
    ),
    "logging.log_interval": _count(),
    "logging.dynamics_sample_ids": _count(
        "token ids the input table's statistics are over", lo=2, cap=16 * _M
    ),
    "logging.peak_tflops": Range(0, lo_open=True, cap=1e6, why="per device, for MFU"),
}

# String keys that name a file, directory or run: when given, they must not be empty.
NONEMPTY_STRINGS = (
    "model.name",
    "data.tokenizer_path",
    "data.cache_dir",
    "train.ds_config",
    "train.save",
    "train.load",
    "logging.output_dir",
    "logging.wandb_project",
    "logging.wandb_group",
)


def check_ranges(section: Any, prefix: str) -> None:
    """Refuse a numeric value of `section` (keys under `prefix`) outside its `RANGES` rule."""
    for key, rule in RANGES.items():
        if not key.startswith(prefix + "."):
            continue
        value: Any = section
        for part in key[len(prefix) + 1 :].split("."):
            value = getattr(value, part)
        if value is None or rule.contains(value):
            continue
        kind = "an integer" if isinstance(value, int) else "a finite number"
        why = f" ({rule.why})" if rule.why else ""
        raise ConfigError(f"{key}={value!r} is out of range: must be {kind} {rule.text()}{why}")
    for key in NONEMPTY_STRINGS:
        if key.startswith(prefix + ".") and key.count(".") == prefix.count(".") + 1:
            value = getattr(section, key.rsplit(".", 1)[1])
            if value is not None and not str(value).strip():
                raise ConfigError(f"{key} is an empty string: give a value, or null to leave it unset")


def numeric_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Dotted names of every int/float field of the config (for checking `RANGES` is complete)."""
    cls = cls or RunConfig
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        key = _join(prefix, name)
        args = [a for a in (typing.get_args(tp) or (tp,)) if a is not type(None)]
        if dataclasses.is_dataclass(tp):
            keys += numeric_keys(tp, key)
        elif any(a in (int, float) for a in args):
            keys.append(key)
    return keys


# --------------------------------------------------------------------------- sections


@dataclass
class LevConfig:
    """Hyperparameters of the LEV layer (spec: LEV.md, 'The LEV layer, exactly')."""

    k: int = 3  # digits of the compositional index
    d_seed: int = 128  # seed width
    heads: int = 8  # h
    kappa: int = 16  # spline knots
    rank: int = 64  # r of the separable product
    residual: bool = False  # optional `+ W_res z` path of the paper's earlier version
    chunk_size: int = 4096  # unique ids processed per chunk
    recompute: bool = True  # recompute chunks in backward instead of storing activations
    w_out_init_scale: float = 1.0  # multiplies the spec's N(0, 0.02/sqrt(h)) init of W_out
    # multiplies the spec's N(0, 0.02) init of the codebooks and W_l. The LayerNorm after W_l z makes the
    # output depend on their scale only through its eps (1e-5), about the variance of W_l z at the spec's
    # init: a larger scale spreads u over more knots at init, shrinks their gradients (1/scale) and how
    # far one Adam step turns them (lr/scale). Without lev.residual, which reads z directly.
    seed_init_scale: float = 1.0
    # multiplies the learning rate of the codebooks and W_l (the same scale-free seed side): a tenth
    # turns them by lr/0.02 x 0.1 per Adam step. Two optimizer rules the LEV variant puts before
    # train.param_groups (model/embeddings/lev_rules.py), so it applies with any model.embedding in one
    # config file.
    seed_lr_mult: float = 1.0
    # None (the spec): the codebooks and W_l are in the global gradient norm, where they carry most of
    # it (their gradients scale as one over their size) and so decide how much train.clip_grad shrinks
    # every step. A number: they are clipped on their own norm at this threshold and left out of the
    # global norm (0: their own group, never clipped). A clip group the LEV variant puts before
    # train.clip_groups (model/embeddings/lev_rules.py), named `lev_seed`.
    seed_clip_grad: float | None = None
    centred: bool = False  # G = sum_l (M_l - 1) W_out_l: drops the all-ones mode's shared vector
    # > 0: G = sum_l (M_l - mean_R M_l) W_out_l, R this many evenly spaced token ids (reference_ids),
    # recomputed from the current weights at every forward, so the readout stays centred in training
    centre_reference: int = 0
    # token-id order (one of LEV_ID_ORDERS): the digits of token i are those of rank[i], a permutation
    # stored with the model; "bpe": rank[i] = i (the spec), "random": seeded by id_order_seed,
    # "frequency": by count in id_order_counts (a counts.npy; the run plan fills it from data.data_path)
    id_order: str = "bpe"
    id_order_seed: int = 0
    id_order_counts: str | None = None


@dataclass
class ModelConfig:
    name: str = "tiny"
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_kv_heads: int | None = None  # None: multi-head attention; fewer: grouped-query
    ffn_hidden_size: int | None = None  # None: SwiGLU default, 8/3 * hidden rounded to 64
    seq_length: int = 128
    vocab_size: int | None = None  # None: taken from the tokenizer
    make_vocab_size_divisible_by: int = 128  # padded to a multiple of this x TP
    embedding: str = "lev"  # a variant of megatron_lev.model.embeddings.REGISTRY (checked there)
    lev: LevConfig = field(default_factory=LevConfig)
    baseline_dim: int | None = None  # albert/flat_mlp bottleneck e; None: sized to match LEV
    baseline_hidden: int | None = None  # MLP hidden width of the MLP baselines; None: sized to match LEV
    # a compressed baseline narrower than this (code width e or MLP hidden) is refused: a degenerate
    # bottleneck (e = 1) is not a fair comparison; the paper grid allows its parameter-matched widths
    min_compressed_width: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # the input embedding's output RMS over the vocabulary at init (its final linear map rescaled;
    # `InputEmbedding.rescale_output_`); None: each variant's own initialisation
    input_init_rms: float | None = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_checkpointing: bool = False
    checkpoint_num_layers: int = 1

    def validate(self) -> None:
        check_ranges(self, "model")
        self._validate_id_order()
        if self.lev.centred and self.lev.centre_reference:
            raise ConfigError(
                f"model.lev.centred=true and model.lev.centre_reference={self.lev.centre_reference} both "
                "centre LEV's modes: keep one (centre_reference subtracts their mean, centred subtracts 1)"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} must be divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ConfigError(
                "model.hidden_size / model.num_attention_heads = "
                f"{self.hidden_size // self.num_attention_heads} "
                "is odd: rotary position embeddings need an even head width; change either key"
            )
        kv = self.kv_heads
        if self.num_attention_heads % kv:
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )

    def _validate_id_order(self) -> None:
        lev = self.lev
        check_choice("model.lev.id_order", lev.id_order, LEV_ID_ORDERS)
        if lev.id_order_counts is None:
            return
        if lev.id_order != "frequency":
            raise ConfigError(
                f"model.lev.id_order_counts={lev.id_order_counts!r} is set but model.lev.id_order="
                f"{lev.id_order!r}: the counts rank token ids only for id_order=frequency; set "
                "model.lev.id_order=frequency or unset model.lev.id_order_counts"
            )
        if not str(lev.id_order_counts).strip():
            raise ConfigError(
                "model.lev.id_order_counts is an empty string: give a counts.npy, or null to take "
                "<first data.data_path prefix>.counts.npy"
            )

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return int(math.ceil(8 * self.hidden_size / 3 / 64) * 64)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    partition_method: str = "parameters"  # how blocks are split across pipeline stages
    zero_stage: int = 1
    cpu_offload: bool = False  # ZeRO-3 parameter + optimizer offload to CPU
    distributed_backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    # seconds the rendezvous and any collective may wait before every rank stops (docs/training.md)
    collective_timeout_s: float = 600.0
    # seconds a rank may stay silent (no heartbeat) before the watchdog ends the job; 0: no watchdog
    heartbeat_timeout_s: float = 300.0

    def validate(self) -> None:
        check_ranges(self, "parallel")
        check_choice("parallel.partition_method", self.partition_method, PARTITION_METHODS)
        if self.pipeline_model_parallel_size > 1 and self.zero_stage > 1:
            raise ConfigError(
                f"parallel.zero_stage={self.zero_stage} cannot be combined with pipeline parallelism "
                f"(parallel.pipeline_model_parallel_size={self.pipeline_model_parallel_size}): DeepSpeed "
                "shards gradients across micro-batches only with ZeRO 0/1 under a pipeline. "
                "Use parallel.zero_stage=1, or parallel.pipeline_model_parallel_size=1 for ZeRO-2/3."
            )
        if self.cpu_offload and self.zero_stage != 3:
            raise ConfigError("parallel.cpu_offload=true needs parallel.zero_stage=3")
        if 0 < self.heartbeat_timeout_s < 1:
            raise ConfigError(
                f"parallel.heartbeat_timeout_s={self.heartbeat_timeout_s:g} is too short: it must be "
                "at least 1 (seconds; a rank beats every tenth of it), or 0 to turn the watchdog off"
            )
        if self.distributed_backend not in (None, "nccl", "gloo"):
            raise ConfigError(
                f"parallel.distributed_backend must be nccl or gloo, got {self.distributed_backend}"
            )


@dataclass
class DataConfig:
    # Megatron-style blend: ["path/prefix"] or ["0.7", "a_prefix", "0.3", "b_prefix"]
    data_path: list[str] = field(default_factory=list)
    valid_data_path: list[str] = field(default_factory=list)  # separate validation shards (optional)
    split: str = "969,30,1"  # train,valid,test by document when valid_data_path is empty
    tokenizer_type: str = "hf"  # one of TOKENIZER_TYPES
    tokenizer_path: str | None = None
    cache_dir: str | None = None  # index cache; default: beside the data
    seed: int = 1234
    num_workers: int = 0
    # packed documents, split at the tokenizer's EOD id (Megatron-LM / GPT-NeoX semantics; docs/training.md)
    reset_position_ids: bool = False  # positions restart at 0 after every EOD
    reset_attention_mask: bool = False  # attention does not cross documents
    eod_mask_loss: bool = (
        False  # no loss where the input is EOD (the target is the next document's first token)
    )

    def validate(self) -> None:
        check_ranges(self, "data")
        check_choice("data.tokenizer_type", self.tokenizer_type, TOKENIZER_TYPES)
        try:
            weights = [float(p) for p in self.split.split(",")]
        except ValueError:
            raise ConfigError(
                f"data.split={self.split!r} must be comma-separated numbers, e.g. '969,30,1'"
            ) from None
        if len(weights) != 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(
                f"data.split={self.split!r} must be three finite non-negative numbers "
                "train,valid,test with a positive sum, e.g. '969,30,1'"
            )
        _check_blend("data.data_path", self.data_path)
        _check_blend("data.valid_data_path", self.valid_data_path)


def _check_blend(key: str, paths: list[str]) -> None:
    """`[prefix]` or `[weight, prefix, weight, prefix, ...]` with finite weights >= 0, not all zero."""
    example = "e.g. ['0.7', 'a_text_document', '0.3', 'b_text_document']"
    for i, item in enumerate(paths):
        if not str(item).strip():
            raise ConfigError(
                f"{key}[{i}] is an empty string: give a shard prefix such as data/pile_text_document"
            )
    if len(paths) <= 1:
        return
    if len(paths) % 2:
        raise ConfigError(
            f"{key} with several entries must alternate weight and prefix, {example}; got {paths}"
        )
    weights = []
    for i in range(0, len(paths), 2):
        try:
            weight = float(paths[i])
        except ValueError:
            raise ConfigError(
                f"{key}[{i}]={paths[i]!r} is not a weight: a blend alternates weight and prefix, {example}"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{key}[{i}]={paths[i]!r}: a blend weight must be a finite number >= 0")
        weights.append(weight)
    if sum(weights) <= 0:
        raise ConfigError(f"{key}: every blend weight is 0; give at least one positive weight")


@dataclass
class ParamGroupRule:
    """Optimizer settings for the parameters whose canonical name matches `pattern` (a shell-style
    glob such as `embedding.*` or `embedding.out_proj`); the first matching rule of
    `train.param_groups` applies."""

    pattern: str = ""
    lr_mult: float = 1.0  # the group's learning rate is the schedule's times this
    weight_decay: float | None = None  # its matrices' decay (1-D, norms, biases: 0); None: train.weight_decay
    adam_eps: float | None = None  # None: train.adam_eps


GLOBAL_CLIP_GROUP = "global"  # every parameter no clip group names


@dataclass
class ClipGroupRule:
    """The parameters whose canonical name matches one of `patterns` (shell-style globs) are clipped on
    their own gradient norm at `max_norm` and left out of the global norm; the first matching rule of
    `train.clip_groups` takes a parameter."""

    name: str = ""  # an identifier, logged as clip_factor/<name> and grad_norm/clip/<name>
    patterns: list[str] = field(default_factory=list)
    max_norm: float | None = None  # None: train.clip_grad; 0: never clipped (still out of the global norm)


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # None: micro_batch_size x DP (no accumulation)
    train_iters: int | None = 100
    train_tokens: int | None = None  # token budget; converted to iterations
    chinchilla: bool = False  # token budget = 20 tokens per parameter
    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int | None = None
    lr_warmup_fraction: float = 0.01
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "fp32"
    seed: int = 1234
    ds_config: str | None = None  # a template path, or a name in ds_configs/ (packaged); None: by zero_stage
    save: str | None = None  # checkpoint directory
    load: str | None = None  # checkpoint directory to resume from (default: save)
    save_interval: int = 0  # 0: only at the end
    save_initial: bool = False  # also save the initial weights (iteration 0), e.g. for `geometry`
    keep_last: int = 2
    eval_interval: int = 0
    eval_iters: int = 10
    max_consecutive_skips: int = 10  # non-finite steps in a row before the run stops
    max_update_ratio: float | None = 2.0  # an update growing the global weight norm more stops the run
    callbacks: list[str] = field(default_factory=list)  # extra trainer callbacks, "module:Class"
    param_groups: list[ParamGroupRule] = field(default_factory=list)  # per-pattern lr/decay/eps
    clip_groups: list[ClipGroupRule] = field(default_factory=list)  # clipped on their own norm

    def validate(self) -> None:
        check_ranges(self, "train")
        for i, spec in enumerate(self.callbacks):
            module, colon, name = spec.partition(":")
            if not colon or not all(p.isidentifier() for p in (*module.split("."), *name.split("."))):
                raise ConfigError(
                    f"train.callbacks[{i}]={spec!r} must be 'module:Class' (an importable module and a "
                    "Callback class in it), e.g. 'my_probes.grad:GradProbe'"
                )
        for i, rule in enumerate(self.param_groups):
            key = f"train.param_groups[{i}]"
            if not rule.pattern.strip():
                raise ConfigError(f"{key}.pattern is empty: give a glob of parameter names, e.g. embedding.*")
            if not rule.lr_mult > 0:
                raise ConfigError(f"{key}.lr_mult={rule.lr_mult} must be > 0 (it scales the learning rate)")
            if rule.weight_decay is not None and rule.weight_decay < 0:
                raise ConfigError(f"{key}.weight_decay={rule.weight_decay} must be >= 0 (0 exempts them)")
            if rule.adam_eps is not None and not rule.adam_eps > 0:
                raise ConfigError(f"{key}.adam_eps={rule.adam_eps} must be > 0")
        seen: set[str] = set()
        for i, rule in enumerate(self.clip_groups):
            key = f"train.clip_groups[{i}]"
            if not rule.name.isidentifier() or rule.name == GLOBAL_CLIP_GROUP:
                raise ConfigError(
                    f"{key}.name={rule.name!r} must be an identifier other than '{GLOBAL_CLIP_GROUP}', "
                    "e.g. 'head'"
                )
            if rule.name in seen:
                raise ConfigError(f"{key}.name={rule.name!r} names two clip groups: give each its own name")
            seen.add(rule.name)
            if not rule.patterns or not all(p.strip() for p in rule.patterns):
                raise ConfigError(
                    f"{key}.patterns is empty: give globs of parameter names, e.g. [embedding.*]"
                )
            if rule.max_norm is not None and not (0 <= rule.max_norm < math.inf):
                raise ConfigError(
                    f"{key}.max_norm={rule.max_norm} must be a finite number >= 0 (0: never clipped; "
                    "leave it out for train.clip_grad)"
                )
        check_choice("train.precision", self.precision, PRECISIONS)
        check_choice("train.lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        if self.train_iters is None and self.train_tokens is None and not self.chinchilla:
            raise ConfigError("set one of train.train_iters, train.train_tokens or train.chinchilla=true")
        if self.min_lr > self.lr:
            raise ConfigError(
                f"train.min_lr={self.min_lr} is above train.lr={self.lr}: the schedule decays "
                "from lr to min_lr, so min_lr must be <= lr"
            )

    def clip_group_rules(self) -> list[ClipGroupRule]:
        """`train.clip_groups`, each with its threshold resolved (`train.clip_grad` where a rule gives
        none). A model variant's own clip groups go before them (`engine.plan.clip_group_rules`)."""
        return [
            ClipGroupRule(
                rule.name, list(rule.patterns), self.clip_grad if rule.max_norm is None else rule.max_norm
            )
            for rule in self.clip_groups
        ]


@dataclass
class LoggingConfig:
    log_interval: int = 10
    output_dir: str = "runs/default"  # resolved config, logs and TensorBoard go here
    tensorboard: bool = True
    log_all_ranks: bool = False  # every rank also writes logs/rank{N}.log
    peak_tflops: float = 989.0  # per device, for MFU (H100 dense bf16)
    progress_bar: bool = True
    # per log line: gradient/update norms per group and input-layer tensor, the input table's shape
    # (training.dynamics); measuring a step keeps a copy of the rank's master weights meanwhile
    train_dynamics: bool = True
    dynamics_sample_ids: int = 1024  # token ids the input table's statistics are over
    wandb_project: str | None = None  # mirror the logged values to Weights & Biases (needs `wandb`)
    wandb_group: str | None = None
    wandb_mode: str = "online"  # "offline": write the run under output_dir/wandb, `wandb sync` it later

    def validate(self) -> None:
        check_ranges(self, "logging")
        if self.wandb_mode not in ("online", "offline"):
            raise ConfigError(f"logging.wandb_mode={self.wandb_mode!r}: must be 'online' or 'offline'")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, world_size: int | None = None) -> RunConfig:
        """Check every section and the combinations; `world_size` adds the layout checks.

        The generic rules only: the embedding variant's own rules belong to its class and run with
        these in `engine.plan.validate_config` / `validate_run`."""
        if world_size is not None and (
            isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1
        ):
            raise ConfigError(
                f"world size {world_size!r} is out of range: must be an integer >= 1 "
                "(the number of processes)"
            )
        for section in (self.model, self.parallel, self.data, self.train, self.logging):
            section.validate()
        m, p, t = self.model, self.parallel, self.train
        tp = p.tensor_model_parallel_size
        if m.num_attention_heads % tp:
            raise ConfigError(
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                f"parallel.tensor_model_parallel_size={tp}: choose a TP size that divides the heads"
            )
        if m.kv_heads % tp:
            raise ConfigError(
                f"model.num_kv_heads={m.kv_heads} is not divisible by "
                f"parallel.tensor_model_parallel_size={tp}"
            )
        if m.ffn_size % tp:
            raise ConfigError(
                f"model ffn size {m.ffn_size} is not divisible by parallel.tensor_model_parallel_size={tp}"
            )
        if p.pipeline_model_parallel_size > m.num_layers:
            raise ConfigError(
                f"parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size} exceeds "
                f"model.num_layers={m.num_layers}: every pipeline stage needs at least one block"
            )
        if t.precision == "bf16" and p.pipeline_model_parallel_size > 1 and p.zero_stage == 0:
            raise ConfigError(
                "train.precision=bf16 with pipeline parallelism needs parallel.zero_stage=1 "
                "(DeepSpeed cannot reload bf16 + pipeline + ZeRO-0 optimizer state)"
            )
        if world_size is not None:
            mp = tp * p.pipeline_model_parallel_size
            if world_size % mp:
                raise ConfigError(
                    f"world size {world_size} is not divisible by tensor x pipeline = {tp} x "
                    f"{p.pipeline_model_parallel_size} = {mp}: world = TP x PP x DP"
                )
            dp = world_size // mp
            if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
                raise ConfigError(
                    f"train.global_batch_size={t.global_batch_size} is not divisible by "
                    f"train.micro_batch_size x DP = {t.micro_batch_size} x {dp}: change the global "
                    "batch or the micro-batch so that gradient accumulation is a whole number"
                )
        return self

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (
            self.parallel.tensor_model_parallel_size * self.parallel.pipeline_model_parallel_size
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the resolved config as `config.yaml` atomically; returns the path."""
        path = Path(directory) / "config.yaml"
        atomic_write_text(path, self.to_yaml())
        return path


# --------------------------------------------------------------------------- loading


def load_config(
    paths: str | os.PathLike | list | None = None,
    overrides: list[str] | None = None,
    world_size: int | None = None,
    validate: bool = True,
) -> RunConfig:
    """Merge YAML files (later wins), apply dotted overrides, type-check, validate (the generic
    rules; `validate=False` leaves that to the caller, e.g. `engine.plan.validate_run`).

    A path that does not exist is looked up among the packaged configs (`tiny.yaml`,
    `pretrain/configs/models/200m.yaml`): see `megatron_lev.resources`.
    """
    if paths is None:
        paths = []
    elif isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    merged: dict[str, Any] = {}
    for path in paths:
        _deep_merge(merged, _read_tree(config_path(path), ()))
    given = set()
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(merged, key, value)
        given.add(key)
    cfg = from_dict(RunConfig, merged, prefix="")
    _check_length_override(cfg, given)
    if validate:
        cfg.validate(world_size)
    return cfg


def _check_length_override(cfg: RunConfig, given: set[str]) -> None:
    """An override of train.train_iters that a token budget of the config file would silently outrank
    (training/schedule.py: chinchilla, then train_tokens, then train_iters) is refused."""
    t = cfg.train
    if "train.train_iters" not in given or t.train_iters is None:
        return
    if t.chinchilla and "train.chinchilla" not in given:
        raise ConfigError(
            f"train.train_iters={t.train_iters} would be ignored: the config sets train.chinchilla=true, "
            "which decides the run's length; add train.chinchilla=false"
        )
    if t.train_tokens is not None and "train.train_tokens" not in given:
        raise ConfigError(
            f"train.train_iters={t.train_iters} would be ignored: the config sets "
            f"train.train_tokens={t.train_tokens}, which decides the run's length; add "
            "train.train_tokens=null (or give the length as train.train_tokens)"
        )


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (YAML would keep the last
    silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in the same mapping; keep one",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, included_by: Path | None = None) -> dict:
    """The top-level mapping of one YAML file; every way it can be unusable is one line naming it."""
    where = f"{path} (included by {included_by})" if included_by else str(path)
    if path.is_dir():
        raise ConfigError(f"{where} is a directory: give a YAML config file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if included_by:
            raise ConfigError(
                f"{included_by}: included file not found: {path}; fix the 'include' entry "
                "(relative paths are relative to the including file)"
            ) from None
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot read the config file ({exc.strerror}); check the path and its permissions"
        ) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{where} is not a UTF-8 text file (byte 0x{raw[exc.start]:02x} at offset {exc.start}): "
            "give a YAML config file"
        ) from None
    if "\0" in text:
        raise ConfigError(f"{where} is binary (it contains NUL bytes): give a YAML config file")
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(exc.problem or exc.context or "syntax error").split())
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: invalid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        raise ConfigError(
            f"{where} is empty: give config sections such as 'model:' and 'train:', or leave the file out"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _read_tree(path: Path, chain: tuple[Path, ...], included_by: Path | None = None) -> dict:
    """One file's mapping merged over its includes (earlier includes first, the file itself last).

    `chain` holds the files that include this one, so a cycle is named instead of recursing forever.
    """
    data = _read_yaml(path, included_by)
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) and i.strip() for i in includes):
        raise ConfigError(f"{path}: 'include' must be a file name or a list of file names, got {includes!r}")
    merged: dict[str, Any] = {}
    stack = (*chain, path)
    for inc in includes:
        target = path.parent / inc
        if any(_same_file(target, p) for p in stack):
            cycle = " -> ".join(str(p) for p in (*stack, target))
            raise ConfigError(f"include cycle: {cycle}; remove the include that closes the loop")
        _deep_merge(merged, _read_tree(target, stack, included_by=path))
    return _deep_merge(merged, data)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def parse_override(item: str) -> tuple[str, Any]:
    """`model.lev.k=4` -> ("model.lev.k", 4); values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. model.embedding=lev")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or "." not in key:
        raise ConfigError(f"override {item!r}: the key must be dotted, e.g. train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def from_dict(cls, data: Any, prefix: str):
    """Build dataclass `cls` from a mapping, checking keys and types; errors name the key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}: {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"; did you mean '{_join(prefix, close[0])}'?" if close else ""
        raise ConfigError(
            f"unknown config key '{_join(prefix, key)}'{hint} (allowed: {', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, _join(prefix, name))
    return cls(**kwargs)


def _coerce(tp, value, key):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for arg in non_none:
            try:
                return _coerce(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin is list:
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__}: {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        ):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value


def _deep_merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v
    return dst


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: '{part}' is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else str(name)
