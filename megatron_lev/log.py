"""Rank-aware logging: rank 0 prints to the console, every rank may also log to a file."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from megatron_lev.utils.dist import launcher_rank

_FORMAT = "%(asctime)s [%(levelname)s] [rank %(rank)s] %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = launcher_rank()
        return True


def setup_logging(
    level: str | int = "INFO", log_dir: str | os.PathLike | None = None, all_ranks_to_console: bool = False
) -> logging.Logger:
    """Configure the `megatron_lev` logger.

    Rank 0 (or every rank with `all_ranks_to_console`) logs to stderr; with `log_dir`
    every rank also writes `log_dir/rank{N}.log`. Safe to call more than once.
    """
    logger = logging.getLogger("megatron_lev")
    logger.setLevel(level)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    rank = launcher_rank()
    fmt = logging.Formatter(_FORMAT, datefmt="%H:%M:%S")
    if rank == 0 or all_ranks_to_console:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(fmt)
        console.addFilter(_RankFilter())
        logger.addHandler(console)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
        fh.setFormatter(fmt)
        fh.addFilter(_RankFilter())
        logger.addHandler(fh)
    return logger


def get_logger(name: str) -> logging.Logger:
    """A child of the package logger: `get_logger(__name__)`."""
    if not name.startswith("megatron_lev"):
        name = f"megatron_lev.{name}"
    return logging.getLogger(name)
