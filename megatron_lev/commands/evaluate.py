"""`megatron-lev evaluate`: perplexity (overall, by token frequency, bits per byte), LAMBADA last-word
accuracy and document-level Wikitext perplexity of a Hugging Face model or of a training checkpoint
of any parallel layout (the same numbers for both)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="exported Hugging Face model directory, or a training checkpoint "
        "(the run's save directory or one tag directory)",
    )
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest); checkpoints only")
    parser.add_argument(
        "--data", nargs="*", default=[], metavar="PREFIX", help="held-out MMIDIDX shards (<prefix>.bin/.idx)"
    )
    parser.add_argument(
        "--text",
        nargs="*",
        default=[],
        metavar="FILE",
        help="zero-shot corpora: .jsonl / .jsonl.zst (Pile format) or plain text",
    )
    parser.add_argument(
        "--lambada",
        nargs="*",
        default=[],
        metavar="FILE",
        help="LAMBADA last-word prediction (accuracy, perplexity): .jsonl with a 'text' per passage "
        "(the lambada_openai layout) or plain text, one passage per line",
    )
    parser.add_argument(
        "--wikitext",
        nargs="*",
        default=[],
        metavar="FILE",
        help="document-level perplexity (per word, per byte, per token) of raw Wikitext-103 files, "
        "split into articles at ' = Title = ' headings",
    )
    parser.add_argument(
        "--detokenize",
        action="store_true",
        help="--wikitext: undo the ' @-@ ', ' @,@ ', ' @.@ ' and punctuation spacing before scoring, "
        "as lm-eval's wikitext task does",
    )
    parser.add_argument(
        "--stride",
        type=int,
        default=None,
        help="--wikitext: tokens newly scored per window after the first, the rest being context "
        "(default: the window length, no overlap)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json or directory for --text/--lambada/--wikitext (default: the model directory)",
    )
    parser.add_argument(
        "--counts",
        default=None,
        metavar="NPY",
        help="training token counts <prefix>.counts.npy: adds perplexity by frequency",
    )
    parser.add_argument(
        "--edges",
        type=float,
        nargs="+",
        default=None,
        help="relative-frequency bucket edges (default 1e-7 1e-6 1e-5 1e-4)",
    )
    parser.add_argument(
        "--split",
        choices=("train", "valid", "test"),
        default=None,
        help="evaluate only this part of each --data shard, split by document as the trainer does",
    )
    parser.add_argument("--split-spec", default="969,30,1", help="the run's data.split (with --split)")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per window (default: the model's training sequence length)",
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--max-docs",
        type=int,
        default=None,
        help="evaluate only the first N documents (LAMBADA passages, Wikitext articles) of each input",
    )
    parser.add_argument("--name", default=None, help="run name in the results (default: model dir name)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--out", default="eval_results", help="output directory (JSON + markdown)")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model code a model directory ships (needed for --keep-lev exports)",
    )


def _check_flags(args: argparse.Namespace) -> None:
    from megatron_lev.errors import UserError

    for flag, value in (
        ("--seq-len", args.seq_len),
        ("--batch-size", args.batch_size),
        ("--max-docs", args.max_docs),
        ("--threads", args.threads),
        ("--stride", args.stride),
    ):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if args.stride is not None and args.seq_len is not None and args.stride > args.seq_len:
        raise UserError(f"--stride {args.stride} must be <= --seq-len {args.seq_len}")
    if (args.stride is not None or args.detokenize) and not args.wikitext:
        raise UserError("--stride and --detokenize apply to --wikitext; give --wikitext FILE")


def _check_tokenizer(
    tokenizer, model: str, is_hf: bool, vocab: int | None, tag: str | None, trained: tuple | None = None
) -> None:
    """Refuse a --tokenizer that is not the model's (another file) or yields ids the model has no row for.

    `trained`: (fingerprint, record file) a checkpoint's provenance holds; the tokenizer file must
    be that one (the same sha256; for a run on a SentencePiece or tiktoken file, a tokenizer.json
    that encodes alike), whatever the run's tokenizer path holds now."""
    from megatron_lev.errors import DataError
    from megatron_lev.utils.io import sha256_file

    if vocab is not None and tokenizer.vocab_size is not None and tokenizer.vocab_size > vocab:
        raise DataError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but the model {model} only "
            f"{vocab}: it is not the model's tokenizer; pass the one the model was trained with"
        )
    if tokenizer.file is None:
        return
    if trained is not None:
        fingerprint, record = trained
        sha = sha256_file(tokenizer.file)
        if sha == fingerprint["sha256"]:
            return
        diff = f"sha256 {sha[:12]}... != {fingerprint['sha256'][:12]}..."
        if fingerprint.get("type") != "hf":  # a tokenizer.json converted from the run's file
            from megatron_lev.data.tokenizers import TokenizerError, encoding_mismatch, tokenizer_fingerprint

            try:
                diff = encoding_mismatch(fingerprint, tokenizer_fingerprint("hf", tokenizer.file))
            except TokenizerError as exc:
                diff = str(exc)
            if diff is None:
                return
        raise DataError(
            f"--tokenizer {tokenizer.file} is not the model's tokenizer ({diff}; the checkpoint was "
            f"trained with {fingerprint.get('path') or fingerprint.get('file')}, recorded in {record}); "
            "pass the tokenizer file the run was trained with"
        )
    reference = _model_tokenizer_file(model, is_hf, tag)
    if reference is None or not reference.is_file() or reference.resolve() == Path(tokenizer.file).resolve():
        return
    if sha256_file(reference) != sha256_file(tokenizer.file):
        raise DataError(
            f"--tokenizer {tokenizer.file} is not the model's tokenizer ({reference} differs, sha256); "
            f"drop --tokenizer to use the model's, or pass {reference}"
        )


