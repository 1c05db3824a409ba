"""DeepSpeed JSON from a template (packaged copies of `ds_configs/`) plus the run's own settings.

The run config is the single source of truth for batch sizes, clipping, precision
and the ZeRO stage: they are written into the template, and a template that sets a
different value is refused (instead of DeepSpeed silently training something else).
Combinations DeepSpeed cannot run are refused here, at start, with what to change.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from megatron_lev.config import RunConfig, set_dotted
from megatron_lev.errors import ConfigError
from megatron_lev.parallel.layout import data_parallel_size as layout_dp
from megatron_lev.resources import DS_CONFIG_DIR, ds_config_template

# keys the run builds itself; a template must not carry them
_FORBIDDEN = {
    "optimizer": "the optimizer is AdamW built from train.lr/adam_beta1/adam_beta2/adam_eps/weight_decay",
    "scheduler": "the learning rate follows train.lr_decay_style/lr_warmup_iters/min_lr",
    "train_micro_batch_size_per_gpu": None,
    "gradient_accumulation_steps": None,
    "train_batch_size": None,
}


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    """DP of a run of `world_size` processes under `cfg`'s TP and PP (`parallel.layout`'s rule)."""
    p = cfg.parallel
    return layout_dp(world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)


def batch_layout(cfg: RunConfig, world_size: int) -> tuple[int, int, int]:
    """(micro batch per rank, gradient accumulation steps, global batch in sequences)."""
    dp = data_parallel_size(cfg, world_size)
    micro = cfg.train.micro_batch_size
    global_batch = cfg.train.global_batch_size or micro * dp
    if global_batch % (micro * dp):
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size x DP = "
            f"{micro} x {dp}: change the global batch or the micro-batch"
        )
    return micro, global_batch // (micro * dp), global_batch


def default_template(cfg: RunConfig) -> Path:
    """The template chosen by parallel.zero_stage / parallel.cpu_offload / train.precision."""
    p, t = cfg.parallel, cfg.train
    if p.pipeline_model_parallel_size > 1 and t.precision == "bf16":
        name = "bf16_pipeline.json"
    elif p.cpu_offload:
        name = "zero3_offload.json"
    elif p.zero_stage == 0:
        name = "fp32.json" if t.precision == "fp32" else "zero0.json"
    else:
        name = f"zero{p.zero_stage}.json"
    return DS_CONFIG_DIR / name


def resolve_template_path(name: str) -> Path:
    """A path as given, else the packaged template of that name (`zero2`, `zero2.json`)."""
    path = ds_config_template(name)
    if path is None:
        known = ", ".join(sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json")))
        raise ConfigError(
            f"train.ds_config={name!r}: no such file, and no packaged template of that name "
            f"(packaged: {known})"
        )
    return path


def load_template(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object")
    return data


def _get(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _offloads(template: dict) -> bool:
    zero = template.get("zero_optimization", {})
    return any(
        isinstance(zero.get(k), dict) and zero[k].get("device", "none") != "none"
        for k in ("offload_param", "offload_optimizer")
    )


def build_ds_config(
    cfg: RunConfig, world_size: int, template: dict | None = None, source: str = "template"
) -> dict[str, Any]:
    """Fill `template` (default: chosen from the run config) with the run's settings; refuse conflicts."""
    if template is None:
        path = resolve_template_path(cfg.train.ds_config) if cfg.train.ds_config else default_template(cfg)
        template, source = load_template(path), str(path)
    out = copy.deepcopy(template)
    for key, why in _FORBIDDEN.items():
        if key in out and why:
            raise ConfigError(f"{source}: remove the '{key}' block: {why}")
    micro, gas, global_batch = batch_layout(cfg, world_size)
    t, p = cfg.train, cfg.parallel
    required: dict[str, tuple[Any, str]] = {  # ds key -> (value, run key it comes from)
        "train_micro_batch_size_per_gpu": (micro, "train.micro_batch_size"),
        "gradient_accumulation_steps": (gas, "train.global_batch_size / (micro_batch_size x DP)"),
        "train_batch_size": (global_batch, "train.global_batch_size"),
        "bf16.enabled": (t.precision == "bf16", "train.precision"),
        "fp16.enabled": (t.precision == "fp16", "train.precision"),
        "zero_optimization.stage": (p.zero_stage, "parallel.zero_stage"),
    }
    if t.precision == "bf16" and p.pipeline_model_parallel_size > 1:
        required["data_types.grad_accum_dtype"] = ("fp32", "train.precision=bf16 with pipeline parallelism")
    for key, (value, origin) in required.items():
        have = _get(out, key)
        if have is not None and have != value:
            raise ConfigError(
                f"{source}: '{key}': {have!r} conflicts with the run's {origin} (= {value!r}); "
                "remove the key from the DeepSpeed template (the run fills it) or change the run config"
            )
        set_dotted(out, key, value, what=f"{source}: key")
    # the project clips (engine.clipping), with the true norm in every layout: DeepSpeed does not. A
    # template may still say the run's own threshold (as templates did before), never another one.
    have = _get(out, "gradient_clipping")
    if have is not None and float(have) not in (0.0, float(t.clip_grad)):
        raise ConfigError(
            f"{source}: 'gradient_clipping': {have!r} conflicts with the run's train.clip_grad "
            f"(= {float(t.clip_grad)!r}); remove the key from the DeepSpeed template (the run clips "
            "with train.clip_grad and train.clip_groups) or change the run config"
        )
    out["gradient_clipping"] = 0.0
    if _offloads(out) and not p.cpu_offload:
        raise ConfigError(
            f"{source} offloads to CPU but parallel.cpu_offload=false: set "
            "parallel.cpu_offload=true (with parallel.zero_stage=3) or use another template"
        )
    if p.cpu_offload and not _offloads(out):
        set_dotted(out, "zero_optimization.offload_param", {"device": "cpu"}, what=f"{source}: key")
        set_dotted(out, "zero_optimization.offload_optimizer", {"device": "cpu"}, what=f"{source}: key")
    if p.cpu_offload:
        out["zero_force_ds_cpu_optimizer"] = False  # we pass torch's AdamW, not DeepSpeedCPUAdam
    out["zero_allow_untested_optimizer"] = True  # our AdamW subclass (optim.GuardedAdamW)
    if t.precision == "fp16":
        fp16 = out["fp16"]
        fp16.setdefault("loss_scale", 0)  # dynamic
        fp16.setdefault("initial_scale_power", 16)
    return out
