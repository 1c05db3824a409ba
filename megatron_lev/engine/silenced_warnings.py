"""Third-party warnings every run printed that say nothing a user can act on, silenced at their source.

Installed when the `engine` package is imported, before anything imports DeepSpeed (only `engine`
does), so DeepSpeed's own import-time messages are covered too. Only these messages are dropped;
every other warning of DeepSpeed and torch still shows.

- DeepSpeed "You are using ZeRO with an untested optimizer": it warns about any optimizer outside
  its own list. Ours is `optim.GuardedAdamW`, torch's AdamW with the non-finite guard, passed on
  purpose (`zero_allow_untested_optimizer` in `plan.ds_config`); `tests/reliability/test_layouts.py`
  checks every ZeRO stage trains like one process with it.
- DeepSpeed "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
  detect it": printed by every command that imports DeepSpeed on a machine without CUDA (convert,
  evaluate, reshard, ...) unless DS_ACCELERATOR is set. CPU is what this project runs on there, and
  `train` names its device in its first line; set DS_ACCELERATOR to choose explicitly.
- torch's FutureWarning "`torch.distributed.all_gather_into_tensor` is deprecated": DeepSpeed's
  ZeRO-1/2 optimizer gathers its partitions with it after every step (torch >= 2.13); nothing in this
  project calls it. Drop the filter once DeepSpeed uses the new collective.
"""

from __future__ import annotations

import logging
import warnings

DEEPSPEED_LOGGER = "DeepSpeed"  # `deepspeed.utils.logger`; getLogger returns the same object before and after
DROPPED_DEEPSPEED_MESSAGES = (
    "**** You are using ZeRO with an untested optimizer",
    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it",
)
DROPPED_WARNINGS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",)


class DropMessages(logging.Filter):
    """Drops log records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def quiet_known_warnings() -> None:
    """Install the filters (idempotent)."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, DropMessages) for f in logger.filters):
        logger.addFilter(DropMessages(DROPPED_DEEPSPEED_MESSAGES))
    for message in DROPPED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
