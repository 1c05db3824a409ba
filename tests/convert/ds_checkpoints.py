"""Tiny real DeepSpeed checkpoints for the conversion tests, saved the way the trainer saves them.

`make_checkpoints` runs in 4 gloo processes: TP=2 x PP=2 (ZeRO-1, fp32) for `tied` and
`lev`, then TP=2 x DP=2 under ZeRO-3 (bf16) for `albert`. Each trains one step on a
fixed batch of real text, records the engine's evaluation loss on held-out text, and
saves through `ckpt.io.save_checkpoint` (config.yaml, `complete`, `latest`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_lev.config import load_config

SEQ = 16
MICRO = 2
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.min_compressed_width=1",  # ALBERT and the MLP baselines at width 8: converters, not a comparison
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    f"model.seq_length={SEQ}",
    "model.lev.d_seed=8",
    "model.lev.heads=2",
    "model.lev.kappa=4",
    "model.lev.rank=4",
    "model.baseline_dim=8",
    "train.seed=11",
    "parallel.partition_method=uniform",
    "model.make_vocab_size_divisible_by=64",
]  # 50,277 pads to 50,304 at TP 1 and 2 alike
PIPELINE_VARIANTS = ("tied", "lev")
ZERO3_VARIANT = "albert"


def run_config(
    embedding: str, tokenizer: str, tp: int, pp: int, zero: int, precision: str = "fp32", extra=()
):
    return load_config(
        None,
        SMALL
        + [
            f"model.embedding={embedding}",
            f"data.tokenizer_path={tokenizer}",
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            f"parallel.zero_stage={zero}",
            f"train.precision={precision}",
            *extra,
        ],
    )


def text_batches(tokenizer_path: str, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two `(MICRO, SEQ + 1)` token batches from real text: (train, held-out)."""
    from megatron_lev.data.tokenizers import build_tokenizer

    ids = build_tokenizer("hf", tokenizer_path).encode(text)
    need = 2 * MICRO * (SEQ + 1)
    assert len(ids) >= need, "the sample text is too short"
    tokens = torch.tensor(ids[:need]).view(2, MICRO, SEQ + 1)
    return tokens[0], tokens[1]


def _ds_config(precision: str, zero: int, dp: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO * dp,
        "zero_optimization": {"stage": zero},
        "steps_per_print": 10**6,
        "gradient_clipping": 1.0,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def make_checkpoints(root: str, tokenizer: str, text: str) -> dict:
    """Collective over 4 ranks; returns {variant: {"eval_loss", "tp", "pp", "zero"}} (same on every rank)."""
    import deepspeed

    from megatron_lev.ckpt.io import save_checkpoint
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import DeepSpeedEngine, disable_cpu_shm_comm
    from megatron_lev.engine.mpu import TensorParallelMPU
    from megatron_lev.parallel import state
    from megatron_lev.plan import model_spec

    disable_cpu_shm_comm()
    train, held_out = text_batches(tokenizer, text)
    results = {}
    layout = state.initialize_model_parallel(2, 2)
    for variant in PIPELINE_VARIANTS:
        cfg = run_config(variant, tokenizer, 2, 2, 1)
        torch.manual_seed(cfg.train.seed)
        model = build_model(model_spec(cfg, 50277, layout.world_size), layout)
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
            config=_ds_config("fp32", 1, 1),
            dist_init_required=False,
        )
        engine.train_batch(iter([((train[:, :-1],), train[:, 1:])]))
        loss = engine.eval_batch(iter([((held_out[:, :-1],), held_out[:, 1:])]))
        save_checkpoint(
            DeepSpeedEngine(engine, None, cfg, pipeline=True, gas=1, layout=layout),
            Path(root) / variant,
            iteration=1,
            client_state={},
            keep_last=2,
            config_yaml=cfg.to_yaml(),
        )
        results[variant] = {"eval_loss": float(loss), "tp": 2, "pp": 2, "zero": 1}

    layout = state.initialize_model_parallel(2, 1)
    cfg = run_config(ZERO3_VARIANT, tokenizer, 2, 1, 3, precision="bf16")
    torch.manual_seed(cfg.train.seed)
    model = build_model(model_spec(cfg, 50277, layout.world_size), layout)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config=_ds_config("bf16", 3, 2),
        mpu=TensorParallelMPU(layout),
        dist_init_required=False,
    )
    dp_rank = layout.dp_rank
    ids = train[:, :-1] if dp_rank == 0 else held_out[:, :-1]
    labels = train[:, 1:] if dp_rank == 0 else held_out[:, 1:]
    loss = engine(ids, labels).mean()
    engine.backward(loss)
    engine.step()
    save_checkpoint(
        DeepSpeedEngine(engine, None, cfg, pipeline=False, gas=1, layout=layout),
        Path(root) / ZERO3_VARIANT,
        iteration=1,
        client_state={},
        keep_last=2,
        config_yaml=cfg.to_yaml(),
    )
    results[ZERO3_VARIANT] = {"tp": 2, "pp": 1, "zero": 3}
    return results
