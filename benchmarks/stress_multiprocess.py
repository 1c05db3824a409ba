"""Repeat the 2-process CPU (gloo) training layouts through the real CLI and count the failures.

    python benchmarks/stress_multiprocess.py --runs 14                        # two passes over the layouts
    python benchmarks/stress_multiprocess.py --minutes 240 --out runs/stress-night
    python benchmarks/stress_multiprocess.py --layouts pp2-zero0 --runs 300 --timeout 180

Every run is the command a user types, `torchrun --standalone --nproc_per_node 2 -m megatron_lev
train --config pretrain/configs/tiny.yaml <overrides>`: a tiny LEV model (hidden 64, 4 heads,
2 KV heads, sequence 32, micro-batch 2, global batch 4, fp32, `--steps` steps, default 3) on the
first 300 Wikipedia documents of the shared minipile sample, preprocessed once into OUT/data with
`megatron-lev preprocess` (sample indices prebuilt with `megatron-lev build-indices`).

Layouts: `dp2-zeroZ`, `tp2-zeroZ` and `pp2-zeroZ` (Z the ZeRO stage, 0-3), and `resume-<layout>`:
train N steps saving a checkpoint, then rerun the same command with 2N steps, which resumes from
it. The default set is every layout with ZeRO 0 and 1 plus `resume-dp2-zero1`, run round-robin. A
layout the config refuses (ZeRO-2/3 with pipeline parallelism, ...) is skipped with the config's
own message.

A run fails when torchrun exits non-zero or dies by a signal; when a command outlives --timeout
(class "timeout": its processes get SIGABRT first, so faulthandler prints every Python thread's
stack into the log, then SIGKILL); when a rank process outlives torchrun ("leftover-process", then
killed); or when it exits 0 without its results ("bad-output": every step in metrics.jsonl with a
finite loss, the end event, the last checkpoint in `latest`, the resume naming the saved
iteration). Failures are grouped by signature: the class and the first telling stderr line
(`terminate called ...`, a fatal error, the first exception line, the CLI's one-line error, the
launcher's report), with numbers, paths, addresses and pids normalised away.

Under OUT: data/ (shards and index cache); run_NNNN/ with <phase>.stdout.log and
<phase>.stderr.log per command (phase `train`, or `save` then `resume`), result.json (commands,
exit codes, signals, seconds, the failure class and signature) and train/ (the run's output
directory; its checkpoints are deleted after a passing run unless --keep-checkpoints); and
summary.json. The summary, printed at the end and on Ctrl-C: runs, failures, the failure rate
with a 95% interval (Wilson; with no failure the one-sided exact binomial upper bound), seconds
per run by layout, and per signature its count, the layouts it appeared in and the first lines of
one log. Exit status: 0 without failures, 1 with any, 130 when interrupted.

Campaigns too long for one sitting add up from batches: `--record FILE --label before|after`
also writes the batch into FILE without machine paths (the commit it ran on, its options and its
run records; a failed run's excerpt keeps its lines), and

    python benchmarks/stress_multiprocess.py --report benchmarks/results/stress

sums every batch file of that folder by label, prints each label's summary and rewrites
`<folder>.md` from them (runs and failures per batch, the rate with its interval, seconds per run
by layout, every distinct failure with its first lines).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import itertools
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "pretrain" / "configs" / "tiny.yaml"
WORLD = 2
KINDS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}  # name -> (TP, PP); DP = WORLD / (TP x PP)
DEFAULT_LAYOUTS = [*(f"{kind}-zero{z}" for kind in KINDS for z in (0, 1)), "resume-dp2-zero1"]
LAYOUT_RE = re.compile(r"^(resume-)?(dp2|tp2|pp2)-zero([0-3])$")
MODEL = {  # the tiny run of the issue
    "model.hidden_size": 64,
    "model.num_attention_heads": 4,
    "model.num_kv_heads": 2,
    "model.seq_length": 32,
    "train.micro_batch_size": 2,
    "train.global_batch_size": 4,
}
CORPUS = Path("minipile") / "Wikipedia_en.jsonl.zst"
TOKENIZER = Path("tokenizers") / "gpt-neox-20b.json"
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)
ABORT_GRACE_S = 10.0  # after SIGABRT at a timeout, before SIGKILL
LEFTOVER_GRACE_S = 5.0  # a rank may take this long to go after torchrun exits
EXCERPT_BEFORE, EXCERPT_AFTER = 3, 12


# ---------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    pp: int
    zero: int
    resume: bool

    @classmethod
    def parse(cls, name: str) -> Layout:
        m = LAYOUT_RE.match(name)
        if not m:
            raise ValueError(
                f"unknown layout {name!r}: use dp2-zeroZ, tp2-zeroZ, pp2-zeroZ (Z in 0-3), "
                "optionally prefixed by resume-, e.g. pp2-zero0 or resume-dp2-zero1"
            )
        tp, pp = KINDS[m.group(2)]
        return cls(name, tp, pp, int(m.group(3)), bool(m.group(1)))

    def overrides(self) -> dict:
        return {
            "parallel.tensor_model_parallel_size": self.tp,
            "parallel.pipeline_model_parallel_size": self.pp,
            "parallel.zero_stage": self.zero,
        }

    def phases(self, steps: int) -> list[tuple[str, int, int]]:
        """(name, first iteration, last iteration) of each command of one run."""
        return [("save", 0, steps), ("resume", steps, 2 * steps)] if self.resume else [("train", 0, steps)]


@dataclass(frozen=True)
class DataSet:
    prefix: Path
    tokenizer: Path
    cache: Path


def run_overrides(data: DataSet, out: Path, layout: Layout, iters: int, extra: list[str]) -> list[str]:
    base = {
        "data.data_path": f"[{data.prefix}]",
        "data.tokenizer_path": data.tokenizer,
        "data.split": "100,0,0",
        "data.cache_dir": data.cache,
        **MODEL,
        "train.train_iters": iters,
        "train.save": out / "ckpt",
        "logging.output_dir": out,
        "logging.log_interval": 1,  # every step in metrics.jsonl: the output check counts them
        "logging.progress_bar": "false",
        "logging.tensorboard": "false",
        **layout.overrides(),
    }
    return [f"{k}={v}" for k, v in base.items()] + list(extra)


def _checkout_importable() -> None:
    """`import megatron_lev` finds this checkout's package (a `before` batch runs an old commit)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def refusal(layout: Layout, data: DataSet, extra: list[str]) -> str | None:
    """The config's one-line message when it refuses this layout on 2 CPU processes, else None."""
    _checkout_importable()
    from megatron_lev.config import ConfigError, load_config

    try:
        from megatron_lev.plan.ds_config import validate_training
    except ImportError:  # moved: the run itself will refuse what validate_config lets through
        from megatron_lev.plan import validate_config

        def validate_training(cfg, world, cuda):
            validate_config(cfg, world)

    try:
        cfg = load_config([TINY], run_overrides(data, ROOT / "runs" / "unused", layout, 1, extra))
        validate_training(cfg, WORLD, cuda=False)
    except ConfigError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------- failure signatures

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RANK_PREFIX = re.compile(r"^\[(?:rank|default)\d+\]:\s?")
STAMP = re.compile(r"^\[?(?:\d{4}-\d\d-\d\d[ T])?\d\d:\d\d:\d\d(?:[.,]\d+)?\]?\s+")
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+\s+")  # torchrun's "E1201 16:17:13.414000 15589 "
KEY_PATTERNS = [  # in order of preference; the first line matching the earliest pattern is the key
    re.compile(r"terminate called"),
    re.compile(r"Fatal Python error|Segmentation fault|double free|corrupted (?:size|double)|stack smashing"),
    re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt|Exit)\b(?::|$)"),
    re.compile(r":(?: config)? error: "),
    re.compile(r"\[(?:ERROR|CRITICAL)\]"),
    re.compile(r"Signal \d+ \(SIG\w+\) received by PID"),
    re.compile(r"failed \(exitcode: -?\d+\)"),
]
LAUNCHER_PATTERNS = KEY_PATTERNS[-2:]
NOT_KEY = re.compile(r"ChildFailedError|elastic\.multiprocessing\.errors|^To enable traceback")
BANNER = re.compile(r"^[=\-*]{8,}$")


