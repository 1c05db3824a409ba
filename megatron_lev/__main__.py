import sys

if sys.argv[1:2] == ["train"] or sys.argv[1:3] == ["--debug", "train"]:
    # a preemption notice in the first moments must still exit 75 (requeue): install before any import
    from megatron_lev.training.signals import install_startup_handler

    install_startup_handler()

from megatron_lev.cli import entry  # noqa: E402

entry()
