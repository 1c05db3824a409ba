"""`megatron-lev config`: load YAML + overrides, validate, print (and optionally save) the result."""

from __future__ import annotations

import argparse

from megatron_lev.config import load_config


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--config FILE [FILE ...]` and `key=value` overrides every run command takes."""
    parser.add_argument("--config", "-c", nargs="+", default=[], metavar="YAML",
                        help="run config file(s); later files override earlier ones")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted overrides, e.g. model.embedding=lev train.lr=3e-4")


def config_files_and_overrides(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """`--config a.yaml key=value` lets argparse hand the overrides to --config; take them back."""
    files = [c for c in args.config if "=" not in c]
    overrides = [c for c in args.config if "=" in c] + list(args.overrides)
    return files, overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--world-size", type=int, default=None,
                        help="also check the parallel layout for this many processes")
    parser.add_argument("--save", default=None, metavar="DIR", help="write the resolved config.yaml here")


def main(args: argparse.Namespace) -> int:
    files, overrides = config_files_and_overrides(args)
    cfg = load_config(files, overrides, world_size=args.world_size)
    print(cfg.to_yaml(), end="")
    if args.save:
        print(f"# saved to {cfg.save(args.save)}")
    return 0
