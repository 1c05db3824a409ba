"""`megatron-lev build-indices`: prebuild the cached sample indices of a run offline (no GPUs needed)."""

from __future__ import annotations

import argparse
import time

from megatron_lev.commands.config_cmd import add_config_arguments, config_files_and_overrides
from megatron_lev.config import load_config
from megatron_lev.errors import ConfigError, UserError
from megatron_lev.plan import validate_config
from megatron_lev.plan.ds_config import data_parallel_size


class FlagError(UserError):
    exit_code = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--num-samples",
        type=int,
        nargs=3,
        default=None,
        metavar=("TRAIN", "VALID", "TEST"),
        help="samples per split (default: from train_iters, eval_interval, eval_iters and the global batch)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="processes of the run (sets the global batch when train.global_batch_size is unset)",
    )


def samples_from_config(cfg, world_size: int) -> tuple[int, int, int]:
    """The sample counts a run draws: train_iters x global batch; evaluation likewise."""
    t = cfg.train
    gbs = t.global_batch_size or t.micro_batch_size * data_parallel_size(cfg, world_size)
    if t.train_iters is None:
        raise ConfigError("train.train_iters is not set: pass --num-samples TRAIN VALID TEST")
    evals = t.train_iters // t.eval_interval + 1 if t.eval_interval else 1
    return t.train_iters * gbs, evals * t.eval_iters * gbs, t.eval_iters * gbs


def main(args: argparse.Namespace) -> int:
    from megatron_lev.data.gpt_dataset import build_train_valid_test_datasets

    if args.world_size < 1:
        raise FlagError(f"--world-size must be >= 1, got {args.world_size}")
    if args.num_samples and any(n < 0 for n in args.num_samples):
        raise FlagError(f"--num-samples must be non-negative, got {' '.join(map(str, args.num_samples))}")
    files, overrides = config_files_and_overrides(args)
    cfg = validate_config(load_config(files, overrides, validate=False), args.world_size)
    num = tuple(args.num_samples) if args.num_samples else samples_from_config(cfg, args.world_size)
    start = time.monotonic()
    splits = build_train_valid_test_datasets(cfg.data, cfg.model.seq_length, num)
    for name, ds, n in zip(("train", "valid", "test"), splits, num):
        print(
            f"{name:>5}: {'empty' if ds is None else f'{len(ds):,} samples'} (asked {n:,}) of "
            f"{cfg.model.seq_length}+1 tokens"
        )
    print(f"indices ready in {time.monotonic() - start:.1f} s")
    return 0
