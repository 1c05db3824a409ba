"""`megatron-lev convert`: a training checkpoint (any layout) -> a validated Hugging Face Llama directory."""

from __future__ import annotations

import argparse
import sys

from megatron_lev.commands.args import add_checkpoint_arguments
from megatron_lev.convert.hf_export import DTYPES, ExportError, export_to_hf
from megatron_lev.convert.validate import ValidationError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_arguments(parser)
    parser.add_argument("out", help="the Hugging Face model directory to write")
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenizer file (default: data.tokenizer_path of the config)",
    )
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="dtype of the exported weights")
    parser.add_argument(
        "--max-shard-size",
        type=float,
        default=5.0,
        metavar="GB",
        help="largest safetensors shard; bigger models get an index",
    )
    parser.add_argument(
        "--skip-validation",
        action="store_true",
        help="do not compare the exported model's logits with the source model's",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument(
        "--keep-lev",
        action="store_true",
        help="keep the LEV input layer (loaded with trust_remote_code=True) instead of a dense table",
    )
    parser.add_argument(
        "--allow-tokenizer-change",
        action="store_true",
        help="export with a tokenizer file other than the one the checkpoint records it was trained with",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.log import setup_logging

    setup_logging()
    if args.max_shard_size <= 0 or args.max_shard_size != args.max_shard_size:
        raise ExportError(f"--max-shard-size must be a positive number of GB, got {args.max_shard_size}")
    try:
        result = export_to_hf(
            args.checkpoint,
            args.out,
            tag=args.tag,
            config=args.config,
            tokenizer=args.tokenizer,
            dtype=args.dtype,
            validate=not args.skip_validation,
            max_shard_bytes=int(args.max_shard_size * 1024**3),
            overwrite=args.overwrite,
            progress=not args.no_progress,
            keep_lev=args.keep_lev,
            allow_tokenizer_change=args.allow_tokenizer_change,
        )
    except ValidationError as exc:
        if getattr(args, "debug", False):
            raise
        print(f"megatron-lev convert: error: VALIDATION FAILED: {exc}", file=sys.stderr)
        return 1
    if result.report is not None:
        print(result.report.summary())
    else:
        print("validation skipped (--skip-validation)")
    print(f"wrote {result.out_dir} ({len(result.files)} safetensors file(s), vocabulary {result.vocab_size})")
    return 0
