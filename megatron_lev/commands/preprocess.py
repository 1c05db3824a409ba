"""`megatron-lev preprocess`: Pile-format text (jsonl[.zst|.gz], HF datasets) to MMIDIDX shards."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading

from megatron_lev.config import TOKENIZER_TYPES
from megatron_lev.errors import UserError


class Terminated(UserError):
    """SIGTERM arrived: the run stops, cleans up, and leaves any earlier output intact."""

    exit_code = 143


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="*.jsonl, *.jsonl.zst, *.jsonl.gz files, directories or globs of them, "
        "*.arrow/*.parquet files or a datasets.save_to_disk directory (required)",
    )
    parser.add_argument(
        "--output-prefix",
        help="writes PREFIX.bin/.idx/.stats.json/.counts.npy and, last, PREFIX.manifest.json (required)",
    )
    parser.add_argument("--tokenizer-type", default="hf", choices=TOKENIZER_TYPES)
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="tokenizer.json (hf), .model (sentencepiece) or BPE ranks file (tiktoken); required to "
        "preprocess and with --write-manifest-for, not with --verify (the manifest says what it was)",
    )
    parser.add_argument("--json-key", default="text", help="the JSON field holding the document text")
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="tokenising processes (the output is the same for any number)",
    )
    parser.add_argument(
        "--split-by-subset",
        action="store_true",
        help="one output per meta.pile_set_name: PREFIX_<subset>.bin/.idx",
    )
    parser.add_argument(
        "--shard-size-mb",
        type=float,
        default=None,
        help="split each output into shards PREFIX[_subset]_00000 ... of about this size",
    )
    parser.add_argument(
        "--chunk-mb", type=float, default=1.0, help="input per work item (memory ~ workers x this)"
    )
    parser.add_argument(
        "--max-bad-fraction",
        type=float,
        default=1.0,
        help="fail when more than this fraction of the lines is bad (a run with no documents always fails)",
    )
    parser.add_argument(
        "--write-manifest-for",
        metavar="PREFIX",
        default=None,
        help="instead of preprocessing: check the shards at PREFIX (PREFIX.bin or PREFIX_*.bin) "
        "made without a manifest, and write PREFIX.manifest.json for them with --tokenizer",
    )
    parser.add_argument(
        "--verify",
        metavar="PREFIX",
        default=None,
        help="instead of preprocessing: check every byte of the shard set at PREFIX against its "
        "manifest (sha256 and chunk digests, --workers files at a time), and add the chunk digests "
        "a manifest written before them lacks (a start then checks a sample of chunks)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.data.preprocess import FlagError, PreprocessOptions, preprocess

    if args.write_manifest_for:
        return _write_manifest_for(args)
    if args.verify:
        from megatron_lev.data.manifest import verify_every_byte

        r = verify_every_byte(args.verify, workers=max(1, args.workers))
        rate = r["bytes"] / max(r["seconds"], 1e-9) / 1e9
        added = "; chunk digests added to the manifest" if r["added_chunks"] else ""
        print(
            f"{args.verify}: {r['files']} files, {r['bytes'] / 1e9:.2f} GB match the manifest "
            f"({r['seconds']:.1f} s, {rate:.2f} GB/s){added}"
        )
        return 0
    if not args.input or not args.output_prefix:
        raise FlagError(
            "--input and --output-prefix are required (or --write-manifest-for PREFIX, or --verify PREFIX)"
        )
    if not args.tokenizer:
        raise FlagError("--tokenizer is required to preprocess: the tokenizer file the shards are made with")
    if not args.chunk_mb > 0 or args.chunk_mb == float("inf"):
        raise FlagError(f"--chunk-mb must be a positive number, got {args.chunk_mb}")
    opts = PreprocessOptions(
        inputs=args.input,
        output_prefix=args.output_prefix,
        tokenizer_type=args.tokenizer_type,
        tokenizer_path=args.tokenizer,
        json_key=args.json_key,
        workers=args.workers,
        split_by_subset=args.split_by_subset,
        shard_size_mb=args.shard_size_mb,
        chunk_bytes=max(1, int(args.chunk_mb * (1 << 20))),
        progress=not args.no_progress,
        max_bad_fraction=args.max_bad_fraction,
    )

    def terminated(signum, frame):
        raise Terminated(
            f"terminated (signal {signum}); nothing of this run was kept and an earlier output at "
            f"{args.output_prefix} is intact; rerun to start over"
        )

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main_thread else None
    try:
        stats = preprocess(opts)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    print(
        f"{stats['documents']:,} documents, {stats['tokens']:,} tokens ({stats['dtype']}) in "
        f"{stats['seconds']:.1f} s ({stats['tokens_per_second'] / 1e3:.0f}k tokens/s) -> "
        f"{len(stats['outputs'])} output(s): {', '.join(stats['outputs'][:4])}"
        f"{' ...' if len(stats['outputs']) > 4 else ''}"
    )
    if stats["error_count"]:
        print(
            f"skipped {stats['error_count']} bad input(s): {json.dumps(stats['errors'])}; "
            f"see {args.output_prefix}.stats.json for file and line"
        )
        for p in stats["problems"][:10]:
            print(f"  {p['file']}:{p['line']}: {p['kind']}: {p['message']}")
    return 0


def _write_manifest_for(args: argparse.Namespace) -> int:
    from megatron_lev.data.manifest import write_manifest_for
    from megatron_lev.data.preprocess import FlagError

    if not args.tokenizer:
        raise FlagError(
            "--write-manifest-for needs --tokenizer: the tokenizer file the shards were made with"
        )
    path, shards = write_manifest_for(args.write_manifest_for, args.tokenizer_type, args.tokenizer)
    print(
        f"checked {len(shards)} shard(s) ({', '.join(os.path.basename(s) for s in shards[:4])}"
        f"{' ...' if len(shards) > 4 else ''}) and wrote {path}"
    )
    return 0
