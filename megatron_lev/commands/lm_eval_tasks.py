"""`megatron-lev lm-eval-tasks`: write offline lm-eval task YAMLs for the local downstream data."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lev.checkpoint.lm_eval_tasks import GROUP, TASKS, arrow_file, write_lm_eval_tasks
from megatron_lev.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        required=True,
        metavar="DIR",
        help="downstream data in the datasets.save_to_disk layout (ai2_arc/, piqa/, hellaswag/, winogrande/)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="where the task YAMLs are written")
    parser.add_argument(
        "--tasks", nargs="+", default=None, choices=list(TASKS), help="a subset of the tasks (default: all)"
    )


def main(args: argparse.Namespace) -> int:
    from megatron_lev.commands.config_cmd import output_dir

    if not Path(args.data_dir).is_dir():
        raise UserError(
            f"--data-dir {args.data_dir}: not a directory; give the downstream data saved with "
            "datasets.save_to_disk (ai2_arc/, piqa/, hellaswag/, winogrande/)"
        )
    for name in args.tasks or TASKS:  # every input first, so a refused run writes nothing
        arrow_file(args.data_dir, TASKS[name][0])
    paths = write_lm_eval_tasks(args.data_dir, output_dir(args.out, "--out"), args.tasks)
    for path in paths:
        print(path)
    print(f"run: lm_eval --model hf --model_args pretrained=HF_DIR --include_path {args.out} --tasks {GROUP}")
    return 0
