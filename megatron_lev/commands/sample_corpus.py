"""`megatron-lev sample-corpus`: a Pile-format corpus from the sources every machine has."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_lev.data.sample_corpus import SOURCES

    parser.add_argument(
        "--output-dir", required=True, help="writes <subset>.jsonl.zst files and manifest.json"
    )
    parser.add_argument("--max-mb", type=float, default=20.0, help="stop after this much text")
    parser.add_argument(
        "--sources",
        nargs="+",
        default=None,
        choices=list(SOURCES),
        help="subsets to draw from (default: all that exist here)",
    )
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.commands.config_cmd import check_number, output_dir
    from megatron_lev.data.sample_corpus import build_sample_corpus

    check_number(args.max_mb, "--max-mb", 0, above=True)
    out = output_dir(args.output_dir, "--output-dir")
    m = build_sample_corpus(out, args.max_mb, args.sources, progress=not args.no_progress)
    for name, s in m["subsets"].items():
        print(f"{name:>14}: {s['documents']:>6,} documents, {s['characters'] / 1e6:6.1f}M characters")
    if m["unavailable"]:
        print(f"not available on this machine: {', '.join(m['unavailable'])}")
    print(f"{m['bytes'] / 1e6:.1f} MB of text in {args.output_dir}")
    return 0
