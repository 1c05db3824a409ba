"""`megatron-lev preprocess`: Pile-format text (jsonl[.zst|.gz], HF datasets) to MMIDIDX shards."""

from __future__ import annotations

import argparse
import json
import os

from megatron_lev.config import TOKENIZER_TYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="*.jsonl, *.jsonl.zst, *.jsonl.gz files, directories or globs of them, "
                             "*.arrow/*.parquet files or a datasets.save_to_disk directory")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx/.stats.json/.counts.npy")
    parser.add_argument("--tokenizer-type", default="hf", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer", required=True, metavar="FILE",
                        help="tokenizer.json (hf), .model (sentencepiece) or BPE ranks file (tiktoken)")
    parser.add_argument("--json-key", default="text", help="the JSON field holding the document text")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenising processes, each writing its own partial shard")
    parser.add_argument("--split-by-subset", action="store_true",
                        help="one output per meta.pile_set_name: PREFIX_<subset>.bin/.idx")
    parser.add_argument("--shard-size-mb", type=float, default=None,
                        help="split each output into shards PREFIX[_subset]_00000 ... of about this size")
    parser.add_argument("--chunk-mb", type=float, default=1.0, help="input per work item (memory ~ workers x this)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    if args.workers < 1:
        raise SystemExit(f"--workers must be >= 1, got {args.workers}")
    if args.shard_size_mb is not None and args.shard_size_mb <= 0:
        raise SystemExit(f"--shard-size-mb must be positive, got {args.shard_size_mb}")
    stats = preprocess(PreprocessOptions(
        inputs=args.input, output_prefix=args.output_prefix, tokenizer_type=args.tokenizer_type,
        tokenizer_path=args.tokenizer, json_key=args.json_key, workers=args.workers,
        split_by_subset=args.split_by_subset, shard_size_mb=args.shard_size_mb,
        chunk_bytes=max(1, int(args.chunk_mb * (1 << 20))), progress=not args.no_progress))
    print(f"{stats['documents']:,} documents, {stats['tokens']:,} tokens ({stats['dtype']}) in "
          f"{stats['seconds']:.1f} s ({stats['tokens_per_second'] / 1e3:.0f}k tokens/s) -> "
          f"{len(stats['outputs'])} output(s): {', '.join(stats['outputs'][:4])}"
          f"{' ...' if len(stats['outputs']) > 4 else ''}")
    if stats["error_count"]:
        print(f"skipped {stats['error_count']} bad input(s): {json.dumps(stats['errors'])}; "
              f"see {args.output_prefix}.stats.json for file and line")
        for p in stats["problems"][:10]:
            print(f"  {p['file']}:{p['line']}: {p['kind']}: {p['message']}")
    return 0
