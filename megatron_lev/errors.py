"""Errors a user can fix. The CLI prints them as one line and exits non-zero.

Every error raised because of what a user gave (a file, a config key, a flag, a
checkpoint) derives from `UserError`; its message names the file, key or flag and
says what to do. Anything else is a bug and keeps its traceback. `--debug` (or
`MEGATRON_LEV_DEBUG=1`) shows the traceback of user errors too.
"""

from __future__ import annotations

import difflib


class UserError(Exception):
    """Bad input or a fault the user can act on; `str(exc)` is the whole message."""

    exit_code = 1


class DataError(UserError, ValueError):
    """A corpus, shard set, index or tokenizer is unusable; the message names the file."""


class CheckpointDataError(UserError, RuntimeError):
    """A checkpoint is missing, damaged or does not match the run."""


class ConfigError(UserError, ValueError):
    """A configuration value or combination is invalid; the message names the key."""

    exit_code = 2


class LaunchError(UserError, ValueError):
    """The launcher's environment (RANK, WORLD_SIZE, SLURM_*, ...) is partial or inconsistent;
    the message names the variable. Refused before the process joins a group, where it would wait."""

    exit_code = 2


class DistributedError(UserError, RuntimeError):
    """Another rank stopped answering: a collective or the rendezvous timed out, a peer died, or
    the heartbeat watchdog found a silent rank. The message names the rank when it is known."""


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """Refuse `value` of `key` unless it is one of `allowed`, listing them (and the closest)."""
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}{hint}")


class LockedError(UserError):
    """Another process is writing the same output (it holds its lock); the message names it."""

    exit_code = 1
