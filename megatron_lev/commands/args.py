"""Command-line arguments that several subcommands share."""

from __future__ import annotations

import argparse


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The source checkpoint of `convert` and `reshard`: the positional CHECKPOINT, `--tag` and `--config`."""
    parser.add_argument(
        "checkpoint", help="the run's save directory (uses 'latest') or one checkpoint tag directory"
    )
    parser.add_argument(
        "--tag", default=None, help="checkpoint tag under the save directory (default: latest)"
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="YAML",
        help="the run's resolved config (default: config.yaml beside the checkpoint)",
    )
