"""Table-driven bad-input and fault cases: run a command, then check its exit status,
its one-line message and the state it left on disk.

`run_cli` calls the CLI in this process (fast; for bad input); `run_cli_process` starts
it as a real process with a timeout that turns a hang into a failure (for signals,
kills and anything that could hang or orphan a process).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tiny_run import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    rc: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.strip()]


def tiny_run_overrides(prefix, tokenizer, cache, out: Path, **extra) -> list[str]:
    """`tests.tiny_run.tiny_overrides` for 4 steps with a checkpoint every 2, the index cache in
    `cache`; `extra` adds, replaces or (None) drops keys."""
    return tiny_overrides(
        prefix, tokenizer, out, cache=cache, **{"train.train_iters": 4, "train.save_interval": 2, **extra}
    )


def run_cli(argv: list[str], capsys) -> Outcome:
    """`megatron-lev *argv` in this process; an exception escaping it fails the test."""
    from megatron_lev.cli import main

    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        rc = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return Outcome(rc, captured.out, captured.err)


def run_cli_process(
    argv: list[str], *, timeout: float = 120, env: dict | None = None, cwd=None, stdin=subprocess.DEVNULL
) -> Outcome:
    """`python -m megatron_lev *argv` as its own process group; a hang fails the test and
    the whole group is killed."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_lev", *map(str, argv)],
        cwd=cwd or ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=stdin,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"megatron-lev {' '.join(map(str, argv))} hung for {timeout}s:\n{err[-3000:]}")
    return Outcome(proc.returncode, out, err)


def expect_error(outcome: Outcome, *fragments: str, rc: int | None = None) -> str:
    """A non-zero exit with no traceback whose last stderr line names every fragment
    (case-insensitive regular expressions). Returns that line."""
    assert outcome.rc != 0, (
        f"expected a failure, got exit 0\nstdout: {outcome.out[-2000:]}\nstderr: {outcome.err[-2000:]}"
    )
    if rc is not None:
        assert outcome.rc == rc, f"exit {outcome.rc}, expected {rc}: {outcome.err[-2000:]}"
    assert "Traceback" not in outcome.err, f"traceback instead of one line:\n{outcome.err[-3000:]}"
    assert outcome.err_lines, f"exit {outcome.rc} with nothing on stderr; stdout: {outcome.out[-2000:]}"
    line = outcome.err_lines[-1]
    for frag in fragments:
        assert re.search(frag, line, re.IGNORECASE), f"{frag!r} not in the error line: {line!r}"
    return line


def expect_ok(outcome: Outcome) -> None:
    assert outcome.rc == 0, f"exit {outcome.rc}\nstdout: {outcome.out[-2000:]}\nstderr: {outcome.err[-3000:]}"


def leftover_processes(marker: str) -> list[str]:
    """Command lines of live processes containing `marker` (e.g. a unique tmp path)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if marker in cmd and ") Z " not in stat:
            found.append(f"{pid}: {cmd}")
    return found
