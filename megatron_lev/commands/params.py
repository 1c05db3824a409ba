"""`megatron-lev params`: parameter count of every embedding variant at every model size and vocabulary,
the compressed baselines' widths, the embedding share, and FLOPs per token.

    megatron-lev params --vocab-size neox cl100k_base o200k_base     # the vocabulary study in one table
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lev.config import load_config
from megatron_lev.data.tokenizers import KNOWN_VOCABULARIES
from megatron_lev.errors import ConfigError, UserError
from megatron_lev.resources import CONFIG_DIR, config_path, model_config_names

MODELS_DIR = CONFIG_DIR / "models"  # pretrain/configs/models in a checkout
DEFAULT_SIZES = ("tiny", "200m", "400m", "1.2b")
DEFAULT_VOCAB = "o200k_base"  # the paper grid's vocabulary (the model sizes are derived for it)
NEOX_VOCAB = KNOWN_VOCABULARIES["neox"]  # GPT-NeoX-20B tokenizer


def vocabulary(value: str) -> tuple[str, int]:
    """`--vocab-size` item: a size (`50277`) or a name of KNOWN_VOCABULARIES -> (label, size)."""
    if value in KNOWN_VOCABULARIES:
        return value, KNOWN_VOCABULARIES[value]
    try:
        size = int(value)
    except ValueError:
        raise UserError(
            f"--vocab-size {value}: give a number or one of {', '.join(KNOWN_VOCABULARIES)}"
        ) from None
    if size < 1:
        raise UserError(f"--vocab-size {value}: must be an integer >= 1")
    return str(size), size


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
        nargs="+",
        default=[DEFAULT_VOCAB],
        metavar="SIZE_OR_NAME",
        help="tokenizer vocabularies, sizes or names ("
        + ", ".join(f"{k} = {v:,}" for k, v in KNOWN_VOCABULARIES.items())
        + "); each padded to make_vocab_size_divisible_by x TP",
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
    """One row per (size, variant): parameter counts, the embedding share (input table + output head over
    the total), the compressed baselines' widths `(e, hidden)` and training FLOPs per token."""
    from megatron_lev.model.embeddings import embedding_class
    from megatron_lev.model.flops import flops_per_token, parameter_count
    from megatron_lev.model.vocab import padded_vocab_size

    out = []
    for size in sizes:
        cfg = load_config([_config_path(size)], list(overrides)).model
        vocab = padded_vocab_size(vocab_size, cfg, tp)
        tied = parameter_count(cfg, vocab, "tied")["total"]
        for variant in variants:
            cls = embedding_class(variant)
            counts = parameter_count(cfg, vocab, variant)
            widths = cls.widths(cfg, vocab) if hasattr(cls, "widths") else None
            out.append(
                {
                    "size": size,
                    "variant": variant,
                    "vocab": vocab,
                    **counts,
                    "vs_tied": counts["total"] / tied - 1.0,
                    "embedding_share": (counts["input"] + counts["output"]) / counts["total"],
                    "widths": widths,
                    "narrow": [w for _, w in cls.narrow_widths(cfg, vocab)] if widths else [],
                    "min_width": cfg.min_compressed_width,
                    "flops_per_token": flops_per_token(cfg, vocab),
                }
            )
    return out


def _widths_text(r: dict) -> str:
    if r["widths"] is None:
        return "-"
    e, hidden = r["widths"]
    text = f"e={e}" + (f" h={hidden}" if hidden else "")
    return text + (f" <{r['min_width']}!" if r["narrow"] else "")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.commands.config_cmd import check_number

    sizes = [
        s for s in args.sizes if "=" not in s
    ]  # `--sizes tiny key=value`: argparse hands the overrides to --sizes
    overrides = [s for s in args.sizes if "=" in s] + list(args.overrides)
    if not sizes:
        raise ConfigError("--sizes: give at least one model config name or YAML path")
    vocabs = [vocabulary(v) for v in args.vocab_size]
    check_number(args.tp, "--tp", 1, integer=True)
    w = max(6, *(len(s) for s in sizes))
    header = (
        f"{'size':>{w}} {'variant':>15} {'total':>15} {'input emb':>13} {'output head':>13} "
        f"{'vs tied':>8} {'emb share':>9} {'widths':>16} {'GFLOPs/token':>13}"
    )
    narrow = []
    for n, (label, vocab_size) in enumerate(vocabs):
        table = rows(sizes, vocab_size, args.tp, args.variants, overrides)
        name = f"{label} ({vocab_size:,})" if label != str(vocab_size) else f"{vocab_size:,}"
        print(("\n" if n else "") + f"vocabulary {name} padded for TP={args.tp}")
        print(header)
        for r in table:
            print(
                f"{r['size']:>{w}} {r['variant']:>15} {r['total']:>15,} {r['input']:>13,} {r['output']:>13,} "
                f"{r['vs_tied']:>+8.2%} {r['embedding_share']:>9.1%} {_widths_text(r):>16} "
                f"{r['flops_per_token'] / 1e9:>13.3f}"
            )
            if r["narrow"]:
                narrow.append(f"{r['size']} {r['variant']} at {name}")
    print(
        "\neach vocabulary is padded per size (model.make_vocab_size_divisible_by x TP); "
        "emb share = (input table + output head) / total; "
        "widths: the compressed baselines' code width e and MLP hidden h; "
        "FLOPs = training (3x forward) per token"
    )
    if narrow:
        print("below model.min_compressed_width (marked !; training refuses them): " + "; ".join(narrow))
    return 0
