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


def _seeded(items: list[str]) -> dict[str, tuple[bool, list[str]]]:
    """[NAME=]PATH[,PATH...] arguments: the evaluation results of each run, one per seed, in order.

    A repeated NAME adds seeds to that run; a comma list without NAME is one run named later from
    its JSON.
    """
    out: dict[str, tuple[bool, list[str]]] = {}
    for item in items:
        name, sep, paths = item.partition("=")
        if not sep:
            name, paths = "", item
        parts = paths.split(",")
        if not paths or not all(parts):
            raise UserError(f"results: empty path in {item!r}; give NAME=PATH[,PATH...]")
        key = name or paths
        if not name and key in out:
            raise UserError(f"results: {key!r} is given twice; give each run once")
        _, seen = out.setdefault(key, (bool(name), []))
        for path in parts:
            if path in seen:
                raise UserError(f"results: {path!r} is given twice for {key!r}; give each seed's result once")
            seen.append(path)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "results",
        nargs="+",
        metavar="[NAME=]EVAL_JSON[,EVAL_JSON...]",
        help="evaluate results (eval.json), one per seed (comma list or repeated NAME=); seed i of a run "
        "is paired with seed i of the baseline; NAME defaults to the name inside",
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
    parser.add_argument(
        "--bootstrap",
        type=int,
        default=None,
        metavar="N",
        help="document-bootstrap resamples (default 1000, skipped with a note when a result has no "
        "per-document losses; given explicitly, such a result is an error; 0: no bootstrap)",
    )
    parser.add_argument("--bootstrap-seed", type=int, default=0, help="seed of the document resamples")
    parser.add_argument(
        "--decomposition",
        action="store_true",
        help="require the gain decomposition (ALBERT, FLAT-MLP, FACT-MLP, LEV); it is computed "
        "whenever those runs are present",
    )
    parser.add_argument("--out", default="compare_results", help="output directory")


def main(args: argparse.Namespace) -> int:
    from megatron_lev.analysis.compare import compare_markdown, compare_results, load_result, plot_comparison
    from megatron_lev.analysis.curves import read_curve
    from megatron_lev.commands.config_cmd import check_number, output_dir
    from megatron_lev.utils.io import atomic_write_json, atomic_write_text

    if args.tokens_per_step is not None:
        check_number(args.tokens_per_step, "--tokens-per-step", 0, above=True)
    if args.bootstrap is not None:
        check_number(args.bootstrap, "--bootstrap", 0, integer=True)
    check_number(args.bootstrap_seed, "--bootstrap-seed", 0, integer=True)
    results, sources = {}, {}
    for key, (named, paths) in _seeded(args.results).items():
        seeds = [load_result(path, args.corpus) for path in paths]
        if not named and not isinstance(seeds[0].get("name"), str):
            raise UserError(f"{paths[0]}: the result has no 'name'; name it on the command line: NAME={key}")
        run = key if named else seeds[0]["name"]
        if run in results:
            raise UserError(f"results: two results are named {run!r} ({key}); name them NAME=PATH")
        results[run], sources[run] = seeds, paths
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
    cmp = compare_results(
        results,
        curves,
        args.baseline,
        sources=sources,
        bootstrap=1000 if args.bootstrap is None else args.bootstrap,
        bootstrap_seed=args.bootstrap_seed,
        require_bootstrap=bool(args.bootstrap),
        decomposition=True if args.decomposition else None,
    )
    out = output_dir(args.out, "--out")
    table = compare_markdown(cmp)
    atomic_write_json(out / "compare.json", cmp)
    atomic_write_text(out / "compare.md", table)
    plots = plot_comparison(cmp, curves, out)
    print(table, end="")
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'}" + "".join(f", {p}" for p in plots))
    return 0
