"""`megatron-lev train-tokenizer`: a SentencePiece BPE model (byte fallback) from Pile-format input."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="Pile-format files, directories or globs (as for `preprocess`)",
    )
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-mb", type=float, default=50.0, help="train on at most this much text")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--threads", type=int, default=None, help="trainer threads (default: all cores)")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.commands.config_cmd import check_number
    from megatron_lev.data.train_tokenizer import MIN_VOCAB, train_sentencepiece
    from megatron_lev.errors import UserError

    if args.vocab_size < MIN_VOCAB:
        raise UserError(
            f"--vocab-size {args.vocab_size}: must be >= {MIN_VOCAB} (256 byte pieces + "
            "<unk> + <|endoftext|> + merges)"
        )
    check_number(args.max_mb, "--max-mb", 0, above=True)
    if args.threads is not None:
        check_number(args.threads, "--threads", 1, integer=True)
    prefix = Path(args.model_prefix)
    if not prefix.name or prefix.is_dir():
        raise UserError(
            f"--model-prefix {args.model_prefix}: give a file prefix such as tokenizer/spm "
            "(it writes PREFIX.model and PREFIX.vocab), not a directory"
        )
    if prefix.parent.exists() and not prefix.parent.is_dir():
        raise UserError(f"--model-prefix {args.model_prefix}: {prefix.parent} is a file, not a directory")
    info = train_sentencepiece(
        args.input, args.model_prefix, args.vocab_size, args.max_mb, args.json_key, args.threads
    )
    print(
        f"wrote {info['model']} (vocabulary {info['vocab_size']}, "
        f"EOD {info['eod_piece']} = id {info['eod']}); "
        f"use --tokenizer-type sentencepiece --tokenizer {info['model']}"
    )
    return 0
