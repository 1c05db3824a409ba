"""A stand-in trainer for the launcher tests: rendezvous, all-reduce, preempt, resume.

Started by `slurm/pretrain.sbatch` with `ENTRY="-m tests.slurm.allreduce_probe"`,
it joins the gloo group from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT exactly as
the trainer does, checks a sum across all ranks every step, and on SIGUSR1/SIGTERM
records its step in `<save>/latest` and exits with the trainer's preemption status,
so the requeue path can be tested in seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

PREEMPTED_EXIT_CODE = 75


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="steps to run (after a resume: more steps)")
    parser.add_argument("--until-signal", action="store_true",
                        help="a fresh run (no latest) steps until SIGUSR1/SIGTERM, up to 10 minutes")
    parser.add_argument("--save", type=Path, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    stop = {"signal": 0}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("SLURMD_NODENAME", "?")
    latest = args.save / "latest"
    start = int(latest.read_text()) if latest.exists() else 0
    print(f"[probe] rank {rank}/{world} node {node} resumed from step {start}", flush=True)
    end = start + args.steps if start or not args.until_signal else start + int(600 / args.step_seconds)
    for step in range(start, end):
        # (2,): [sum of rank+1, any rank asked to stop]
        t = torch.tensor([rank + 1.0, float(stop["signal"] != 0)])
        dist.all_reduce(t)
        expect = world * (world + 1) / 2
        if t[0].item() != expect:
            raise RuntimeError(f"all-reduce gave {t[0].item()}, expected {expect}")
        if t[1].item() > 0:
            if rank == 0:
                args.save.mkdir(parents=True, exist_ok=True)
                tmp = latest.with_suffix(".tmp")
                tmp.write_text(str(step))
                tmp.replace(latest)
            dist.barrier()
            print(f"[probe] rank {rank} node {node} preempted at step {step} (signal {stop['signal']})", flush=True)
            dist.destroy_process_group()
            return PREEMPTED_EXIT_CODE
        print(f"[probe] rank {rank} node {node} step {step} allreduce_sum {t[0].item():g}", flush=True)
        time.sleep(args.step_seconds)
    dist.barrier()
    print(f"[probe] rank {rank} node {node} finished at step {end}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
