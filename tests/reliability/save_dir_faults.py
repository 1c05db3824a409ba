"""A trainer callback for the tests: the save directory stops taking writes in the middle of a run.

train.callbacks=[tests.reliability.save_dir_faults:SaveDirTurnsReadOnly]
MEGATRON_LEV_TEST_READONLY_AT=6        the first save at or after this iteration
MEGATRON_LEV_TEST_READONLY_HOW=remount (a read-only remount of the bind mount the test made
                                       of train.save) or chmod (mode 0555: the process must
                                       not be exempt from permissions, i.e. not root with
                                       CAP_DAC_OVERRIDE)
"""

from __future__ import annotations

import os
import subprocess

from megatron_lev.training.hooks import Callback


class SaveDirTurnsReadOnly(Callback):
    def __init__(self) -> None:
        self.at = int(os.environ.get("MEGATRON_LEV_TEST_READONLY_AT", "1"))
        self.how = os.environ.get("MEGATRON_LEV_TEST_READONLY_HOW", "chmod")
        self.done = False

    def on_before_save(self, trainer) -> None:
        if self.done or trainer.state.iteration < self.at:
            return
        self.done = True
        if self.how == "remount":
            subprocess.run(["mount", "-o", "remount,ro,bind", str(trainer.save_dir)], check=True)
        else:
            os.chmod(trainer.save_dir, 0o555)
