"""A real two-node Slurm cluster on this machine, for testing the `slurm/` launchers.

`SlurmCluster(workdir).start()` writes a `slurm.conf` (nodes `n1`, `n2`, both
this host on 127.0.0.1 with their own ports, no munge), starts `slurmctld` and
one `slurmd` per node, and waits until both nodes are idle. `stop()` cancels
every job and kills the daemons by process id. Client commands need `env`
(it carries `SLURM_CONF`). A daemon that fails to start raises `SlurmError`
with the daemon's own log lines.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun")


class SlurmError(RuntimeError):
    """The cluster could not start, or a job did not behave."""


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that are free right now on 127.0.0.1."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class JobInfo:
    """What `scontrol show job` says about a job once it has left the queue."""

    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    exit_code: str  # "rc:signal"
    restarts: int
    raw: dict[str, str]


class SlurmCluster:
    """Two `slurmd`s (n1, n2) and one `slurmctld`, all on loopback, under `workdir`."""

    nodes = ("n1", "n2")

    def __init__(self, workdir: Path, cpus_per_node: int = 2, memory_mb: int = 4000):
        self.workdir = Path(workdir)
        self.cpus = cpus_per_node
        self.memory_mb = memory_mb
        self.conf = self.workdir / "slurm.conf"
        self.hostname = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for key in [k for k in self.env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
            if key != "SLURM_CONF":  # a test run inside a Slurm job must not leak that job's settings
                del self.env[key]
        self._pid_files = [self.workdir / "run" / "slurmctld.pid"] + [
            self.workdir / "run" / f"slurmd.{n}.pid" for n in self.nodes
        ]

    # ------------------------------------------------------------------ setup

    def write_conf(self) -> Path:
        w = self.workdir
        for sub in ("state", "run", "log", *(f"spool/{n}" for n in self.nodes)):
            (w / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        lines = [
            "ClusterName=megatronlevtest",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            "AuthInfo=cred_expire=10",
            f"StateSaveLocation={w}/state",
            f"SlurmctldPidFile={w}/run/slurmctld.pid",
            f"SlurmctldLogFile={w}/log/slurmctld.log",
            f"SlurmdSpoolDir={w}/spool/%n",
            f"SlurmdPidFile={w}/run/slurmd.%n.pid",
            f"SlurmdLogFile={w}/log/slurmd.%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "JobRequeue=1",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "MinJobAge=600",  # finished jobs stay visible to `scontrol show job`
            "KillWait=5",
            "InactiveLimit=0",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
        ]
        for name, port in zip(self.nodes, node_ports):
            lines.append(
                f"NodeName={name} NodeHostname={self.hostname} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        return self.conf

    def start(self, timeout: float = 30.0) -> SlurmCluster:
        missing = [d for d in DAEMONS if shutil.which(d) is None]
        if missing:
            raise SlurmError(
                f"Slurm commands not installed: {', '.join(missing)} "
                "(run .ci/install_system_packages.sh as root)"
            )
        self.write_conf()
        self._daemon(["slurmctld", "-f", str(self.conf)], "slurmctld", self.workdir / "log" / "slurmctld.log")
        self._wait(
            lambda: self.run(["scontrol", "ping"], check=False).stdout.count("UP") > 0,
            timeout,
            "slurmctld did not answer `scontrol ping`",
            self.workdir / "log" / "slurmctld.log",
        )
        for n in self.nodes:
            self._daemon(
                ["slurmd", "-f", str(self.conf), "-N", n],
                f"slurmd -N {n}",
                self.workdir / "log" / f"slurmd.{n}.log",
            )
        self._wait(
            self._nodes_idle,
            timeout,
            "the nodes did not become idle",
            *(self.workdir / "log" / f"slurmd.{n}.log" for n in self.nodes),
        )
        return self

    def _daemon(self, cmd: list[str], name: str, log: Path) -> None:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise SlurmError(
                f"{name} failed to start (exit {proc.returncode}): {proc.stderr.strip()}\n{_tail(log)}"
            )

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout: float, what: str, *logs: Path) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            time.sleep(0.2)
        raise SlurmError(f"{what} within {timeout:.0f} s\n" + "\n".join(_tail(p) for p in logs))

    # ------------------------------------------------------------------ jobs

    def run(
        self, cmd: list[str], check: bool = True, env: dict | None = None, **kw
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60, **kw
        )
        if check and proc.returncode != 0:
            raise SlurmError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: list[str], env: dict | None = None, cwd: Path | None = None) -> str:
        """Submit; return the job id."""
        out = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job -o` as a dict (empty when Slurm no longer knows the job)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout.strip()
        fields: dict[str, str] = {}
        for token in out.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def queued(self, job_id: str) -> bool:
        """Whether the job is still pending or running (a failing `squeue` counts as yes)."""
        proc = self.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False)
        return proc.returncode != 0 or bool(proc.stdout.strip())

    def wait(self, job_id: str, timeout: float, poll: float = 0.5) -> JobInfo:
        """Poll until the job has left the queue for good (requeues included); return its final state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.queued(job_id):
                info = self.job(job_id)
                return JobInfo(
                    job_id,
                    info.get("JobState", "UNKNOWN"),
                    info.get("ExitCode", "?"),
                    int(info.get("Restarts", "0")),
                    info,
                )
            time.sleep(poll)
        info = self.job(job_id)
        self.run(["scancel", job_id], check=False)
        raise SlurmError(
            f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s "
            f"(reason {info.get('Reason')})\n{_tail(self.workdir / 'log' / 'slurmctld.log')}"
        )

    # ------------------------------------------------------------------ teardown

    def stop(self) -> None:
        """Cancel leftover jobs, then kill the daemons (and their process groups) by pid."""
        if self.conf.exists() and shutil.which("scancel"):
            self.run(["scancel", "--full", "--user", str(os.getuid())], check=False)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.3)
        for pid_file in self._pid_files:
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            for kill in (os.killpg, os.kill):  # the daemon's process group (it calls setsid), then itself
                try:
                    kill(pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
            _wait_gone(pid, 10.0)


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path.name}: no log written)"
    return f"--- last lines of {path.name} ---\n" + "\n".join(text[-lines:])