def clean(line: str) -> str:
    """A log line without colour codes, rank prefixes and leading time stamps."""
    line = ANSI.sub("", line).strip()
    line = RANK_PREFIX.sub("", line)
    return GLOG.sub("", STAMP.sub("", line)).strip()


def _path(m: re.Match) -> str:
    base = m.group(0).rstrip("/").rsplit("/", 1)[-1]
    return f"<path>/{base}" if base else "<path>"


def normalise(line: str) -> str:
    """The parts of an error line that stay the same from one run to the next."""
    s = clean(line)
    s = re.sub(r"\[rank ?\d+\]\s*", "", s)
    s = re.sub(r"\b[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\b", "<uuid>", s)
    s = re.sub(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b", "<addr>", s)
    s = re.sub(r"\blocalhost:\d+\b", "<addr>", s)
    s = re.sub(r"(?<![\w.~])(?:~|\.{1,2})?(?:/[^\s/:'\"(),\[\]<>]+)+/?", _path, s)
    s = re.sub(r"0x[0-9a-fA-F]+", "<hex>", s)
    s = re.sub(r"(?<![0-9A-Za-z])(?=[0-9a-f]*\d)[0-9a-f]{8,}(?![0-9A-Za-z])", "<hex>", s)
    s = re.sub(r"(?<![A-Za-z\d])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", "<n>", s)  # not in c10, fp32
    s = re.sub(r"\s+", " ", s).strip()
    return s[:240]


def key_line(stderr: str, stdout: str = "") -> tuple[int, str] | None:
    """(index in stderr's lines, line) of the most telling error line; (-1, line) when it comes
    from stdout; None when both are empty."""
    lines = stderr.splitlines()
    cleaned = [clean(x) for x in lines]
    root = next((i for i in range(len(lines) - 1, -1, -1) if "Root Cause" in lines[i]), 0)
    root_first = [*range(root, len(lines)), *range(root)]  # the launcher's report: its root cause first
    for pattern in KEY_PATTERNS:
        for i in root_first if pattern in LAUNCHER_PATTERNS else range(len(lines)):
            c = cleaned[i]
            if c and pattern.search(c) and not NOT_KEY.search(c):
                return i, lines[i]
    for i in range(len(lines) - 1, -1, -1):
        if cleaned[i] and not BANNER.match(cleaned[i]) and not NOT_KEY.search(cleaned[i]):
            return i, lines[i]
    out = [x for x in stdout.splitlines() if x.strip()]
    return (-1, out[-1]) if out else None


def signature_of(klass: str, stderr: str, stdout: str = "") -> tuple[str, list[str]]:
    """The run's signature and the first lines of its log around the key line."""
    found = key_line(stderr, stdout)
    if found is None:
        return f"{klass} | (no output)", []
    i, line = found
    text = normalise(line)
    lines = stderr.splitlines()
    if (
        i >= 0
        and "terminate called after throwing" in line
        and i + 1 < len(lines)
        and "what()" in lines[i + 1]
    ):
        text += " / " + normalise(lines[i + 1])
    excerpt = lines[max(0, i - EXCERPT_BEFORE) : i + EXCERPT_AFTER] if i >= 0 else [line]
    return f"{klass} | {text}", excerpt


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"SIG{num}"


def rank_exit_codes(stderr: str) -> list[int]:
    """The ranks' exit codes in torchrun's failure report, the root cause (first observed failure)
    first; the others are mostly ranks torchrun itself stopped with SIGTERM."""
    codes = [int(x) for x in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)]
    root = stderr.rfind("Root Cause")
    if root >= 0:
        m = re.search(r"exitcode\s*:\s*(-?\d+)", stderr[root:])
        if m:
            codes.remove(int(m.group(1)))
            codes.insert(0, int(m.group(1)))
    elif not codes:
        codes = [int(x) for x in re.findall(r"failed \(exitcode: (-?\d+)\)", stderr)]
    return codes