def _model_tokenizer(model: str, is_hf: bool, tag: str | None) -> tuple[str, Path | None]:
    """(type, file) of the tokenizer a model was exported or trained with; the file where it is known."""
    if is_hf:
        return "hf", Path(model) / "tokenizer.json"
    from megatron_lev.ckpt.record import find_run_config
    from megatron_lev.engine.checkpoint_files import resolve_tag_dir

    data = find_run_config(resolve_tag_dir(model, tag)).data
    return data.tokenizer_type, Path(data.tokenizer_path) if data.tokenizer_path else None


def _model_tokenizer_file(model: str, is_hf: bool, tag: str | None) -> Path | None:
    """The tokenizer file a model was exported or trained with, where it is known."""
    return _model_tokenizer(model, is_hf, tag)[1]


def _trained_tokenizer(model: str, is_hf: bool, tag: str | None) -> tuple[dict, Path] | None:
    """(tokenizer fingerprint, record file) a training checkpoint's provenance holds; None for a
    Hugging Face directory or a checkpoint without a record (named in a warning)."""
    if is_hf:
        return None
    from megatron_lev.ckpt.provenance import (
        PROVENANCE_FILE,
        read_provenance,
        recorded_tokenizer,
        warn_unrecorded,
    )
    from megatron_lev.engine.checkpoint_files import resolve_tag_dir

    tag_dir = resolve_tag_dir(model, tag)
    record = read_provenance(tag_dir)
    if record is None:
        warn_unrecorded(tag_dir, "the tokenizer is compared with the file the run's config names, if any")
    fingerprint = recorded_tokenizer(record)
    return (fingerprint, tag_dir / PROVENANCE_FILE) if fingerprint else None


def _verify_shard_sets(prefixes: list[str]) -> None:
    """Every --data shard against its set's manifest, as `train` and `build-indices` check it: a set
    without one, or whose files differ from it (size, sha256), is refused."""
    from megatron_lev.data.manifest import verify_shard_sets

    verify_shard_sets(prefixes)


def _check_shard_tokenizers(
    prefixes: list[str], reference: Path | None, tokenizer_type: str = "hf", trained: tuple | None = None
) -> None:
    """Refuse held-out shards whose manifest records another tokenizer than the model's.

    The same file (sha256) passes; another file passes when it tokenizes alike: the same
    vocabulary size, EOD id and ids of a probe text (`tokenizers.encoding_mismatch`), as for a
    tiktoken run's export, which holds the tokenizer.json converted from the run's tiktoken file.
    A manifest that cannot be read is refused rather than skipped. `trained`: (fingerprint, record
    file) of a checkpoint's provenance, the reference instead of the file at the run's tokenizer path.
    """
    from megatron_lev.data.manifest import ShardSetError, find_manifest
    from megatron_lev.data.tokenizers import encoding_mismatch, tokenizer_fingerprint
    from megatron_lev.errors import DataError
    from megatron_lev.utils.io import sha256_file

    if trained is not None:
        mine, _ = trained
        sha, reference = mine["sha256"], Path(mine.get("path") or mine.get("file") or "?")
    elif not prefixes or reference is None or not reference.is_file():
        return
    else:
        sha = sha256_file(reference)
        mine = None  # the model tokenizer's fingerprint, built at the first shard of another file
    for prefix in prefixes:
        try:
            path, manifest, _ = find_manifest(prefix)
        except ShardSetError as exc:
            raise DataError(f"{prefix}: cannot tell which tokenizer made it: {exc}") from None
        recorded = (manifest or {}).get("tokenizer") or {}
        if not isinstance(recorded, dict):
            raise DataError(
                f"{prefix}: {path} records no readable tokenizer fingerprint (got "
                f"{type(recorded).__name__}); rerun `megatron-lev preprocess` to rewrite it"
            )
        if not recorded.get("sha256") or recorded["sha256"] == sha:
            continue
        mine = mine or tokenizer_fingerprint(tokenizer_type, reference)
        diff = encoding_mismatch(recorded, mine)
        if diff:
            raise DataError(
                f"{prefix}: made with tokenizer {recorded.get('file', '?')} ({path}), not the model's "
                f"{reference} ({diff}); evaluate shards made with the model's tokenizer"
            )


