"""A stand-in trainer for `scripts/torchrun_local.sh`: rank 1 is killed by SIGKILL (as the
out-of-memory killer does) while the other ranks are still starting up, with the trainer's
start-up preemption handler installed. torchrun then stops the other ranks with SIGTERM,
and they report 75 like a preempted trainer would.

    ENTRY="-m tests.reliability.rank_crash_probe" NPROC=2 scripts/torchrun_local.sh --go
"""

from __future__ import annotations

import os
import signal
import sys
import time

from megatron_lev.training.signals import install_startup_handler


def main() -> int:
    install_startup_handler()
    if os.environ.get("RANK") == "1":
        # the launcher quotes this line when it reports the death
        os.write(2, b"rank 1: loading the model (the last line before the kill)\n")
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # "importing torch": torchrun stops this rank long before
    return 0


if __name__ == "__main__":
    sys.exit(main())
