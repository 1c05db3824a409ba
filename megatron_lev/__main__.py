import sys

if sys.argv[1:2] == ["train"] or sys.argv[1:3] == ["--debug", "train"]:
    # a preemption notice in the first moments must still exit 75 (requeue): install before any import
    from megatron_lev.training.signals import install_startup_handler

    install_startup_handler()

from megatron_lev.cli import main  # noqa: E402

code = main()
session = sys.modules.get("megatron_lev.parallel.session")  # never imported: no group was joined
if session is not None:
    session.end_process(code)  # a rank that left a group of several ranks ends here, unfinalized
sys.exit(code)
