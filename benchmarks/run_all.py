"""Rerun every benchmark one after another; each appends its figures to benchmarks/results/<name>.md.

python benchmarks/run_all.py            # quick settings (minutes each on 2 cores)
python benchmarks/run_all.py --full     # the issue-sized settings (long on a laptop)
python benchmarks/run_all.py --only lev capacity
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (quick arguments, full arguments)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "lev": (["--quick"], []),
    "preprocess": (["--max-mb", "2", "--repeats", "1"], []),
    "index": (["--scale", "0.05"], []),
    "model_cpu": (["--steps", "4"], []),
    "train": (["--steps", "5"], []),
    "host_malloc": (["--steps", "3", "--warmup", "1", "--repeats", "1"], []),
    "capacity": (
        ["--no-agreement"],
        [],
    ),  # exact eps from the Gram matrix (the all-pairs timing: --all-pairs)
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="issue-sized settings instead of quick ones")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    args = parser.parse_args()
    failed = []
    for name in args.only:
        quick, full = BENCHMARKS[name]
        cmd = [sys.executable, str(HERE / f"bench_{name}.py"), *(full if args.full else quick)]
        print(f"==> {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.time()
        rc = subprocess.call(cmd)
        print(
            f"<== {name}: exit {rc} after {time.time() - start:.0f}s (results: benchmarks/results/{name}.md)",
            flush=True,
        )
        if rc:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
