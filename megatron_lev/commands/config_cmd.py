"""`megatron-lev config`: load YAML + overrides, validate, print (and optionally save) the result."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from megatron_lev.config import load_config
from megatron_lev.errors import UserError


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--config FILE [FILE ...]` and `key=value` overrides every run command takes."""
    parser.add_argument(
        "--config",
        "-c",
        nargs="+",
        default=[],
        metavar="YAML",
        help="run config file(s); later files override earlier ones",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="dotted overrides, e.g. model.embedding=lev train.lr=3e-4",
    )


def config_files_and_overrides(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`--config a.yaml key=value` lets argparse hand the overrides to --config; take them back."""
    files = [c for c in args.config if "=" not in c]
    overrides = [c for c in args.config if "=" in c] + list(args.overrides)
    return files, overrides


def output_dir(path: str | os.PathLike, flag: str) -> Path:
    """Create the output directory `path` of option `flag`, or refuse it in one line before any work."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path}: exists and is not a directory; give a directory (or a new path)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(
            f"{flag} {path}: a parent of it is a file, not a directory; choose another path"
        ) from None
    except PermissionError:
        raise UserError(
            f"{flag} {path}: permission denied creating it; choose a writable directory"
        ) from None
    except OSError as exc:
        raise UserError(
            f"{flag} {path}: cannot create the directory ({exc.strerror}); choose another path"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: the directory is not writable; choose a writable directory")
    return path


def check_number(value, flag: str, lo: float, *, above: bool = False, integer: bool = False):
    """Refuse a flag value that is not finite or is below `lo` (or not above it); returns the value."""
    ok = value is not None and math.isfinite(value) and (value > lo if above else value >= lo)
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise UserError(f"{flag} {value}: must be {kind} {'>' if above else '>='} {lo:g}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--world-size", type=int, default=None, help="also check the parallel layout for this many processes"
    )
    parser.add_argument("--save", default=None, metavar="DIR", help="write the resolved config.yaml here")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.plan import validate_config

    files, overrides = config_files_and_overrides(args)
    # the generic rules and the variant's (the variants are listed by the model's registry, not the config)
    cfg = validate_config(load_config(files, overrides, validate=False), args.world_size)
    save_dir = output_dir(args.save, "--save") if args.save else None
    print(cfg.to_yaml(), end="")
    print(memory_comment(cfg, args.world_size or 1))
    if save_dir:
        print(f"# saved to {cfg.save(save_dir)}")
    return 0


def implied_vocab(data_cfg) -> tuple[int, str]:
    """The vocabulary the tokenizer settings imply, without reading the tokenizer: (size, what it is).

    A tiktoken file is o200k_base (the paper's) unless its name says cl100k_base; an HF or
    SentencePiece file is taken as GPT-NeoX's (the project's default) unless its name says otherwise."""
    from megatron_lev.data.tokenizers import KNOWN_VOCABULARIES

    name = str(data_cfg.tokenizer_path or "").lower()
    for known in ("o200k_base", "cl100k_base"):
        if known.split("_")[0] in name:
            return KNOWN_VOCABULARIES[known], known
    if data_cfg.tokenizer_type == "tiktoken":
        return KNOWN_VOCABULARIES["o200k_base"], "o200k_base, as data.tokenizer_type=tiktoken implies"
    return KNOWN_VOCABULARIES["neox"], "GPT-NeoX"


def memory_comment(cfg, world_size: int) -> str:
    """A YAML comment with the memory estimate (`plan.memory`) against this machine's memory.

    `config` does not read the tokenizer: without model.vocab_size it takes the vocabulary the
    tokenizer's type and name imply (`implied_vocab`). `train` checks the estimate with the real
    vocabulary and refuses a CPU run that cannot fit."""
    from megatron_lev.model.vocab import padded_vocab_size
    from megatron_lev.plan.memory import available_memory, estimate_memory, gib

    vocab, what = (cfg.model.vocab_size, "") if cfg.model.vocab_size else implied_vocab(cfg.data)
    padded = padded_vocab_size(vocab, cfg.model, cfg.parallel.tensor_model_parallel_size)
    est = estimate_memory(cfg, world_size, padded, cuda=False)
    assumed = f", vocabulary assumed {vocab:,} ({what})" if what else ""
    line = f"# memory estimate ({world_size} process(es){assumed}): {est.text()}"
    available, source = available_memory()
    if available is not None and est.machine > available:
        line += (
            f"; more than this machine's {gib(available)} ({source}): a CPU run here would be refused, "
            "a GPU run is compared with its device memory"
        )
    return line
