"""`megatron-lev train-tokenizer`: a SentencePiece BPE model (byte fallback) from Pile-format input."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="Pile-format files, directories or globs (as for `preprocess`)")
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-mb", type=float, default=50.0, help="train on at most this much text")
    parser.add_argument("--json-key", default="text")
    parser.add_argument("--threads", type=int, default=None, help="trainer threads (default: all cores)")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.data.train_tokenizer import train_sentencepiece

    if args.vocab_size < 260:
        raise SystemExit(f"--vocab-size must be >= 260 (256 byte pieces + specials), got {args.vocab_size}")
    info = train_sentencepiece(args.input, args.model_prefix, args.vocab_size, args.max_mb, args.json_key,
                               args.threads)
    print(f"wrote {info['model']} (vocabulary {info['vocab_size']}, EOD {info['eod_piece']} = id {info['eod']}); "
          f"use --tokenizer-type sentencepiece --tokenizer {info['model']}")
    return 0
