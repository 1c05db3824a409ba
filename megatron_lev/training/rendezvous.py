"""Join the process group from the launcher's environment (torchrun, srun, or none).

torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT; `srun` running
one task per process sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; a plain
`python -m megatron_lev train` with neither is a world of one. We initialise
torch.distributed ourselves (gloo on CPU, nccl on CUDA) so DeepSpeed never goes
looking for MPI.

No rank waits forever: a partial or inconsistent launcher environment (`SLURM_NTASKS=2` in a
batch script's own shell, `RANK >= WORLD_SIZE`, `WORLD_SIZE` without `RANK`, ...) is refused
before the rendezvous with one line (`LaunchError`, exit status 2); the rendezvous and every
collective time out after `parallel.collective_timeout_s`; the heartbeat watchdog
(`parallel.heartbeat_timeout_s`, see `parallel/watchdog.py`) ends every rank when one goes
silent. `distributed_session()` is the one way out (`parallel/session.py`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lev.errors import LaunchError, UserError
from megatron_lev.parallel import session
from megatron_lev.parallel.local_workers import find_free_port
from megatron_lev.parallel.session import DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_HEARTBEAT_TIMEOUT_S


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


def _int_var(env, key: str, lo: int = 0) -> int:
    raw = str(env[key]).strip()
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"{key}={env[key]!r} is not an integer: {_FIX}") from None
    if value < lo:
        raise LaunchError(f"{key}={value} must be at least {lo}: {_FIX}")
    return value


_FIX = (
    "launch with torchrun or srun (slurm/pretrain.sbatch), or unset the launcher's variables "
    "to run one process"
)


def _torchrun_env(env) -> DistEnv | None:
    """RANK/WORLD_SIZE/... checked for consistency; None when they do not describe a launch."""
    has_rank, has_world = "RANK" in env, "WORLD_SIZE" in env
    if not (has_rank or has_world):
        return None
    if has_rank != has_world:
        if has_rank and str(env["RANK"]).strip() == str(env.get("SLURM_PROCID", "")).strip():
            return None  # srun's own rank, repeated: the task variables describe the launch
        present, missing = ("RANK", "WORLD_SIZE") if has_rank else ("WORLD_SIZE", "RANK")
        value = _int_var(env, present, lo=0 if has_rank else 1)
        if value == (0 if has_rank else 1):
            return None  # RANK=0 or WORLD_SIZE=1 alone: one process, as without them
        raise LaunchError(
            f"{present}={value} is set but {missing} is not, so the other ranks cannot be found "
            f"(a partial launcher environment): {_FIX}"
        )
    world = _int_var(env, "WORLD_SIZE", lo=1)
    rank = _int_var(env, "RANK")
    if rank >= world:
        raise LaunchError(f"RANK={rank} is not below WORLD_SIZE={world}: ranks are 0..{world - 1}; {_FIX}")
    local_rank = _int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    if "LOCAL_WORLD_SIZE" in env:
        local_world = _int_var(env, "LOCAL_WORLD_SIZE", lo=1)
        if local_rank >= local_world or local_world > world:
            raise LaunchError(
                f"LOCAL_RANK={local_rank} and LOCAL_WORLD_SIZE={local_world} do not fit WORLD_SIZE={world}: "
                f"local ranks are 0..LOCAL_WORLD_SIZE-1 and LOCAL_WORLD_SIZE <= WORLD_SIZE; {_FIX}"
            )
    if world > 1:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not str(env.get(k, "")).strip()]
        if missing:
            raise LaunchError(
                f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not: launch with torchrun "
                "or set MASTER_ADDR and MASTER_PORT"
            )
    port = _port(env) if "MASTER_PORT" in env else 0
    return DistEnv(rank, world, local_rank, env.get("MASTER_ADDR", "127.0.0.1"), port, "torchrun")


def _port(env) -> int:
    port = _int_var(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return port


def _slurm_env(env) -> DistEnv | None:
    """srun's task variables checked; None unless they describe more than one task of a step."""
    if "SLURM_PROCID" not in env or not ("SLURM_NTASKS" in env or "SLURM_STEP_NUM_TASKS" in env):
        return None
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    count_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world = _int_var(env, count_var, lo=1)
    rank = _int_var(env, "SLURM_PROCID")
    if world == 1 and rank == 0:
        return None  # one task: a world of one (a batch script of one task, or `srun -n 1`)
    if not in_step:
        raise LaunchError(
            f"{count_var}={world} and SLURM_PROCID={rank} are set but this process was not started by "
            "srun (SLURM_STEP_ID is not set: a batch script's own shell, or a partial environment), so "
            "nothing starts the other ranks and this one would wait for them forever: start one process "
            "per task with srun (slurm/pretrain.sbatch does), or unset SLURM_NTASKS and SLURM_PROCID "
            "to run one process"
        )
    if rank >= world:
        raise LaunchError(
            f"SLURM_PROCID={rank} is not below {count_var}={world}: ranks are 0..{world - 1}; {_FIX}"
        )
    local_rank = _int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    addr = env.get("MASTER_ADDR") or _first_slurm_host(
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "127.0.0.1")
    )
    if "MASTER_PORT" in env:
        port = _port(env)
    else:  # the same on every task of the job
        port = 29400 + (_int_var(env, "SLURM_JOB_ID") % 1000 if "SLURM_JOB_ID" in env else 0)
    return DistEnv(rank, world, local_rank, addr, port, "slurm")


