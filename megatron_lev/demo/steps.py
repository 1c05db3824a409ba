"""A resumable pipeline of shell steps: each step runs once, records that it finished, and says why it failed.

A step is a command line (run through `python -m megatron_lev ...` or another program)
plus the files it must leave behind. A finished step writes `<out>/.steps/<name>.json`
(atomically) and is skipped on the next run, unless its outputs have gone missing.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lev.errors import UserError
from megatron_lev.utils.io import atomic_write_json


class StepFailed(UserError, RuntimeError):
    """A step's command exited non-zero or did not produce its outputs; `tail` holds the log's last lines."""

    def __init__(self, message: str, tail: str = ""):
        super().__init__(message)
        self.tail = tail


def read_marker(path: Path) -> dict | None:
    """A step's finish marker, or None if it is missing or damaged (the step then runs again)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class Step:
    name: str
    describe: str
    command: Callable[[], list[str]]  # built lazily: may depend on earlier steps' outputs
    outputs: Callable[[], list[Path]] = field(default=lambda: [])
    env: dict[str, str] = field(default_factory=dict)


class StepRunner:
    def __init__(self, out_dir: Path, force: bool = False, log=print):
        self.out_dir = Path(out_dir)
        self.state_dir = self.out_dir / ".steps"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.force = force
        self.log = log
        self.timings: dict[str, float] = {}

    def _marker(self, step: Step) -> Path:
        return self.state_dir / f"{step.name}.json"

    def is_done(self, step: Step) -> bool:
        if self.force or read_marker(self._marker(step)) is None:
            return False
        return all(Path(p).exists() for p in step.outputs())

    def run(self, steps: list[Step]) -> None:
        total = len(steps)
        for i, step in enumerate(steps, 1):
            header = f"[{i}/{total}] {step.name}: {step.describe}"
            if self.is_done(step):
                recorded = read_marker(self._marker(step)) or {}
                self.timings[step.name] = recorded.get("seconds", 0.0)
                self.log(f"{header} — already done, skipping")
                continue
            cmd = step.command()
            self.log(f"{header}\n    $ {shlex.join(cmd)}")
            env = dict(os.environ)
            env.update(step.env)
            log_path = self.out_dir / "logs" / f"{step.name}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            start = time.time()
            with open(log_path, "w") as log_file:
                log_file.write(f"$ {shlex.join(cmd)}\n")
                log_file.flush()
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1
                )
                assert proc.stdout is not None
                tail: list[str] = []
                for line in proc.stdout:
                    log_file.write(line)
                    tail = (tail + [line])[-30:]
                    if os.environ.get("MEGATRON_LEV_DEMO_QUIET") != "1":
                        sys.stdout.write("    " + line)
                        sys.stdout.flush()
                rc = proc.wait()
            seconds = time.time() - start
            if rc != 0:
                last = next((line.strip() for line in reversed(tail) if line.strip()), "no output")
                raise StepFailed(
                    f"step '{step.name}' failed (exit status {rc}) after {seconds:.0f}s: {last} "
                    f"(command and output in {log_path}); fix the cause and run the same command "
                    "again: finished steps are skipped",
                    "".join(tail),
                )
            missing = [str(p) for p in step.outputs() if not Path(p).exists()]
            if missing:
                raise StepFailed(
                    f"step '{step.name}' finished but did not produce {', '.join(missing)} (log: {log_path})"
                )
            self.timings[step.name] = seconds
            atomic_write_json(self._marker(step), {"seconds": seconds, "command": cmd})
            self.log(f"    done in {seconds:.1f}s")
