"""`megatron-lev train`: pretrain (or resume) a model; exits 75 when preempted so Slurm can requeue.

    torchrun --nproc_per_node 8 -m megatron_lev train --config pretrain/configs/tiny.yaml \
        data.data_path=[data/minipile_text_document] data.tokenizer_path=tok.json logging.output_dir=runs/x
"""

from __future__ import annotations

import argparse

from megatron_lev.commands.config_cmd import add_config_arguments, config_files_and_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import torch

    from megatron_lev.config import load_config
    from megatron_lev.training.ds_config import validate_training
    from megatron_lev.training.launch import read_dist_env

    files, overrides = config_files_and_overrides(args)
    world_size = read_dist_env().world_size
    cfg = load_config(files, overrides, world_size=world_size)
    validate_training(cfg, world_size, cuda=torch.cuda.is_available())  # before anything heavy

    from megatron_lev.training.run import pretrain

    return pretrain(cfg).exit_code
