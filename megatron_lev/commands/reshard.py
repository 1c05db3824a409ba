"""`megatron-lev reshard`: rewrite a training checkpoint for another TP / PP / DP layout, offline on CPU."""

from __future__ import annotations

import argparse

from megatron_lev.commands.args import add_checkpoint_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(parser)
    parser.add_argument("out", help="a new save directory for the resharded checkpoint")
    parser.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    parser.add_argument("--pp", type=int, required=True, help="target pipeline-parallel size")
    parser.add_argument(
        "--dp",
        type=int,
        default=1,
        help="target data-parallel size (DeepSpeed checks it when ZeRO state is loaded)",
    )
    parser.add_argument(
        "--skip-validation",
        action="store_true",
        help="do not reload the result and compare its loss with the source model's",
    )
    parser.add_argument(
        "--drop-optimizer",
        action="store_true",
        help="restart Adam's moments from zero instead of carrying them (needed for ZeRO-3 sources)",
    )


def main(args: argparse.Namespace) -> int:
    from megatron_lev.convert.reshard import reshard
    from megatron_lev.log import setup_logging

    setup_logging()
    tag_dir, ref, got = reshard(
        args.checkpoint,
        args.out,
        args.tp,
        args.pp,
        args.dp,
        tag=args.tag,
        config=args.config,
        validate=not args.skip_validation,
        optimizer=not args.drop_optimizer,
    )
    if ref is not None:
        print(
            f"validation passed: loss {got:.6f} after reloading at TP={args.tp} PP={args.pp} DP={args.dp} "
            f"(source {ref:.6f})"
        )
    moments = "Adam moments restart from zero" if args.drop_optimizer else "Adam moments and step carried"
    print(f"wrote {tag_dir} (model weights, iteration and client state; {moments})")
    line = _batch_note(tag_dir)
    if line:
        print(line)
    return 0


def _batch_note(tag_dir) -> str | None:
    """How a run resuming the result makes the source's global batch (it keeps it)."""
    from megatron_lev.ckpt.record import saved_batch

    saved = saved_batch(tag_dir)
    if saved is None:
        return None
    g, m, dp = saved.global_batch, saved.micro_batch, saved.data_parallel_size
    if g % (m * dp) == 0:
        return (
            f"a run resuming it keeps the global batch of {g} sequences: micro-batch {m} x DP {dp} x "
            f"gradient accumulation {g // (m * dp)}"
        )
    micros = [d for d in range(1, g // dp + 1) if g % dp == 0 and (g // dp) % d == 0]
    fix = (
        f"resume it with train.micro_batch_size={micros[-1]} --allow-change train.micro_batch_size"
        if micros
        else f"resume it with train.global_batch_size=N (a multiple of {m * dp}) --allow-change "
        "train.global_batch_size"
    )
    return (
        f"note: the run's global batch of {g} sequences is not a multiple of micro-batch {m} x DP {dp}: {fix}"
    )
