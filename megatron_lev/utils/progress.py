"""Progress bars on a terminal, plain periodic lines everywhere else.

    bar = progress_bar(total=n, desc="evaluating", unit="tok", disable=not progress)  # tqdm's arguments

On a terminal this is a tqdm bar. When its stream is not a terminal (a log file, a pipe, a Slurm
output file), a bar would write a carriage-return frame per refresh: thousands of them, megabytes
for one evaluation. There a tqdm subclass writes one plain line (no bar graphics) at most every
`PLAIN_INTERVAL_S` seconds, and the final state when it closes:

    evaluating: 120k/350k tok (34%) [00:30<00:58, 4.0k tok/s]

Every progress bar of the package is made here (`analysis.evaluate` only closes open ones).
"""

from __future__ import annotations

import io
import sys
import time
from typing import Any

PLAIN_INTERVAL_S = 30.0  # seconds between two plain progress lines


def on_terminal(stream=None) -> bool:
    """Whether `stream` (default stderr) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed, or a stream object without isatty
        return False


class _Discard(io.TextIOBase):
    """Where tqdm's own writes go in plain mode (`PlainProgress` writes its lines itself)."""

    def write(self, s: str) -> int:
        return len(s)


_plain_class = None


def _plain_progress_class():
    """`PlainProgress`: tqdm that writes its state as a plain line at most every `PLAIN_INTERVAL_S`
    seconds (whoever asks for a refresh: `update`, `set_postfix`, tqdm's monitor thread) and once
    more when it closes. Built on first use, so that importing this module does not import tqdm."""
    global _plain_class
    if _plain_class is None:
        from tqdm import tqdm

        class PlainProgress(tqdm):
            def __init__(self, *args, stream=None, **kwargs):
                self._plain_stream = stream if stream is not None else sys.stderr
                self._plain_last = time.monotonic()
                super().__init__(*args, file=_Discard(), **kwargs)

            def display(self, msg=None, pos=None):
                final = self.disable  # `close` disables the bar before its last display
                now = time.monotonic()
                if final or now - self._plain_last >= PLAIN_INTERVAL_S:
                    line = (self.__str__() if msg is None else msg).strip()
                    if line:
                        self._plain_stream.write(line + "\n")
                        self._plain_stream.flush()
                    self._plain_last = now
                return True

        _plain_class = PlainProgress
    return _plain_class


def progress_bar(iterable=None, **kwargs: Any):
    """A tqdm bar on a terminal, else a `PlainProgress` that writes plain lines (see the module doc)."""
    from tqdm import tqdm

    stream = kwargs.pop("file", None) or sys.stderr
    if kwargs.get("disable") or on_terminal(stream):
        return tqdm(iterable, file=stream, **kwargs)
    kwargs.pop("dynamic_ncols", None)
    kwargs.pop("ncols", None)
    total = kwargs.get("total")
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    desc = "{desc}: " if kwargs.get("desc") else ""
    unit = "" if str(kwargs.get("unit", "it")).startswith(" ") else " "
    if total:
        fmt = desc + "{n_fmt}/{total_fmt}" + unit + "{unit} ({percentage:.0f}%)"
        fmt += " [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
    else:
        fmt = desc + "{n_fmt}" + unit + "{unit} [{elapsed}, {rate_fmt}{postfix}]"
    return _plain_progress_class()(iterable, stream=stream, bar_format=fmt, **kwargs)


def hf_bars_off_a_terminal() -> None:
    """Hugging Face libraries draw their own tqdm bars (transformers' "Loading weights" in every
    `from_pretrained`, datasets' and the hub's): off a terminal each refresh is a line in the log
    that says nothing (a local model loads in a second), so turn them off there; on a terminal
    they stay. Call it after importing the library and before using it."""
    if on_terminal():
        return
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


__all__ = ["PLAIN_INTERVAL_S", "hf_bars_off_a_terminal", "on_terminal", "progress_bar"]