def main(args: argparse.Namespace) -> int:
    import torch

    from megatron_lev.analysis.corpora import load_tokenizer
    from megatron_lev.analysis.evaluate import (
        checkpoint_model_fn,
        evaluate_model,
        evaluate_zero_shot,
        hf_model_fn,
        hf_sequence_length,
        hf_vocab_size,
        is_hf_model_dir,
    )
    from megatron_lev.analysis.perplexity import DEFAULT_EDGES, load_counts, result_markdown
    from megatron_lev.analysis.zero_shot import zero_shot_markdown
    from megatron_lev.data.zero_shot_formats import read_lambada, split_wikitext
    from megatron_lev.errors import DataError, UserError
    from megatron_lev.utils.io import atomic_write_json, atomic_write_text

    if not (args.data or args.text or args.lambada or args.wikitext):
        raise UserError("give --data PREFIX..., --text FILE..., --lambada FILE... and/or --wikitext FILE...")
    _check_flags(args)
    text_flags = [f for f in ("--text", "--lambada", "--wikitext") if getattr(args, f[2:])]
    if text_flags and not args.tokenizer and not is_hf_model_dir(args.model):
        raise UserError(
            f"{'/'.join(text_flags)} with a training checkpoint needs --tokenizer (the run's tokenizer file)"
        )
    # the task files are read before the model is loaded, so bad input is refused at once
    lambada = {path: read_lambada(path, args.max_docs) for path in args.lambada}
    wikitext = {path: split_wikitext(path, args.max_docs) for path in args.wikitext}
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    name = args.name or Path(args.model).name
    hf = is_hf_model_dir(args.model)
    if not hf:  # what a look at the directory tells, before the data are hashed and the model loaded
        from megatron_lev.engine.checkpoint_files import resolve_tag_dir

        model = Path(args.model)
        if model.is_dir() and (any(model.glob("*.safetensors")) or any(model.glob("pytorch_model*.bin"))):
            raise DataError(
                f"{model} holds model weights but no config.json: not a complete Hugging Face model "
                "directory; export it again (megatron-lev convert) or add its config.json"
            )
        resolve_tag_dir(args.model, args.tag)
    _verify_shard_sets(args.data)
    if hf:
        model_fn = hf_model_fn(args.model, args.device, args.dtype, args.trust_remote_code)
        seq_len, vocab = hf_sequence_length(args.model), hf_vocab_size(args.model)
    else:
        model_fn, seq_len, vocab = checkpoint_model_fn(args.model, args.tag, args.device)
    window = args.seq_len or seq_len
    if args.stride is not None and args.stride > window:
        raise UserError(f"--stride {args.stride} must be <= the window of {window} tokens (--seq-len)")
    tokenizer_type, reference = _model_tokenizer(args.model, hf, args.tag)
    trained = _trained_tokenizer(args.model, hf, args.tag)
    _check_shard_tokenizers(args.data, reference, tokenizer_type, trained)
    tokenizer = load_tokenizer(args.tokenizer or args.model) if text_flags else None
    if tokenizer is not None:
        _check_tokenizer(tokenizer, args.model, hf, vocab, args.tag, trained)
    try:
        counts = load_counts(args.counts) if args.counts else None
    except ValueError as exc:
        raise DataError(f"--counts: {exc}") from None
    split = (args.split, args.split_spec) if args.split else None
    results = evaluate_model(
        model_fn,
        name,
        args.data,
        args.text,
        tokenizer,
        counts,
        tuple(args.edges or DEFAULT_EDGES),
        window,
        args.batch_size,
        args.max_docs,
        args.device,
        split=split,
        vocab_size=vocab,
    )
    results += evaluate_zero_shot(
        model_fn,
        name,
        tokenizer,
        lambada,
        wikitext,
        window,
        args.batch_size,
        args.device,
        stride=args.stride,
        detokenize=args.detokenize,
        vocab_size=vocab,
    )
    out = Path(args.out)
    perplexities = [r for r in results if "task" not in r]
    table = result_markdown(perplexities) if perplexities else ""
    tasks = zero_shot_markdown(results)
    table += ("\n" if table and tasks else "") + tasks
    atomic_write_json(out / "eval.json", {"name": name, "model": str(args.model), "results": results})
    atomic_write_text(out / "eval.md", table)
    print(table, end="")
    print(json.dumps({"wrote": [str(out / "eval.json"), str(out / "eval.md")]}))
    return 0
