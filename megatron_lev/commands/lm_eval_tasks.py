"""`megatron-lev lm-eval-tasks`: write offline lm-eval task YAMLs for the local downstream data
and, with `--lambada FILE`, a local LAMBADA task."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lev.data.lm_eval_tasks import GROUP, TASKS, arrow_file, write_lm_eval_tasks
from megatron_lev.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="downstream data in the datasets.save_to_disk layout (ai2_arc/, piqa/, hellaswag/, winogrande/)",
    )
    parser.add_argument(
        "--lambada",
        default=None,
        metavar="FILE",
        help="also write local_lambada (lm-eval's lambada_openai) reading this file: .jsonl with a "
        "'text' per passage, or plain text, one passage per line",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="where the task YAMLs are written")
    parser.add_argument(
        "--tasks", nargs="+", default=None, choices=list(TASKS), help="a subset of the tasks (default: all)"
    )


def main(args: argparse.Namespace) -> int:
    from megatron_lev.commands.config_cmd import output_dir
    from megatron_lev.data.zero_shot_formats import read_lambada

    if args.data_dir is None and args.lambada is None:
        raise UserError("give --data-dir DIR (ARC, PIQA, HellaSwag, WinoGrande) and/or --lambada FILE")
    if args.data_dir is None and args.tasks:
        raise UserError("--tasks selects among the --data-dir tasks; give --data-dir DIR")
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise UserError(
            f"--data-dir {args.data_dir}: not a directory; give the downstream data saved with "
            "datasets.save_to_disk (ai2_arc/, piqa/, hellaswag/, winogrande/)"
        )
    # every input first, so a refused run writes nothing
    for name in (args.tasks or TASKS) if args.data_dir is not None else ():
        arrow_file(args.data_dir, TASKS[name][0])
    if args.lambada is not None:
        read_lambada(args.lambada)
    paths = write_lm_eval_tasks(args.data_dir, output_dir(args.out, "--out"), args.tasks, args.lambada)
    for path in paths:
        print(path)
    print(f"run: lm_eval --model hf --model_args pretrained=HF_DIR --include_path {args.out} --tasks {GROUP}")
    return 0
