"""`megatron-lev compare`: the paper-style table of several runs against TIED, with plots."""

from __future__ import annotations

import argparse

from megatron_lev.errors import UserError


def _named(items: list[str], what: str) -> dict[str, str]:
    """NAME=PATH pairs (a bare PATH is named later from its JSON)."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = "", item
        if not path:
            raise UserError(f"{what}: empty path in {item!r}; give NAME=PATH")
        key = name or path
        if key in out:
            raise UserError(f"{what}: {key!r} is given twice; give each run once")
        out[key] = path
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "results",
        nargs="+",
        metavar="[NAME=]EVAL_JSON",
        help="evaluate results (eval.json); NAME defaults to the name inside",
    )
    parser.add_argument(
        "--curves",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="loss curves: TensorBoard log dir/event file, or JSON/CSV of (tokens, loss)",
    )
    parser.add_argument("--baseline", default="TIED", help="run the others are compared against")
    parser.add_argument("--corpus", default=None, help="pick the result whose corpus contains this")
    parser.add_argument(
        "--tag", default=None, help="scalar tag of the loss (default valid/loss, else train/loss)"
    )
    parser.add_argument("--tokens-tag", default="train/tokens", help="scalar tag giving tokens per step")
    parser.add_argument(
        "--tokens-per-step", type=float, default=None, help="tokens per step when the log has no tokens tag"
    )
    parser.add_argument("--out", default="compare_results", help="output directory")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.analysis.compare import compare_markdown, compare_results, load_result, plot_comparison
    from megatron_lev.analysis.curves import read_curve
    from megatron_lev.commands.config_cmd import check_number, output_dir
    from megatron_lev.config import atomic_write_json, atomic_write_text

    if args.tokens_per_step is not None:
        check_number(args.tokens_per_step, "--tokens-per-step", 0, above=True)
    results = {}
    for name, path in _named(args.results, "results").items():
        r = load_result(path, args.corpus)
        if name == path and not isinstance(r.get("name"), str):
            raise UserError(f"{path}: the result has no 'name'; name it on the command line: NAME={path}")
        run = name if name != path else r["name"]
        if run in results:
            raise UserError(f"results: two results are named {run!r} ({path}); name them NAME=PATH")
        results[run] = r
    curves = {
        name: read_curve(path, args.tag, args.tokens_tag, args.tokens_per_step)
        for name, path in _named(args.curves, "--curves").items()
    }
    unknown = sorted(set(curves) - set(results))
    if unknown:
        raise UserError(
            f"--curves: {', '.join(unknown)} has a curve but no evaluation result; use the names "
            f"of the results ({', '.join(results)})"
        )
    cmp = compare_results(results, curves, args.baseline)
    out = output_dir(args.out, "--out")
    table = compare_markdown(cmp)
    atomic_write_json(out / "compare.json", cmp)
    atomic_write_text(out / "compare.md", table)
    plots = plot_comparison(cmp, curves, out)
    print(table, end="")
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'}" + "".join(f", {p}" for p in plots))
    return 0
