"""`megatron-lev lm-eval-tasks`: write offline lm-eval task YAMLs for the local downstream data."""

from __future__ import annotations

import argparse

from megatron_lev.checkpoint.lm_eval_tasks import GROUP, TASKS, write_lm_eval_tasks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", required=True, metavar="DIR",
                        help="downstream data in the datasets.save_to_disk layout (ai2_arc/, piqa/, hellaswag/, "
                             "winogrande/)")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the task YAMLs are written")
    parser.add_argument("--tasks", nargs="+", default=None, choices=list(TASKS),
                        help="a subset of the tasks (default: all)")


def main(args: argparse.Namespace) -> int:
    paths = write_lm_eval_tasks(args.data_dir, args.out, args.tasks)
    for path in paths:
        print(path)
    print(f"run: lm_eval --model hf --model_args pretrained=HF_DIR --include_path {args.out} --tasks {GROUP}")
    return 0
