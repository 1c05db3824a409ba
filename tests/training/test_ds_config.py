"""DeepSpeed JSON is filled from the run config; conflicting templates and impossible combinations are
refused."""

from __future__ import annotations

import json

import pytest

from megatron_lev.config import RunConfig, load_config
from megatron_lev.errors import ConfigError
from megatron_lev.plan import check_vocab, validate_run
from megatron_lev.plan.ds_config import DS_CONFIG_DIR, batch_layout, build_ds_config, default_template


def _cfg(**over) -> RunConfig:
    items = {"data.data_path": "[data/x_text_document]", "data.tokenizer_path": "tok.json", **over}
    return load_config(None, [f"{k}={v}" for k, v in items.items()], validate=False)


def test_every_shipped_template_is_valid_json_without_run_owned_keys():
    names = sorted(p.name for p in DS_CONFIG_DIR.glob("*.json"))
    assert {
        "zero1.json",
        "zero2.json",
        "zero3.json",
        "zero3_offload.json",
        "bf16_pipeline.json",
        "fp32.json",
    } <= set(names)
    for name in names:
        data = json.loads((DS_CONFIG_DIR / name).read_text())
        assert "optimizer" not in data and "train_batch_size" not in data, name


@pytest.mark.parametrize(
    "over,expected",
    [
        ({"parallel.zero_stage": 1}, "zero1.json"),
        ({"parallel.zero_stage": 2}, "zero2.json"),
        ({"parallel.zero_stage": 3}, "zero3.json"),
        ({"parallel.zero_stage": 3, "parallel.cpu_offload": "true"}, "zero3_offload.json"),
        ({"parallel.zero_stage": 0}, "fp32.json"),
        ({"parallel.zero_stage": 0, "train.precision": "bf16"}, "zero0.json"),
        ({"parallel.pipeline_model_parallel_size": 2, "train.precision": "bf16"}, "bf16_pipeline.json"),
    ],
)
def test_template_is_chosen_by_stage_precision_and_pipeline(over, expected):
    assert default_template(_cfg(**over)).name == expected


def test_batch_sizes_clipping_precision_and_stage_come_from_the_run():
    cfg = _cfg(
        **{
            "train.micro_batch_size": 2,
            "train.global_batch_size": 16,
            "train.clip_grad": 0.5,
            "parallel.zero_stage": 2,
            "train.precision": "bf16",
        }
    )
    ds = build_ds_config(cfg, world_size=4)
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2  # 16 / (2 x DP 4)
    assert ds["train_batch_size"] == 16
    assert ds["gradient_clipping"] == 0.0  # the project clips with train.clip_grad (engine.clipping)
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert ds["zero_optimization"]["stage"] == 2
    assert batch_layout(cfg, 4) == (2, 2, 16)


def test_bf16_pipeline_gets_fp32_gradient_accumulation():
    cfg = _cfg(
        **{"parallel.pipeline_model_parallel_size": 2, "train.precision": "bf16", "model.num_layers": 2}
    )
    ds = build_ds_config(cfg, world_size=2)
    assert ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert ds["zero_optimization"]["stage"] == 1


def test_cpu_offload_is_filled_and_uses_torch_adamw():
    ds = build_ds_config(_cfg(**{"parallel.zero_stage": 3, "parallel.cpu_offload": "true"}), world_size=2)
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize(
    "template,message",
    [
        ({"train_micro_batch_size_per_gpu": 8}, "remove the key"),
        ({"bf16": {"enabled": True}}, "train.precision"),
        ({"zero_optimization": {"stage": 3}}, "parallel.zero_stage"),
        ({"gradient_clipping": 0.3}, "train.clip_grad"),
        ({"optimizer": {"type": "Adam"}}, "remove the 'optimizer' block"),
        ({"scheduler": {"type": "WarmupLR"}}, "remove the 'scheduler' block"),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
            "parallel.cpu_offload=true",
        ),
    ],
)
def test_a_template_that_disagrees_with_the_run_is_refused(template, message):
    cfg = _cfg(**{"train.micro_batch_size": 4, "parallel.zero_stage": 1})
    with pytest.raises(ConfigError, match=message):
        build_ds_config(cfg, world_size=2, template=template, source="my.json")


