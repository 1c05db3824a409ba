"""`megatron-lev demo`: the main job end to end on a sample corpus built on this machine."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_lev.demo.pipeline import DEFAULT_CONFIG
    from megatron_lev.model.embeddings import REGISTRY

    parser.add_argument("--out", default="demo_output", help="where every step writes its results")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the run config to train")
    parser.add_argument("--embedding", default="lev", choices=list(REGISTRY), help="input-embedding variant")
    parser.add_argument("--iters", type=int, default=300, help="training steps")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="training processes (default: every GPU, else 2 CPU processes)",
    )
    parser.add_argument("--corpus-mb", type=float, default=12.0, help="size of the sample corpus to build")
    parser.add_argument(
        "--corpus-dir",
        default=None,
        help="use this Pile-format corpus (*.jsonl[.zst]) instead of building one",
    )
    parser.add_argument("--vocab-size", type=int, default=8000, help="SentencePiece vocabulary size")
    parser.add_argument("--force", action="store_true", help="rerun every step, even finished ones")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.demo.pipeline import DemoOptions, run_demo

    opts = DemoOptions(
        out=Path(args.out),
        config=Path(args.config),
        embedding=args.embedding,
        iters=args.iters,
        nproc=args.nproc,
        corpus_mb=args.corpus_mb,
        vocab_size=args.vocab_size,
        corpus_dir=Path(args.corpus_dir) if args.corpus_dir else None,
        force=args.force,
    )
    run_demo(opts)  # bad options and a failed step are one line naming the flag or the step and its log
    return 0
