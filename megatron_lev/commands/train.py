"""`megatron-lev train`: pretrain (or resume) a model; exits 75 when preempted so Slurm can requeue.

    torchrun --nproc_per_node 8 -m megatron_lev train --config pretrain/configs/tiny.yaml \
        data.data_path=[data/minipile_text_document] data.tokenizer_path=tok.json logging.output_dir=runs/x
"""

from __future__ import annotations

import argparse

from megatron_lev.training.signals import exit_kind, install_startup_handler, report_exit_code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The first code of a `train` run: from here on SIGTERM/SIGUSR1 exit 75 (requeue) instead of 143.
    install_startup_handler()
    from megatron_lev.commands.config_cmd import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument(
        "--allow-change",
        action="append",
        default=[],
        metavar="KEY",
        help="resume although config KEY (e.g. train.lr) differs from the checkpoint's; "
        "repeatable; model keys can never change",
    )


def main(args: argparse.Namespace) -> int:
    from megatron_lev.training.rendezvous import distributed_session

    code, kind = 1, None
    try:
        # every exit (done, error, preempted) leaves the process group the same way: the watchdog
        # stopped, every group destroyed without a barrier, the logs flushed
        with distributed_session():
            code = _train(args)
        return code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        raise
    except BaseException as exc:
        code = getattr(exc, "exit_code", 1)
        kind = exit_kind(code, exc)  # a launcher restarts a crash, never a config or data error
        raise
    finally:
        report_exit_code(code, kind)


def _train(args: argparse.Namespace) -> int:
    import torch

    from megatron_lev.commands.config_cmd import config_files_and_overrides
    from megatron_lev.config import load_config
    from megatron_lev.plan import validate_run
    from megatron_lev.training.rendezvous import read_dist_env

    files, overrides = config_files_and_overrides(args)
    world_size = read_dist_env().world_size
    cfg = load_config(files, overrides, validate=False)  # parsed and type-checked; validated just below
    # every rule once, before anything heavy; the plan carries what they derive down to the engine
    cuda = torch.cuda.is_available()
    plan = validate_run(cfg, world_size, cuda=cuda)
    if not cuda:
        from megatron_lev.utils.host_malloc import keep_freed_memory

        keep_freed_memory()  # with MEGATRON_LEV_HOST_MALLOC=1: a step's large buffers are reused

    from megatron_lev.convert.warm_start import warm_start
    from megatron_lev.training.run import pretrain

    return pretrain(plan, allow_changes=args.allow_change, init_weights=warm_start).exit_code
