"""torchrun, with a report that names each failed rank: what `scripts/torchrun_local.sh` runs.

    python -m megatron_lev.parallel.torchrun [--report-name NAME] [torchrun options] ENTRY ARGS...

The launcher is torchrun's own (`torch.distributed.run`, every option and `PET_*` variable as
documented there). What changes is the report when a rank fails: instead of the agent's
traceback and table, one line per failed rank, root cause first, naming the rank, its exit
status or signal ("rank 1 (pid 4242) was killed by SIGKILL"), then the last lines of that rank's
log, then where the logs are. The logs are torchrun's per-rank files: pass `--log-dir DIR` with
`--redirects 3` (add `--tee 3` to see the ranks' output on the console as well, each line
prefixed with its rank); without `--log-dir` the report has no lines to quote.

Exit status: 0 when every rank succeeded, 1 when a rank failed (as torchrun), 128 + N when
torchrun itself was stopped by signal N (it forwards the signal to the ranks first).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

TAIL_LINES = 15
PREEMPTED_EXIT_CODE = 75  # training.signals: what a rank stopped by SIGTERM exits with


def describe(exitcode: int) -> str:
    """torchrun's exit code of a rank (-N: killed by signal N) in words."""
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def _stopped_by_launcher(exitcode: int) -> bool:
    return exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM, PREEMPTED_EXIT_CODE)


def rank_logs(log_dir: str | None, local_rank: int) -> list[Path]:
    """The newest attempt's stderr.log and stdout.log of `local_rank` under torchrun's `--log-dir`
    (`<dir>/<run id>_<random>/attempt_<n>/<local rank>/`)."""
    if not log_dir:
        return []
    found = sorted(
        Path(log_dir).glob(f"*/attempt_*/{local_rank}"),
        key=lambda p: (p.stat().st_mtime if p.exists() else 0.0, p.parent.name),
    )
    if not found:
        return []
    newest = found[-1]
    return [p for p in (newest / "stderr.log", newest / "stdout.log") if p.is_file()]


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def report(failures: dict, log_dir: str | None, name: str) -> str:
    """The message for torchrun's `ChildFailedError.failures` ({global rank: ProcessFailure})."""
    # root cause first: torchrun's SIGTERM to the other ranks (and their exit 75 from the trainer's
    # start-up handler) follows the first failure within the same second of its timestamps
    order = sorted(
        failures.items(),
        key=lambda kv: (_stopped_by_launcher(kv[1].exitcode), getattr(kv[1], "timestamp", 0), kv[0]),
    )
    out = []
    for i, (rank, failure) in enumerate(order):
        first = " (the first to fail)" if i == 0 and len(order) > 1 else ""
        out.append(f"[{name}] rank {rank} (pid {failure.pid}) {describe(failure.exitcode)}{first}")
        logs = rank_logs(log_dir, failure.local_rank)
        shown = False
        for log in logs:
            lines = tail(log)
            if lines:
                out.append(f"[{name}] the last lines of rank {rank}'s {log.name} ({log}):")
                out.extend(f"[{name}]   {line}" for line in lines)
                shown = True
                break
        if not shown and log_dir:
            out.append(f"[{name}] rank {rank} wrote nothing to its logs")
    if log_dir:
        out.append(f"[{name}] every rank's output: {log_dir}")
    head = order[0]
    out.append(f"[{name}] error: rank {head[0]} {describe(head[1].exitcode)}; its last lines are above")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "torchrun"
    if argv[:1] == ["--report-name"] and len(argv) > 1:
        name, argv = argv[1], argv[2:]
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as exc:
        sys.stdout.flush()
        print(report(exc.failures, args.log_dir, name), file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:  # the agent stopped the ranks with the same signal first
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
