"""A stand-in trainer for the launcher tests: join the process group, all-reduce, report.

Started by `slurm/pretrain.sbatch` (or `scripts/torchrun_local.sh`) with
`ENTRY="-m tests.slurm.allreduce_probe"`, it joins the gloo group from
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT exactly as the trainer does and checks
a sum across all ranks, so the launch path is tested in seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--kill-rank", type=int, default=None, help="this rank kills itself after step 0")
    parser.add_argument(
        "--kill-once",
        default=None,
        help="with --kill-rank: only while this file is absent (then made)",
    )
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("SLURMD_NODENAME", "local")
    expect = world * (world + 1) / 2
    for step in range(args.steps):
        t = torch.tensor([rank + 1.0])  # (1,)
        dist.all_reduce(t)
        if t.item() != expect:
            raise RuntimeError(f"all-reduce gave {t.item()}, expected {expect}")
        # One write per line: the launchers set PYTHONUNBUFFERED, under which print() issues
        # the text and the newline as two writes, and two ranks sharing a pipe interleave.
        line = (
            f"[probe] rank {rank} local_rank {os.environ['LOCAL_RANK']} node {node} step {step} "
            f"allreduce_sum {t.item():g}\n"
        )
        os.write(sys.stdout.fileno(), line.encode())
        if args.kill_once and args.kill_rank == rank:
            if os.path.exists(args.kill_once):
                args.kill_rank = None  # killed at an earlier attempt: this one runs to the end
            else:
                open(args.kill_once, "w").close()
        if args.kill_rank == rank:  # as the out-of-memory killer would
            os.write(sys.stdout.fileno(), f"[probe] rank {rank} is about to be killed\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
