"""`megatron-lev evaluate`: perplexity (overall, by token frequency, bits per byte) of a Hugging Face
model or of a training checkpoint of any parallel layout (the same numbers for both)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="exported Hugging Face model directory, or a training checkpoint "
                                      "(the run's save directory or one tag directory)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest); checkpoints only")
    parser.add_argument("--data", nargs="*", default=[], metavar="PREFIX",
                        help="held-out MMIDIDX shards (<prefix>.bin/.idx)")
    parser.add_argument("--text", nargs="*", default=[], metavar="FILE",
                        help="zero-shot corpora: .jsonl / .jsonl.zst (Pile format) or plain text")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer.json or directory for --text (default: the model directory)")
    parser.add_argument("--counts", default=None, metavar="NPY",
                        help="training token counts <prefix>.counts.npy: adds perplexity by frequency")
    parser.add_argument("--edges", type=float, nargs="+", default=None,
                        help="relative-frequency bucket edges (default 1e-7 1e-6 1e-5 1e-4)")
    parser.add_argument("--split", choices=("train", "valid", "test"), default=None,
                        help="evaluate only this part of each --data shard, split by document as the trainer does")
    parser.add_argument("--split-spec", default="969,30,1", help="the run's data.split (with --split)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per window (default: the model's training sequence length)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-docs", type=int, default=None, help="evaluate only the first N documents")
    parser.add_argument("--name", default=None, help="run name in the results (default: model dir name)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--out", default="eval_results", help="output directory (JSON + markdown)")


def main(args: argparse.Namespace) -> int:
    import torch

    from megatron_lev.analysis.corpora import load_tokenizer
    from megatron_lev.analysis.evaluate import (
        checkpoint_model_fn,
        evaluate_model,
        hf_model_fn,
        hf_sequence_length,
        is_hf_model_dir,
    )
    from megatron_lev.analysis.perplexity import DEFAULT_EDGES, load_counts, result_markdown
    from megatron_lev.config import atomic_write_json, atomic_write_text

    if not args.data and not args.text:
        print("megatron-lev evaluate: give --data PREFIX... and/or --text FILE...")
        return 2
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    name = args.name or Path(args.model).name
    if is_hf_model_dir(args.model):
        model_fn, seq_len = hf_model_fn(args.model, args.device, args.dtype), hf_sequence_length(args.model)
    else:
        model_fn, seq_len = checkpoint_model_fn(args.model, args.tag, args.device)
    if args.text and not args.tokenizer and not is_hf_model_dir(args.model):
        print("megatron-lev evaluate: --text with a training checkpoint needs --tokenizer")
        return 2
    tokenizer = load_tokenizer(args.tokenizer or args.model) if args.text else None
    counts = load_counts(args.counts) if args.counts else None
    split = (args.split, args.split_spec) if args.split else None
    results = evaluate_model(model_fn, name, args.data, args.text, tokenizer, counts,
                             tuple(args.edges or DEFAULT_EDGES), args.seq_len or seq_len,
                             args.batch_size, args.max_docs, args.device, split=split)
    out = Path(args.out)
    table = result_markdown(results)
    atomic_write_json(out / "eval.json", {"name": name, "model": str(args.model), "results": results})
    atomic_write_text(out / "eval.md", table)
    print(table, end="")
    print(json.dumps({"wrote": [str(out / "eval.json"), str(out / "eval.md")]}))
    return 0
