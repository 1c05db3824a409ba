"""`megatron-lev capacity`: representational capacity of embedding matrices, the packing sweep, the refit."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "paths", nargs="*", metavar="PATH", help=".npy, .safetensors or Hugging Face model directory"
    )
    parser.add_argument("--tensor", default=None, help="tensor name to measure instead of the usual names")
    parser.add_argument(
        "--histogram",
        choices=("sample", "full", "off"),
        default="sample",
        help="pairs the histogram is over: those of a seeded row sample (default, --hist-rows), "
        "all pairs (O(V^2 d); also cross-checks eps), or none; eps is always exact "
        "over all pairs from the d x d Gram matrix, O(V d^2)",
    )
    parser.add_argument(
        "--hist-rows",
        type=int,
        default=10_000,
        metavar="N",
        help="rows of the histogram's sample (default 10,000: 5e7 pairs)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the row samples (default 0)")
    parser.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="measure eps over N random rows only instead of all rows",
    )
    parser.add_argument("--block", type=int, default=4096, help="rows per matmul block")
    parser.add_argument(
        "--hist-stride",
        type=int,
        default=None,
        help="histogram every k-th row of a pair block (default: 4096 // d above 1e8 pairs, else 1)",
    )
    parser.add_argument(
        "--sweep",
        choices=("small", "full"),
        default=None,
        help="run the packing simulation (small: CPU, minutes; full: GPU) and refit",
    )
    parser.add_argument("--steps", type=int, default=5000, help="Adam steps of the optimised packing")
    parser.add_argument(
        "--fit",
        default=None,
        metavar="JSON",
        help="refit the constants to packing rows [k, d, eps*] (e.g. optimized_packing.json)",
    )
    parser.add_argument(
        "--formula",
        nargs=2,
        type=float,
        default=None,
        metavar=("D", "EPS"),
        help="only evaluate the four formulas for this d and eps",
    )
    parser.add_argument("--device", default=None, help="torch device (cuda for the GPU)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--out", default="capacity_results", help="output directory")


def _print_formulas(d: int, eps: float) -> None:
    from megatron_lev.analysis.formulas import (
        CAVEATS,
        CLASS_NOTE,
        REPRODUCES_TABLE,
        capacity_table,
        eps_class,
    )

    cls = eps_class(eps)
    print(f"d = {d}, eps = {eps:.5f}: {cls} ({CLASS_NOTE[cls]})")
    for row in capacity_table(d, eps):
        print(
            f"  {row['name']:34s} {row['formula']:44s} log10 k = {row['log10_capacity']:8.3f}  "
            f"k = {row['capacity']}"
        )
    print(REPRODUCES_TABLE)
    print(CAVEATS)


def main(args: argparse.Namespace) -> int:
    import torch

    from megatron_lev.utils.io import atomic_write_json, atomic_write_text

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    out = Path(args.out)
    if args.formula:
        _print_formulas(int(args.formula[0]), args.formula[1])
        return 0
    if args.sweep or args.fit:
        from megatron_lev.analysis.fit import fit_markdown, load_packing, refit

        if args.sweep:
            from megatron_lev.analysis.packing import SWEEPS, run_sweep

            sweep = run_sweep(*SWEEPS[args.sweep], steps=args.steps, device=args.device or "cpu")
            atomic_write_json(out / "packing_random.json", sweep["random"])
            atomic_write_json(out / "packing_optimized.json", sweep["optimized"])
            print(f"packing sweep {args.sweep}: {len(sweep['optimized'])} points in {sweep['seconds']:.0f} s")
            rows = sweep["optimized"]
        else:
            rows = load_packing(args.fit)
        import numpy as np

        text = fit_markdown(refit(np.asarray(rows, dtype=np.float64), source=args.fit or "the sweep"))
        atomic_write_text(out / "fit.md", text)
        print(text, end="")
        return 0
    if not args.paths:
        from megatron_lev.errors import UserError

        raise UserError("give PATH..., --formula D EPS, --sweep or --fit")
    from megatron_lev.analysis.capacity import capacity_report, report_markdown, write_report
    from megatron_lev.analysis.cosine import MatrixError
    from megatron_lev.analysis.loaders import load_matrices

    reports = []
    for path in args.paths:
        for name, matrix in load_matrices(path, args.tensor).items():
            print(f"{name}: {tuple(matrix.shape)}")
            try:
                reports.append(
                    capacity_report(
                        matrix,
                        name,
                        sample=args.sample,
                        block=args.block,
                        hist_stride=args.hist_stride,
                        seed=args.seed,
                        histogram=args.histogram,
                        hist_rows=args.hist_rows,
                        device=args.device,
                        progress=True,
                    )
                )
            except MatrixError as exc:
                where = path if name == Path(path).name else f"{path} ({name.split(':', 1)[-1]})"
                raise MatrixError(f"{where}: {exc}") from None
    paths = write_report(reports, out)
    print(report_markdown(reports), end="")
    pngs = "" if args.histogram == "off" else " and histogram PNGs"
    print(f"wrote {paths['json']}, {paths['markdown']}{pngs} in {out}")
    return 0
