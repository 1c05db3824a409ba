"""Errors a user can fix. The CLI prints them as one line and exits non-zero.

Every error raised because of what a user gave (a file, a config key, a flag, a
checkpoint) derives from `UserError`; its message names the file, key or flag and
says what to do. Anything else is a bug and keeps its traceback. `--debug` (or
`MEGATRON_LEV_DEBUG=1`) shows the traceback of user errors too.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input or a fault the user can act on; `str(exc)` is the whole message."""

    exit_code = 1


class DataError(UserError, ValueError):
    """A corpus, shard set, index or tokenizer is unusable; the message names the file."""


class CheckpointDataError(UserError, RuntimeError):
    """A checkpoint is missing, damaged or does not match the run."""
