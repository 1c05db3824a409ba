"""`megatron-lev params`: parameter count of every embedding variant at every model size, and FLOPs per
token."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lev.config import ConfigError, load_config
from megatron_lev.resources import CONFIG_DIR, config_path, model_config_names

MODELS_DIR = CONFIG_DIR / "models"  # the packaged copy of pretrain/configs/models
DEFAULT_SIZES = ("tiny", "200m", "400m", "1.2b")
NEOX_VOCAB = 50277  # GPT-NeoX-20B tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        metavar="NAME_OR_YAML",
        help="model configs: names in pretrain/configs/models (packaged) or YAML paths",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=NEOX_VOCAB,
        help="tokenizer vocabulary (padded to make_vocab_size_divisible_by x TP)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (changes the padding only)")
    from megatron_lev.model.embeddings import REGISTRY

    parser.add_argument("--variants", nargs="+", default=list(REGISTRY), choices=list(REGISTRY))
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="applied to every size")


def _config_path(name: str) -> Path:
    if Path(name).suffix in (".yaml", ".yml"):
        path = config_path(name)  # as given, else packaged (e.g. experiments/small/small.yaml)
        if not path.is_file():
            raise ConfigError(f"--sizes: config file not found: {name}")
        return path
    path = MODELS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"--sizes: no model config named {name!r} (known: {', '.join(model_config_names())})"
        )
    return path


def rows(sizes, vocab_size: int, tp: int, variants, overrides=()) -> list[dict]:
    """One row per (size, variant): parameter counts and training FLOPs per token."""
    from megatron_lev.model.build import padded_vocab_size
    from megatron_lev.model.flops import flops_per_token, parameter_count

    out = []
    for size in sizes:
        cfg = load_config([_config_path(size)], list(overrides)).model
        vocab = padded_vocab_size(vocab_size, cfg, tp)
        tied = parameter_count(cfg, vocab, "tied")["total"]
        for variant in variants:
            counts = parameter_count(cfg, vocab, variant)
            out.append(
                {
                    "size": size,
                    "variant": variant,
                    "vocab": vocab,
                    **counts,
                    "vs_tied": counts["total"] / tied - 1.0,
                    "flops_per_token": flops_per_token(cfg, vocab),
                }
            )
    return out


def main(args: argparse.Namespace) -> int:
    from megatron_lev.commands.config_cmd import check_number

    sizes = [
        s for s in args.sizes if "=" not in s
    ]  # `--sizes tiny key=value`: argparse hands the overrides to --sizes
    overrides = [s for s in args.sizes if "=" in s] + list(args.overrides)
    if not sizes:
        raise ConfigError("--sizes: give at least one model config name or YAML path")
    check_number(args.vocab_size, "--vocab-size", 1, integer=True)
    check_number(args.tp, "--tp", 1, integer=True)
    table = rows(sizes, args.vocab_size, args.tp, args.variants, overrides)
    header = (
        f"{'size':>6} {'variant':>15} {'total':>15} {'input emb':>13} {'output head':>13} "
        f"{'vs tied':>8} {'GFLOPs/token':>13}"
    )
    print(f"vocabulary {args.vocab_size} padded for TP={args.tp}; FLOPs = training (3x forward) per token")
    print(header)
    for r in table:
        print(
            f"{r['size']:>6} {r['variant']:>15} {r['total']:>15,} {r['input']:>13,} {r['output']:>13,} "
            f"{r['vs_tied']:>+8.2%} {r['flops_per_token'] / 1e9:>13.3f}"
        )
    return 0
