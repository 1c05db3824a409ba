"""`megatron-lev compare`: the paper-style table of several runs against TIED, with plots."""

from __future__ import annotations

import argparse
from pathlib import Path


def _named(items: list[str], what: str) -> dict[str, str]:
    """NAME=PATH pairs (a bare PATH is named later from its JSON)."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = "", item
        if not path:
            raise ValueError(f"{what}: empty path in {item!r}")
        out[name or path] = path
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", metavar="[NAME=]EVAL_JSON",
                        help="evaluate results (eval.json); NAME defaults to the name inside")
    parser.add_argument("--curves", nargs="*", default=[], metavar="NAME=PATH",
                        help="loss curves: TensorBoard log dir/event file, or JSON/CSV of (tokens, loss)")
    parser.add_argument("--baseline", default="TIED", help="run the others are compared against")
    parser.add_argument("--corpus", default=None, help="pick the result whose corpus contains this")
    parser.add_argument("--tag", default=None, help="scalar tag of the loss (default valid/loss, else train/loss)")
    parser.add_argument("--tokens-tag", default="train/tokens", help="scalar tag giving tokens per step")
    parser.add_argument("--tokens-per-step", type=float, default=None,
                        help="tokens per step when the log has no tokens tag")
    parser.add_argument("--out", default="compare_results", help="output directory")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.analysis.compare import compare_markdown, compare_results, load_result, plot_comparison
    from megatron_lev.analysis.curves import read_curve
    from megatron_lev.config import atomic_write_json, atomic_write_text

    results = {}
    for name, path in _named(args.results, "results").items():
        r = load_result(path, args.corpus)
        results[name if name != path else r["name"]] = r
    curves = {name: read_curve(path, args.tag, args.tokens_tag, args.tokens_per_step)
              for name, path in _named(args.curves, "--curves").items()}
    cmp = compare_results(results, curves, args.baseline)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = compare_markdown(cmp)
    atomic_write_json(out / "compare.json", cmp)
    atomic_write_text(out / "compare.md", table)
    plots = plot_comparison(cmp, curves, out)
    print(table, end="")
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'}" + "".join(f", {p}" for p in plots))
    return 0