def test_a_template_with_the_run_s_own_clipping_is_accepted_and_deepspeed_clips_nothing():
    cfg = _cfg(**{"train.micro_batch_size": 4, "parallel.zero_stage": 1, "train.clip_grad": 0.5})
    for value in (0.5, 0.0):
        ds = build_ds_config(cfg, world_size=2, template={"gradient_clipping": value}, source="my.json")
        assert ds["gradient_clipping"] == 0.0


def test_a_template_that_agrees_is_accepted():
    cfg = _cfg(**{"train.micro_batch_size": 4, "parallel.zero_stage": 1})
    ds = build_ds_config(
        cfg, 2, template={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}
    )
    assert ds["train_batch_size"] == 8


def test_ds_config_file_by_name_and_missing_file():
    assert (
        build_ds_config(_cfg(**{"train.ds_config": "zero2", "parallel.zero_stage": 2}), 2)[
            "zero_optimization"
        ]["stage"]
        == 2
    )
    with pytest.raises(ConfigError, match="no such file"):
        build_ds_config(_cfg(**{"train.ds_config": "nope.json"}), 2)


@pytest.mark.parametrize(
    "over,world,cuda,message",
    [
        (
            {"parallel.pipeline_model_parallel_size": 2, "parallel.zero_stage": 2},
            2,
            False,
            "cannot be combined with pipeline parallelism",
        ),
        (
            {"parallel.pipeline_model_parallel_size": 2, "parallel.zero_stage": 0, "train.precision": "bf16"},
            2,
            False,
            "needs parallel.zero_stage=1",
        ),
        ({"train.micro_batch_size": 4, "train.global_batch_size": 12}, 2, False, "not divisible"),
        ({"train.precision": "fp16"}, 1, False, "fp16 needs CUDA"),
        ({"train.chinchilla": "true", "train.train_tokens": 1000}, 1, False, "keep one"),
        ({"train.eval_interval": 10, "data.split": "100,0,0"}, 1, False, "no validation part"),
        ({"data.data_path": "[]"}, 1, False, "data.data_path is empty"),
        ({"parallel.distributed_backend": "nccl"}, 1, False, "needs CUDA"),
        ({"parallel.tensor_model_parallel_size": 2}, 3, False, "not divisible by tensor x pipeline"),
    ],
)
def test_impossible_combinations_are_refused_with_what_to_change(over, world, cuda, message):
    with pytest.raises(ConfigError, match=message):
        validate_run(_cfg(**over), world, cuda=cuda)


def test_a_sound_config_validates_and_the_plan_carries_what_it_derived():
    cfg = _cfg(**{"parallel.zero_stage": 3, "train.global_batch_size": 8, "train.micro_batch_size": 2})
    plan = validate_run(cfg, 2, cuda=False)
    assert (plan.micro_batch, plan.gas, plan.global_batch) == batch_layout(cfg, 2) == (2, 2, 8)
    assert plan.ds_config == build_ds_config(cfg, 2)
    assert (plan.true_vocab, plan.padded_vocab) == (None, None)  # until the tokenizer is read
    plan = plan.with_vocab(50277)
    assert (plan.true_vocab, plan.padded_vocab, plan.tokenizer_vocab) == (50277, 50304, 50277)
    assert validate_run(cfg, 2, cuda=False, tokenizer_vocab=50277) == plan
    # model.vocab_size fixes the vocabulary before the tokenizer is read
    fixed = validate_run(_cfg(**{"model.vocab_size": 50304}), 1, cuda=False)
    assert (fixed.true_vocab, fixed.padded_vocab) == (50304, 50304)
    assert fixed.with_vocab(50277).padded_vocab == 50304
    with pytest.raises(ConfigError, match="smaller than the tokenizer's vocabulary"):
        fixed.with_vocab(50305)


def test_model_vocab_must_cover_the_tokenizer():
    assert check_vocab(_cfg(), 50277) == 50277
    assert check_vocab(_cfg(**{"model.vocab_size": 50304}), 50277) == 50304
    with pytest.raises(ConfigError, match="smaller than the tokenizer's vocabulary"):
        check_vocab(_cfg(**{"model.vocab_size": 32000}), 50277)