def _contradicting_rank(env) -> None:
    """Refuse a RANK that contradicts srun's SLURM_PROCID in a task of a multi-task step, when torchrun
    did not set it (torchrun under srun sets TORCHELASTIC_RUN_ID; its ranks differ from the tasks'):
    `export RANK=0` in a batch script makes every task rank 0, and one of them then fails on the
    port while the others wait out the whole timeout."""
    if "RANK" not in env or "SLURM_PROCID" not in env or "TORCHELASTIC_RUN_ID" in env:
        return
    if not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return
    count = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    if not str(count).strip().isdigit() or int(count) <= 1:
        return
    if str(env["RANK"]).strip() != str(env["SLURM_PROCID"]).strip():
        raise LaunchError(
            f"RANK={env['RANK']} contradicts SLURM_PROCID={env['SLURM_PROCID']} in this srun task of "
            f"{count}: RANK was set outside torchrun (exported in the batch script?), so every task "
            "would claim the same rank; unset RANK (and WORLD_SIZE, MASTER_PORT) before srun, and let "
            "srun number the tasks"
        )


def read_dist_env(environ: dict | None = None) -> DistEnv:
    """Rank layout from the environment. A partial or inconsistent launcher environment (which
    would leave this process waiting for ranks that never come) raises `LaunchError`, one line
    naming the variable."""
    env = os.environ if environ is None else environ
    _contradicting_rank(env)
    info = _torchrun_env(env) or _slurm_env(env)
    return info or DistEnv(0, 1, 0, "127.0.0.1", 0, "single")


def init_distributed(
    backend: str | None = None,
    *,
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    prog: str = "megatron-lev train",
) -> DistEnv:
    """Initialise torch.distributed (once) and select this rank's CUDA device; returns the layout.

    Every collective (and the rendezvous) waits at most `collective_timeout_s`; with more than
    one rank and `heartbeat_timeout_s > 0` the heartbeat watchdog ends this process with one
    line (`prog: error: ...`, exit status 1) when a rank stays silent that long. Leave with
    `shutdown_distributed()` (or run the command inside `distributed_session()`)."""
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
    port = info.master_port or find_free_port()
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
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        session.join(
            backend,
            info.rank,
            info.world_size,
            info.master_addr,
            port,
            timeout_s=collective_timeout_s,
            heartbeat_s=heartbeat_timeout_s,
            store_owner="torchrun's agent" if agent_store else "rank 0",
            on_abort=functools.partial(_abort, prog),
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


def _abort(prog: str, line: str) -> None:
    """The watchdog found a silent rank: one line, the exit status for the launcher, and out at
    once (the main thread is blocked in a collective and cannot unwind)."""
    from megatron_lev.training.signals import report_exit_code

    with contextlib.suppress(OSError):
        os.write(2, f"{prog}: error: {line}\n".encode())
    report_exit_code(1, "crash")  # the silent rank's fault, which a restart may cure
    session.flush_logs()
    os._exit(1)


shutdown_distributed = session.shutdown  # leave the group: stop the watchdog, destroy groups, flush
distributed_session = session.leaving_cleanly  # a command's body: one line per failure, always leaves


def device() -> torch.device:
    """The device this rank computes on."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
