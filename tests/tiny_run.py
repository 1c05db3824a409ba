"""Overrides for a seconds-long CPU run of `pretrain/configs/tiny.yaml`, shared by every test package
that trains one (`tests/training`, `tests/reliability`, the install test)."""

from __future__ import annotations

from pathlib import Path

# The config's own learning-rate schedule and checkpoint pruning: for runs that do not set them.
CONFIG_SCHEDULE = {
    "train.lr": None,
    "train.min_lr": None,
    "train.lr_warmup_iters": None,
    "train.keep_last": None,
}


def tiny_overrides(data_prefix, tokenizer, out: Path, *, cache: Path | None = None, **extra) -> list[str]:
    """`key=value` overrides: a LEV model of width 32 on the shard `data_prefix`, 6 steps, writing
    under `out` (index cache: `cache`, default beside `out`). `extra` adds or replaces keys; a value
    of None drops the key, leaving the config's own value."""
    base = {
        "data.data_path": f"[{data_prefix}]",
        "data.tokenizer_path": str(tokenizer),
        "data.split": "98,2,0",
        "data.cache_dir": str(cache if cache is not None else Path(out).parent / "index-cache"),
        "model.num_layers": 2,
        "model.hidden_size": 32,
        "model.num_attention_heads": 2,
        "model.seq_length": 32,
        "model.lev.d_seed": 8,
        "model.lev.heads": 2,
        "model.lev.rank": 4,
        "model.lev.kappa": 4,
        "train.micro_batch_size": 2,
        "train.train_iters": 6,
        "train.lr": 3e-3,
        "train.min_lr": 3e-4,
        "train.lr_warmup_iters": 2,
        "train.save": str(Path(out) / "ckpt"),
        "train.keep_last": 2,
        "logging.output_dir": str(out),
        "logging.log_interval": 1,
        "logging.progress_bar": False,
        "logging.tensorboard": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items() if v is not None]