def classify(rc: int | None, timed_out: bool, stderr: str, leftover: int = 0, problems=()) -> str | None:
    """The failure class of one command, None when it passed."""
    if timed_out:
        return "timeout"
    if rc is not None and rc < 0:
        return f"signal:{signal_name(-rc)}"
    if rc:
        codes = rank_exit_codes(stderr)
        if codes and codes[0] < 0:
            return f"rank-signal:{signal_name(-codes[0])}"
        return f"exit:{codes[0] if codes else rc}"
    if leftover:
        return "leftover-process"
    if problems:
        return "bad-output"
    return None


# ---------------------------------------------------------------- statistics and the summary


def rate_interval(failures: int, runs: int, confidence: float = 0.95) -> tuple[float, float, str] | None:
    """(low, high, method) for the failure rate: Wilson's score interval, or with no failure the
    one-sided exact binomial upper bound 1 - (1 - confidence)^(1/n) (about 3/n)."""
    if runs <= 0:
        return None
    if failures == 0:
        return 0.0, 1.0 - (1.0 - confidence) ** (1.0 / runs), "one-sided exact binomial upper bound"
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    p = failures / runs
    denom = 1 + z * z / runs
    centre = (p + z * z / (2 * runs)) / denom
    half = z * math.sqrt(p * (1 - p) / runs + z * z / (4 * runs * runs)) / denom
    return max(0.0, centre - half), min(1.0, centre + half), "Wilson score interval"


def pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def rate_line(failures: int, runs: int) -> str:
    iv = rate_interval(failures, runs)
    if iv is None:
        return "no finished run"
    low, high, method = iv
    if failures == 0:
        return f"0 failures in {runs} runs, 95% upper bound {pct(high)} ({method})"
    return (
        f"{failures} failure{'s' if failures != 1 else ''} in {runs} runs ({pct(failures / runs)}), "
        f"95% interval {pct(low)} - {pct(high)} ({method})"
    )


