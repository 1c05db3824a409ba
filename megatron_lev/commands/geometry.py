"""`megatron-lev geometry`: embedding geometry (eps, mu, sigma, mean row, effective rank) over training."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="a run's output directory (its config.yaml names the save directory) or its save directory",
    )
    parser.add_argument("--out", default="geometry", help="directory for geometry.{md,csv,json,png}")
    parser.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="eps, mu and sigma over N seeded random rows instead of all pairs (a fast estimate)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample's rows")
    parser.add_argument(
        "--x", choices=("iteration", "tokens"), default="iteration", help="x axis of the plot"
    )


def main(args: argparse.Namespace) -> int:
    from megatron_lev.analysis.geometry import geometry_markdown, run_geometry, write_geometry

    rows = [row for run in args.runs for row in run_geometry(run, args.sample, args.seed)]
    paths = write_geometry(rows, args.out, args.x)
    print(geometry_markdown(rows))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0
