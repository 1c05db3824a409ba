"""Join the process group from the launcher's environment (torchrun, srun, or none).

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; `srun` running
one task per process sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; a plain
`python -m megatron_lev train` with neither is a world of one. We initialise
torch.distributed ourselves (gloo on CPU, nccl on CUDA) so DeepSpeed never goes
looking for MPI.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lev.errors import UserError


class PortInUseError(UserError):
    """The rendezvous port (MASTER_PORT) is taken by another process."""


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as `n[1-2],gpu07` -> `n1`."""
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        first = rest.split(",")[0].split("-")[0].rstrip("]")
        return prefix + first
    return head


def read_dist_env(environ: dict | None = None) -> DistEnv:
    """Rank layout from the environment; raises ValueError naming a missing variable."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing and int(env["WORLD_SIZE"]) > 1:
            raise ValueError(
                f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not: launch with torchrun "
                "or set MASTER_ADDR and MASTER_PORT"
            )
        return DistEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", 0)),
            "torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        port = int(env.get("MASTER_PORT", 29400 + int(env.get("SLURM_JOB_ID", "0")) % 1000))
        return DistEnv(
            int(env["SLURM_PROCID"]),
            int(env["SLURM_NTASKS"]),
            int(env.get("SLURM_LOCALID", 0)),
            addr,
            port,
            "slurm",
        )
    return DistEnv(0, 1, 0, "127.0.0.1", 0, "single")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str | None = None) -> DistEnv:
    """Initialise torch.distributed (once) and select this rank's CUDA device; returns the layout."""
    info = read_dist_env()
    if dist.is_initialized():
        return DistEnv(
            dist.get_rank(),
            dist.get_world_size(),
            info.local_rank,
            info.master_addr,
            info.master_port,
            info.source,
        )
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise ValueError("parallel.distributed_backend=nccl needs CUDA; use gloo (or leave it unset) on CPU")
    if use_cuda:
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    port = info.master_port or _free_port()
    # DeepSpeed and torch read these; keep them consistent with what we used
    os.environ.update(
        {
            "RANK": str(info.rank),
            "WORLD_SIZE": str(info.world_size),
            "LOCAL_RANK": str(info.local_rank),
            "MASTER_ADDR": info.master_addr,
            "MASTER_PORT": str(port),
        }
    )
    try:
        dist.init_process_group(
            backend,
            rank=info.rank,
            world_size=info.world_size,
            init_method=f"tcp://{info.master_addr}:{port}",
        )
    except RuntimeError as exc:  # torch's DistNetworkError: the rendezvous store cannot listen
        if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
            if info.world_size == 1:
                fix = ", or unset it (a single process then picks a free one)"
            elif "SLURM_JOB_ID" in os.environ:
                fix = " (slurm/pretrain.sbatch derives one from the job id and restart; export it to choose)"
            else:
                fix = ", or launch with scripts/torchrun_local.sh (torchrun --standalone), which picks one"
            raise PortInUseError(
                f"MASTER_PORT={port} is already in use on {info.master_addr} (another run or program "
                f"listens there), so rank {info.rank} cannot start the rendezvous: set MASTER_PORT to a "
                f"free port{fix}"
            ) from None
        raise
    return DistEnv(info.rank, info.world_size, info.local_rank, info.master_addr, port, info.source)


def device() -> torch.device:
    """The device this rank computes on."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
