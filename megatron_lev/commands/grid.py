"""`megatron-lev grid`: the paper's 18 runs as sbatch commands, or the small grid run here end to end.

megatron-lev grid --grid paper --print-sbatch > submit_all.sh      # then: bash submit_all.sh
megatron-lev grid --grid small --data-dir ../shared/data/minipile --out runs/small_grid
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_lev.experiments.grid import DEFAULT_VOCAB, PAPER_SIZES, VOCABS
    from megatron_lev.model.embeddings import REGISTRY

    parser.add_argument("--grid", choices=("paper", "small"), required=True)
    parser.add_argument("--variants", nargs="+", choices=list(REGISTRY), default=list(REGISTRY))
    paper = parser.add_argument_group("paper grid (Slurm)")
    paper.add_argument("--sizes", nargs="+", choices=list(PAPER_SIZES), default=list(PAPER_SIZES))
    paper.add_argument(
        "--vocab",
        nargs="+",
        choices=list(VOCABS),
        default=[DEFAULT_VOCAB],
        help=f"vocabularies (default {DEFAULT_VOCAB}, the paper's); neox / cl100k_base: the vocabulary "
        "study, the same configs with another tokenizer, read from $PILE_DATA_NEOX, ... "
        "(docs/experiments.md)",
    )
    paper.add_argument(
        "--print-sbatch",
        action="store_true",
        help="print a script that submits every run (reads $PILE_DATA, $PILE_VALID, $PILE_TOKENIZER)",
    )
    paper.add_argument(
        "--print-eval",
        action="store_true",
        help="print the convert + evaluate job of every run (after training)",
    )
    paper.add_argument(
        "--write",
        metavar="DIR",
        default=None,
        help="write submit_all.sh, evaluate_all.sh and RUNS.md into DIR",
    )
    small = parser.add_argument_group("small grid (this machine)")
    small.add_argument("--data-dir", default=None, help="Pile-format corpus directory (*.jsonl[.zst])")
    small.add_argument("--out", default="runs/small_grid", help="grid directory (data, runs, results)")
    small.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer file to use instead of the SentencePiece model the grid trains "
        "(tokenizer.json, .model or a tiktoken file; model.vocab_size is then taken from it)",
    )
    small.add_argument("--config", default=None, help="run config (default: the small grid's config)")
    small.add_argument("--nproc", type=int, default=1, help="training processes per run (torchrun when > 1)")
    small.add_argument(
        "--threads", type=int, default=None, help="CPU threads per process (default: cores/nproc)"
    )
    small.add_argument(
        "--zero-shot-subset",
        default="Wikipedia (en)",
        help="subset (meta.pile_set_name) held out for zero-shot",
    )
    small.add_argument("--max-chars-per-subset", type=int, default=1_000_000)
    small.add_argument("--valid-every", type=int, default=20, help="every N-th document is validation")
    small.add_argument("--zero-shot-max-chars", type=int, default=300_000)
    small.add_argument("--eval-max-docs", type=int, default=None, help="evaluate only the first N documents")
    small.add_argument("--force", action="store_true", help="rerun finished steps")
    small.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="applied to every variant's training, e.g. train.train_tokens=20480",
    )


def _paper(args: argparse.Namespace) -> int:
    from megatron_lev.commands.config_cmd import output_dir
    from megatron_lev.experiments.grid import (
        chinchilla_tokens,
        evaluation_script,
        manifest_markdown,
        paper_runs,
        submission_script,
    )
    from megatron_lev.utils.io import atomic_write_text

    runs = paper_runs(args.sizes, args.variants, args.vocab)
    if args.write:
        out = output_dir(args.write, "--write")
        atomic_write_text(out / "submit_all.sh", submission_script(runs))
        atomic_write_text(out / "evaluate_all.sh", evaluation_script(runs))
        tokens = {size: chinchilla_tokens(size) for size in args.sizes}
        atomic_write_text(out / "RUNS.md", manifest_markdown(runs, tokens))
        print(
            f"wrote {out / 'submit_all.sh'}, {out / 'evaluate_all.sh'}, {out / 'RUNS.md'} ({len(runs)} runs)"
        )
    if args.print_sbatch:
        print(submission_script(runs), end="")
    if args.print_eval:
        print(evaluation_script(runs), end="")
    if not (args.write or args.print_sbatch or args.print_eval):
        for run in runs:
            print(f"{run.name:>20}  {run.config}  model.embedding={run.variant}  ({run.nodes} node(s))")
        print("(--print-sbatch for the submission commands)")
    return 0


def _small(args: argparse.Namespace) -> int:
    from megatron_lev.errors import ConfigError
    from megatron_lev.experiments.small import SmallGrid, run_small_grid

    if not args.data_dir:
        raise ConfigError("--grid small needs --data-dir (a directory of Pile-format *.jsonl[.zst] files)")
    grid = SmallGrid(
        Path(args.data_dir),
        Path(args.out),
        Path(args.tokenizer) if args.tokenizer else None,
        list(args.variants),
        overrides=list(args.overrides),
        nproc=args.nproc,
        threads=args.threads,
        zero_shot_subset=args.zero_shot_subset,
        max_chars_per_subset=args.max_chars_per_subset,
        valid_every=args.valid_every,
        zero_shot_max_chars=args.zero_shot_max_chars,
        eval_max_docs=args.eval_max_docs,
        **({"config": Path(args.config)} if args.config else {}),
    )
    run_small_grid(grid, force=args.force)  # a failed step is one line naming it and its log
    return 0


def main(args: argparse.Namespace) -> int:
    from megatron_lev.errors import ConfigError

    if args.grid == "paper":
        if args.overrides:
            raise ConfigError(
                f"section.key=value overrides ({' '.join(args.overrides)}) apply to --grid small only"
            )
        return _paper(args)
    return _small(args)