def _seconds(values: list[float]) -> dict:
    if not values:
        return {}
    return {
        "median": round(statistics.median(values), 2),
        "mean": round(statistics.fmean(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def summarise(records: list[dict]) -> dict:
    """The summary of run records (`status` ok / failed / interrupted, `layout`, `seconds`,
    `phases`; failed ones also `klass`, `signature`, `phase`, `log`, `excerpt`)."""
    done = [r for r in records if r["status"] in ("ok", "failed")]
    failed = [r for r in done if r["status"] == "failed"]
    iv = rate_interval(len(failed), len(done))
    layouts: dict[str, dict] = {}
    for r in done:
        entry = layouts.setdefault(r["layout"], {"runs": 0, "failures": 0, "_s": [], "_phases": {}})
        entry["runs"] += 1
        entry["failures"] += r["status"] == "failed"
        entry["_s"].append(r["seconds"])
        for ph in r.get("phases", []):
            entry["_phases"].setdefault(ph["name"], []).append(ph["seconds"])
    for entry in layouts.values():
        entry["seconds"] = _seconds(entry.pop("_s"))
        phases = entry.pop("_phases")
        if len(phases) > 1:
            entry["phase_seconds"] = {name: _seconds(v) for name, v in phases.items()}
    signatures: dict[str, dict] = {}
    for r in failed:
        sig = signatures.setdefault(
            r["signature"],
            {
                "signature": r["signature"],
                "klass": r["klass"],
                "count": 0,
                "layouts": Counter(),
                "runs": [],
                "example": {"run": r["run"], "log": r.get("log"), "lines": r.get("excerpt", [])},
            },
        )
        sig["count"] += 1
        where = r["layout"] if r.get("phase") in (None, "train") else f"{r['layout']}:{r['phase']}"
        sig["layouts"][where] += 1
        sig["runs"].append(r["run"])
    ordered = sorted(signatures.values(), key=lambda s: (-s["count"], s["signature"]))
    for s in ordered:
        s["layouts"] = dict(sorted(s["layouts"].items()))
    return {
        "runs": len(done),
        "failures": len(failed),
        "interrupted": sum(r["status"] == "interrupted" for r in records),
        "failure_rate": len(failed) / len(done) if done else None,
        "interval_95": {"low": iv[0], "high": iv[1], "method": iv[2]} if iv else None,
        "rate_line": rate_line(len(failed), len(done)),
        "layouts": dict(sorted(layouts.items())),
        "signatures": ordered,
    }


def format_summary(summary: dict) -> str:
    out = [f"runs {summary['runs']}, failures {summary['failures']}: {summary['rate_line']}"]
    if summary["interrupted"]:
        out.append(f"({summary['interrupted']} run(s) interrupted, not counted)")
    if summary["layouts"]:
        out.append("")
        out.append(f"{'layout':<22}{'runs':>6}{'fail':>6}   seconds per run: median (min - max)")
        for name, e in summary["layouts"].items():
            s = e["seconds"]
            line = f"{name:<22}{e['runs']:>6}{e['failures']:>6}   "
            line += f"{s['median']:.1f} ({s['min']:.1f} - {s['max']:.1f})"
            if "phase_seconds" in e:
                line += "; " + ", ".join(f"{k} {v['median']:.1f}" for k, v in e["phase_seconds"].items())
            out.append(line)
    if summary["signatures"]:
        out.append("")
        out.append(f"{len(summary['signatures'])} distinct failure signature(s):")
        for s in summary["signatures"]:
            where = ", ".join(f"{k} x{v}" for k, v in s["layouts"].items())
            out.append(f"  [{s['count']}x] {s['signature']}")
            out.append(f"      layouts: {where}")
            out.append(f"      runs: {', '.join(s['runs'][:10])}{' ...' if len(s['runs']) > 10 else ''}")
            ex = s["example"]
            out.append(f"      example log: {ex['log']}")
            out.extend(f"      | {line}" for line in ex["lines"])
    return "\n".join(out)


# ---------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks, state) from /proc, None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0]


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of `root` (ranks run in sessions of their own,
    so a process-group kill of the launcher does not reach them)."""
    children: dict[int, list[int]] = {}
    starts = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _proc_stat(int(entry))
        if st is None or st[2] == "Z":
            continue
        children.setdefault(st[0], []).append(int(entry))
        starts[int(entry)] = st[1]
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = starts[pid]
            stack.extend(children.get(pid, []))
    return found


def _alive(pid: int, start: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[1] == start and st[2] != "Z"


def _signal_known(known: dict[int, int], sig: int) -> None:
    """Send `sig` to the processes seen earlier that are still the same processes."""
    for pid, start in known.items():
        if _alive(pid, start):
            with contextlib.suppress(ProcessLookupError):  # exited since it was seen
                os.kill(pid, sig)


class Run:
    """One run of a layout: one command (or the save/resume pair) under OUT/run_NNNN."""

    def __init__(self, index: int, layout: Layout, run_dir: Path, commands: list[tuple[str, int, int, list]]):
        self.index, self.layout = index, layout
        self.name = run_dir.name
        self.dir = run_dir
        self.commands = commands
        self.phases: list[dict] = []
        self.proc: subprocess.Popen | None = None
        self.files: list = []
        self.known: dict[int, int] = {}
        self.started = time.time()
        self.load = os.getloadavg()[0]
        self.failure: dict | None = None

    # the command in flight
    def start_next(self, env: dict) -> None:
        name, first, last, cmd = self.commands[len(self.phases)]
        out = self.dir / f"{name}.stdout.log"
        err = self.dir / f"{name}.stderr.log"
        self.files = [open(out, "wb"), open(err, "wb")]  # noqa: SIM115 - closed in _finish_phase
        self.phase_t0 = time.monotonic()
        self.last_scan = 0.0
        self.known = {}
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.files[0],
            stderr=self.files[1],
            start_new_session=True,
        )
        self.phases.append(
            {
                "name": name,
                "first_iteration": first,
                "last_iteration": last,
                "command": shlex.join(cmd),
                "stdout": str(out),
                "stderr": str(err),
                "pid": self.proc.pid,
                "rc": None,
                "signal": None,
                "timed_out": False,
                "seconds": None,
            }
        )

    def _scan(self) -> None:
        self.known.update(descendants(self.proc.pid))
        self.last_scan = time.monotonic()

    def _kill_all(self, sig: int) -> None:
        if self.proc.poll() is None:
            self._scan()
        _signal_known(self.known, sig)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def _stop(self, first_signal: int) -> None:
        """`first_signal` to the ranks, then SIGKILL to everything the run started."""
        self._scan()
        _signal_known(self.known, first_signal)
        with contextlib.suppress(subprocess.TimeoutExpired):  # the SIGKILL below ends it
            self.proc.wait(timeout=ABORT_GRACE_S)
        self._kill_all(signal.SIGKILL)
        self.proc.wait()

    def poll(self, env: dict, timeout: float, faulthandler: bool) -> bool:
        """Advance the run; True when it has finished."""
        phase = self.phases[-1]
        now = time.monotonic()
        if self.proc.poll() is None:
            if now - self.last_scan > 1.0:
                self._scan()
            if now - self.phase_t0 <= timeout:
                return False
            phase["timed_out"] = True
            phase["stderr_bytes_at_timeout"] = Path(phase["stderr"]).stat().st_size
            self._stop(signal.SIGABRT if faulthandler else signal.SIGTERM)
        self._finish_phase(phase)
        if self.failure is None and len(self.phases) < len(self.commands):
            self.start_next(env)
            return False
        return True

    def _finish_phase(self, phase: dict) -> None:
        rc = self.proc.wait()
        phase["seconds"] = round(time.monotonic() - self.phase_t0, 2)
        for f in self.files:
            f.close()
        phase["rc"] = rc
        phase["signal"] = signal_name(-rc) if rc < 0 else None
        leftover = []
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while True:
            leftover = [pid for pid, start in self.known.items() if _alive(pid, start)]
            if not leftover or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if leftover:
            phase["leftover_pids"] = leftover
            _signal_known(self.known, signal.SIGKILL)
        stderr = Path(phase["stderr"]).read_bytes()
        if phase["timed_out"]:
            stderr = stderr[: phase["stderr_bytes_at_timeout"]]
        stderr_text = stderr.decode(errors="replace")
        problems = []
        if rc == 0 and not phase["timed_out"]:
            problems = check_outputs(self.dir / "train", phase, stderr_text)
            phase["problems"] = problems
        klass = classify(rc, phase["timed_out"], stderr_text, len(leftover), problems)
        if klass is None:
            return
        stdout_text = Path(phase["stdout"]).read_text(errors="replace")
        if klass == "leftover-process":
            sig, excerpt = f"{klass} | {len(leftover)} rank process(es) outlived torchrun", []
        elif klass == "bad-output":
            sig, excerpt = f"{klass} | {normalise(problems[0])}", problems
        else:
            sig, excerpt = signature_of(klass, stderr_text, stdout_text)
        self.failure = {
            "klass": klass,
            "signature": sig,
            "phase": phase["name"],
            "log": phase["stderr"],
            "excerpt": excerpt,
        }

    def abort(self) -> None:
        """Ctrl-C: stop whatever is in flight; the run is not counted."""
        if self.proc is not None and self.proc.poll() is None:
            self._stop(signal.SIGTERM)
        for f in self.files:
            f.close()

    def record(self, status: str | None = None) -> dict:
        rec = {
            "run": self.name,
            "index": self.index,
            "layout": self.layout.name,
            "dir": str(self.dir),
            "status": status or ("failed" if self.failure else "ok"),
            "started": datetime.datetime.fromtimestamp(self.started).isoformat(timespec="seconds"),
            "load_average": round(self.load, 2),
            "seconds": round(sum(p["seconds"] or 0 for p in self.phases), 2),
            "rc": self.phases[-1]["rc"] if self.phases else None,
            "phases": self.phases,
        }
        if self.failure and rec["status"] == "failed":
            rec.update(self.failure)
        return rec


def _metrics(path: Path) -> list[dict] | str:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        return f"metrics.jsonl unreadable: {exc}"


def check_outputs(out: Path, phase: dict, stderr: str) -> list[str]:
    """What a command that exited 0 should have left: every step of this command in metrics.jsonl
    with a finite loss, its end event with exit code 0, `latest` naming the last step; a resume
    must say it resumed from the saved iteration."""
    first, last = phase["first_iteration"], phase["last_iteration"]
    rows = _metrics(out / "metrics.jsonl")
    if isinstance(rows, str):
        return [rows]
    starts = [i for i, r in enumerate(rows) if r.get("kind") == "event" and r.get("event") == "start"]
    if not starts:
        return ["metrics.jsonl has no start event"]
    rows = rows[starts[-1] :]
    problems = []
    train = [r for r in rows if r.get("kind") == "train"]
    iters = [r.get("iteration") for r in train]
    if iters != list(range(first + 1, last + 1)):
        problems.append(f"metrics.jsonl steps {iters}, expected {first + 1} to {last}")
    bad = [r.get("iteration") for r in train if not math.isfinite(float(r.get("loss", "nan")))]
    if bad:
        problems.append(f"non-finite loss at step(s) {bad}")
    ends = [r for r in rows if r.get("kind") == "event" and r.get("event") == "end"]
    if not ends or ends[-1].get("exit_code") != 0:
        problems.append(f"no end event with exit code 0 in metrics.jsonl ({ends[-1] if ends else 'none'})")
    latest = out / "ckpt" / "latest"
    tag = latest.read_text().strip() if latest.is_file() else None
    if tag is None or not re.fullmatch(rf"iter_0*{last}", tag):
        problems.append(f"ckpt/latest is {tag!r}, expected the checkpoint of step {last}")
    if first and not re.search(rf"resumed from .+ \(iteration {first}\)", stderr):
        problems.append(f"no 'resumed from ... (iteration {first})' line in the resume's log")
    return problems


# ---------------------------------------------------------------- batches and the cumulative report


def git_state(root: Path = ROOT, ignore: Path | None = None) -> dict:
    """The commit the checkout is at and the files that differ from it (the `before` batches run an
    old commit with this script copied in); paths under `ignore` (the batch folder) are left out."""

    def git(*a):
        r = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    # ' M path' (modified), '?? path' (not tracked; each file, so that the batch folder's can be left out)
    status = git("status", "--porcelain", "--untracked-files=all") or ""
    top, where = root.resolve(), ignore.resolve() if ignore else None
    skip = where.relative_to(top).as_posix() + "/" if where and where.is_relative_to(top) else None
    changed = sorted(
        line[3:] + (" (untracked)" if line[:2] == "??" else "")
        for line in status.splitlines()
        if not (skip and line[3:].startswith(skip))
    )
    return {"commit": commit.strip() if commit else None, "modified": changed}


def portable(value, roots: dict[str, str]):
    """`value` with each absolute root (out folder, checkout, interpreter prefix) named instead."""
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, roots) for v in value]
    if isinstance(value, str):
        for root, name in sorted(roots.items(), key=lambda kv: -len(kv[0])):
            value = value.replace(root, name)
    return value


def batch_record(
    label: str, options: dict, records: list[dict], out: Path, roots: dict | None = None, folder=None
) -> dict:
    """One batch as committed: no host name, every path relative to a named root (the out folder,
    the checkout, the interpreter's prefix and any of `roots`, e.g. the shared data); `folder`, where
    the batches go, is not counted as a change to the checkout."""
    roots = {**(roots or {}), str(out): "<out>", str(ROOT): "<repo>", sys.prefix: "<python>"}
    opts = {k: v for k, v in options.items() if k != "host"}
    recs = [{k: v for k, v in r.items() if k != "dir"} for r in records]
    return portable({"label": label, **git_state(ignore=folder), "options": opts, "records": recs}, roots)


def write_atomic(path: Path, text: str) -> None:
    _checkout_importable()
    from megatron_lev.utils.io import atomic_write_text

    atomic_write_text(path, text)


def load_batches(folder: Path) -> list[tuple[str, dict]]:
    files = sorted(folder.glob("*.json"))
    if not files:
        raise SystemExit(f"stress_multiprocess: --report {folder}: no batch file (*.json) there")
    batches = []
    for f in files:
        try:
            b = json.loads(f.read_text())
            b["label"], b["records"]  # noqa: B018 - a batch must have both
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(
                f"stress_multiprocess: {f}: not a batch file written by --record ({exc})"
            ) from exc
        batches.append((f.name, b))
    return batches


def report(folder: Path) -> str:
    """Every batch of `folder` summed by label, as markdown."""
    by_label: dict[str, list[tuple[str, dict]]] = {}
    for name, b in load_batches(folder):
        by_label.setdefault(b["label"], []).append((name, b))
    where = folder.resolve()
    where = where.relative_to(ROOT) if where.is_relative_to(ROOT) else Path(folder.name)
    out = [
        "# Stress runs of the 2-process CPU layouts\n",
        f"Generated by `python benchmarks/stress_multiprocess.py --report {where}` from the batch",
        f"files in `{where}/`, each written by a run with `--record`; independent runs add up.\n",
    ]
    for label in sorted(by_label, key=lambda x: (x != "before", x)):
        batches = by_label[label]
        records = []
        for name, b in batches:
            for r in b["records"]:
                records.append({**r, "run": f"{Path(name).stem}/{r['run']}"})
        summary = summarise(records)
        out.append(f"## {label}\n")
        out.append(f"**{summary['rate_line']}.**\n")
        out.append("| batch | commit | files changed from it | started | runs | failures | interrupted |")
        out.append("|---|---|---|---|---|---|---|")
        for name, b in batches:
            s = summarise(b["records"])
            commit = (b.get("commit") or "?")[:7]
            modified = ", ".join(f"`{m}`" for m in b.get("modified", [])) or "-"
            started = b["options"].get("started", "?")
            row = f"| `{name}` | {commit} | {modified} | {started} | {s['runs']} | {s['failures']} |"
            out.append(f"{row} {s['interrupted']} |")
        out.append("")
        out.append("| layout | runs | failures | seconds per run: median (min - max) |")
        out.append("|---|---|---|---|")
        for lay, e in summary["layouts"].items():
            sec = e["seconds"]
            spread = f"{sec['median']:.1f} ({sec['min']:.1f} - {sec['max']:.1f})"
            out.append(f"| {lay} | {e['runs']} | {e['failures']} | {spread} |")
        out.append("")
        for sig in summary["signatures"]:
            seen = ", ".join(f"{k} x{v}" for k, v in sig["layouts"].items())
            out.append(
                f"- **{sig['count']}x** `{sig['signature']}` ({seen}; runs {', '.join(sig['runs'][:10])})"
            )
            lines = sig["example"]["lines"]
            if lines:
                out.append("")
                out.append("  ```")
                out.extend(f"  {line}" for line in lines)
                out.append("  ```")
        if summary["signatures"]:
            out.append("")
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------- set-up


def shared_data_dir() -> Path:
    """The tests' convention: `../shared/data` beside the checkout, or $MEGATRON_LEV_SHARED_DATA."""
    env = os.environ.get("MEGATRON_LEV_SHARED_DATA")
    return Path(env) if env else ROOT.parent / "shared" / "data"


def child_env(faulthandler: bool, debug: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    if faulthandler:
        env["PYTHONFAULTHANDLER"] = "1"
    if debug:
        env["MEGATRON_LEV_DEBUG"] = "1"
    return env


def torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _cli(argv: list, env: dict, what: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_lev", *map(str, argv)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(
            f"stress_multiprocess: {what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )


def prepare_data(out: Path, shared: Path, docs: int, env: dict) -> DataSet:
    """The first `docs` documents of the Wikipedia sample, preprocessed once into OUT/data."""
    corpus, tok = shared / CORPUS, shared / TOKENIZER
    for path in (corpus, tok):
        if not path.is_file():
            raise SystemExit(
                f"stress_multiprocess: {path} not found; give --shared-data (or set MEGATRON_LEV_SHARED_DATA)"
            )
    data = out / "data"
    prefix = data / "wiki_text_document"
    if not Path(f"{prefix}.manifest.json").is_file():
        import zstandard

        data.mkdir(parents=True, exist_ok=True)
        with open(corpus, "rb") as f:
            reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8")
            lines = list(itertools.islice(reader, docs))
        (data / "docs.jsonl").write_text("".join(lines))
        _cli(
            [
                "preprocess",
                "--input",
                data / "docs.jsonl",
                "--output-prefix",
                prefix,
                "--tokenizer-type",
                "hf",
            ]
            + ["--tokenizer", tok, "--workers", "1", "--no-progress"],
            env,
            "megatron-lev preprocess",
        )
    return DataSet(prefix, tok, data / "index-cache")


def prebuild_indices(
    out: Path, data: DataSet, layout: Layout, iters: set[int], extra: list, env: dict
) -> None:
    """Sample indices for every run length, so concurrent runs never build them at once."""
    for n in sorted(iters):
        over = run_overrides(data, out / "data" / "indices-run", layout, n, extra)
        _cli(
            ["build-indices", "--config", TINY, *over, "--world-size", WORLD],
            env,
            "megatron-lev build-indices",
        )


# ---------------------------------------------------------------- the loop


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=None, help="runs in all, round-robin over the layouts")
    p.add_argument("--minutes", type=float, default=None, help="start no run after this many minutes")
    p.add_argument(
        "--layouts", nargs="+", default=DEFAULT_LAYOUTS, help=f"default: {' '.join(DEFAULT_LAYOUTS)}"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="default: runs/stress-<date>-<time> in the checkout"
    )
    p.add_argument("--jobs", type=int, default=1, help="runs at the same time (default 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per command before it is a hang")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (a resume: N, then 2N)")
    p.add_argument("--docs", type=int, default=300, help="Wikipedia documents in the data set")
    p.add_argument(
        "--shared-data", type=Path, default=None, help="default: $MEGATRON_LEV_SHARED_DATA or ../shared/data"
    )
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra override for every run (repeatable), e.g. --set model.embedding=tied",
    )
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the checkpoints of passing runs")
    p.add_argument(
        "--no-faulthandler",
        dest="faulthandler",
        action="store_false",
        help="do not set PYTHONFAULTHANDLER=1 (on by default: a crash or a timeout prints Python stacks)",
    )
    p.add_argument(
        "--debug", action="store_true", help="MEGATRON_LEV_DEBUG=1: tracebacks for user errors too"
    )
    p.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the batch here, without machine paths",
    )
    p.add_argument(
        "--label", default=None, help="the batch's label in FILE, e.g. before or after (with --record)"
    )
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="FOLDER",
        help="run nothing: sum the batch files of FOLDER by label and rewrite FOLDER.md",
    )
    args = p.parse_args(argv)
    if args.record and not args.label:
        p.error("--record needs --label (e.g. --label after)")
    if args.label and not args.record:
        p.error("--label names a batch in --record FILE; give --record too")
    for name in ("runs", "jobs", "steps", "docs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be >= 1")
    if args.minutes is not None and not args.minutes > 0:
        p.error("--minutes must be > 0")
    if not args.timeout > 0:
        p.error("--timeout must be > 0")
    try:
        args.layouts = [Layout.parse(x) for x in dict.fromkeys(args.layouts)]
    except ValueError as exc:
        p.error(str(exc))
    for item in args.extra:
        if "=" not in item:
            p.error(f"--set {item!r}: expected KEY=VALUE")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        text = report(args.report)
        write_atomic(args.report.with_suffix(".md"), text)
        print(text + f"\nwritten: {args.report.with_suffix('.md')}", flush=True)
        return 0
    if args.record and args.record.exists():
        raise SystemExit(f"stress_multiprocess: --record {args.record} already exists; give a new file")
    out = (args.out or ROOT / "runs" / f"stress-{datetime.datetime.now():%Y%m%d-%H%M%S}").resolve()
    if out.is_dir() and any(out.glob("run_[0-9]*")):
        raise SystemExit(f"stress_multiprocess: {out} already holds runs; choose a new --out")
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(args.faulthandler, args.debug)
    shared = args.shared_data or shared_data_dir()
    data = prepare_data(out, shared, args.docs, env)
    layouts = []
    for layout in args.layouts:
        why = refusal(layout, data, args.extra)
        if why:
            print(f"skip {layout.name}: the config refuses it: {why}", flush=True)
        else:
            layouts.append(layout)
    if not layouts:
        raise SystemExit("stress_multiprocess: every layout asked for is refused by the config")
    iters = {last for lay in layouts for _, _, last in lay.phases(args.steps)}
    prebuild_indices(out, data, layouts[0], iters, args.extra, env)
    runs = args.runs if args.runs is not None else (None if args.minutes else len(layouts))
    deadline = time.monotonic() + args.minutes * 60 if args.minutes else None
    options = {
        "argv": sys.argv[1:] if argv is None else list(argv),
        "layouts": [lay.name for lay in layouts],
        "runs": runs,
        "minutes": args.minutes,
        "jobs": args.jobs,
        "timeout_s": args.timeout,
        "steps": args.steps,
        "extra_overrides": args.extra,
        "faulthandler": args.faulthandler,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    amount = f"{runs} runs" if runs else f"{args.minutes:g} minutes"
    print(
        f"stress: {amount} over {len(layouts)} layout(s) ({', '.join(options['layouts'])}), "
        f"{args.jobs} at a time, timeout {args.timeout:g} s; logs in {out}",
        flush=True,
    )

    def commands(run_dir: Path, layout: Layout):
        return [
            (
                name,
                first,
                last,
                [*torchrun(), "--standalone", "--nproc_per_node", str(WORLD), "-m", "megatron_lev", "train"]
                + ["--config", str(TINY), *run_overrides(data, run_dir / "train", layout, last, args.extra)],
            )
            for name, first, last in layout.phases(args.steps)
        ]

    records: list[dict] = []
    active: list[Run] = []
    started = 0
    interrupted = False

    def more() -> bool:
        if runs is not None and started >= runs:
            return False
        return deadline is None or time.monotonic() < deadline

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        while True:
            while len(active) < args.jobs and more():
                started += 1
                layout = layouts[(started - 1) % len(layouts)]
                run_dir = out / f"run_{started:04d}"
                run_dir.mkdir(parents=True)
                run = Run(started, layout, run_dir, commands(run_dir, layout))
                run.start_next(env)
                active.append(run)
            if not active:
                break
            for run in list(active):
                if not run.poll(env, args.timeout, args.faulthandler):
                    continue
                active.remove(run)
                rec = run.record()
                records.append(rec)
                (run.dir / "result.json").write_text(json.dumps(rec, indent=1) + "\n")
                if rec["status"] == "ok" and not args.keep_checkpoints:
                    shutil.rmtree(run.dir / "train" / "ckpt", ignore_errors=True)
                failures = sum(r["status"] == "failed" for r in records)
                line = (
                    f"{run.name} {rec['layout']:<18} rc {rec['rc']!s:>4} {rec['seconds']:7.1f} s  "
                    f"load {rec['load_average']:5.2f}  {rec['status']:<6} failures {failures}/{len(records)}"
                )
                if rec["status"] == "failed":
                    line += f"  [{rec['phase']}] {rec['signature']}"
                print(line, flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"\ninterrupted: stopping {len(active)} run(s) in flight (not counted)", flush=True)
        for run in active:
            run.abort()
            rec = run.record("interrupted")
            records.append(rec)
            (run.dir / "result.json").write_text(json.dumps(rec, indent=1) + "\n")
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    summary = summarise(records)
    options["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    (out / "summary.json").write_text(
        json.dumps({"options": options, **summary, "records": records}, indent=1) + "\n"
    )
    print("\n" + format_summary(summary), flush=True)
    print(f"\nsummary: {out / 'summary.json'}", flush=True)
    if args.record:
        roots = {str(p): "<shared-data>" for p in (shared, shared.absolute(), shared.resolve())}
        roots[str(args.record.resolve().parent)] = "<batches>"
        batch = batch_record(args.label, options, records, out, roots, args.record.parent)
        write_atomic(args.record, json.dumps(batch, indent=1) + "\n")
        print(f"batch ({args.label}): {args.record}", flush=True)
    if interrupted:
        return 130
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
