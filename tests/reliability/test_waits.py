"""No rank waits forever, and every rank leaves the process group the same way.

Three tables, each case a real `megatron-lev train` process (or two) that must end within the
bound it asserts, with one line saying why:

- LAUNCH_CASES: a partial or inconsistent launcher environment (`SLURM_NTASKS=2` without srun,
  `RANK >= WORLD_SIZE`, half of RANK/WORLD_SIZE, ...) is refused before the rendezvous; a lone
  rank of a consistent two-rank environment gives up after `parallel.collective_timeout_s`.
- PEER_CASES: two ranks of the tiny trainer, one of them frozen (SIGSTOP) or killed (SIGKILL)
  once training runs, under `scripts/torchrun_local.sh` or started directly as srun would
  (RANK/WORLD_SIZE/MASTER_* per process). Every process must end: the survivors by the
  heartbeat watchdog or their broken collective, a frozen rank by its launcher.
- The way out: a two-rank run that ends normally, and one whose collective times out, leave
  with `destroy_process_group` (each rank's log says so) and no "terminate called".

And the launchers' report of a rank that died: torchrun_local.sh and `run_workers` name the
rank, its signal and the last lines of its log.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

from tests.reliability.harness import (
    ROOT,
    expect_error,
    leftover_processes,
    run_cli_process,
    tiny_run_overrides,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
HEARTBEAT_S = 10  # the watchdog's timeout in these runs: a beat every second


def _env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS
        and not k.startswith(("SLURM_", "TORCHELASTIC_", "PET_"))
        and k != "MEGATRON_LEV_DEBUG"
    }
    env.update(
        {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    )
    env["MAX_FAILURES"] = "0"  # torchrun_local.sh: one attempt; these tests read a failure's report
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_data) -> dict:
    """300 real Wikipedia documents in one shard set, GPT-NeoX tokenizer."""
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    work = tmp_path_factory.mktemp("waitdata")
    lines = []
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            lines.append(line)
            if len(lines) == 300:
                break
    (work / "docs.jsonl").write_text("".join(lines))
    tok = str(shared_data / "tokenizers" / "gpt-neox-20b.json")
    preprocess(
        PreprocessOptions(
            [str(work / "docs.jsonl")], str(work / "wiki_text_document"), "hf", tok, workers=1, progress=False
        )
    )
    return {"prefix": str(work / "wiki_text_document"), "tokenizer": tok, "cache": work / "cache"}


def overrides(data: dict, out: Path, **extra) -> list[str]:
    return tiny_run_overrides(
        data["prefix"],
        data["tokenizer"],
        data["cache"],
        out,
        **{"train.save_interval": 0, "logging.log_all_ranks": True, **extra},
    )


def _free_port() -> int:
    from megatron_lev.parallel.local_workers import find_free_port

    return find_free_port()


# ------------------------------------------------------------------ a partial launcher environment

# name -> (environment, overrides, exit status, fragments of the last line, seconds it may take)
LAUNCH_CASES = {
    "slurm-ntasks-without-srun": (
        {"SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
        {},
        2,
        [r"SLURM_NTASKS=2 and SLURM_PROCID=0", r"not started by srun", r"wait for them forever"],
        60,
    ),
    "slurm-procid-not-below-ntasks": (
        {"SLURM_NTASKS": "2", "SLURM_PROCID": "2", "SLURM_STEP_ID": "0"},
        {},
        2,
        [r"SLURM_PROCID=2 is not below SLURM_NTASKS=2"],
        60,
    ),
    "world-size-without-rank": (
        {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"},
        {},
        2,
        [r"WORLD_SIZE=2 is set but RANK is not"],
        60,
    ),
    "rank-without-world-size": ({"RANK": "1"}, {}, 2, [r"RANK=1 is set but WORLD_SIZE is not"], 60),
    "rank-not-below-world-size": (
        {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"},
        {},
        2,
        [r"RANK=2 is not below WORLD_SIZE=2"],
        60,
    ),
    "rank-not-an-integer": (
        {"RANK": "one", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"},
        {},
        2,
        [r"RANK='one' is not an integer"],
        60,
    ),
    "a-lone-rank-of-two": (  # consistent, but nobody starts rank 1: the rendezvous gives up
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}"},
        {"parallel.collective_timeout_s": 5},
        1,
        [r"did not form within parallel\.collective_timeout_s=5 s", r"1 of 2 ranks joined"],
        90,
    ),
}


@pytest.mark.parametrize("case", list(LAUNCH_CASES))
def test_a_partial_launcher_environment_ends_at_once_with_one_line(case, data, tmp_path):
    env, extra, rc, fragments, bound = LAUNCH_CASES[case]
    port = _free_port()
    env = {k: v.format(port=port) for k, v in env.items()}
    out = tmp_path / "run"
    start = time.monotonic()
    outcome = run_cli_process(
        ["train", "--config", TINY, *overrides(data, out, **extra)], timeout=bound + 30, env=_env(**env)
    )
    took = time.monotonic() - start
    expect_error(outcome, *fragments, rc=rc)
    assert took < bound, f"{case}: ended after {took:.0f} s, bound {bound} s"
    print(f"{case}: ended {took:.1f} s after it started")
    assert not list((out / "ckpt").glob("iter_*")), "nothing may be saved"


# ------------------------------------------------------------------ a frozen or dead peer


def _rank_pids(marker: str) -> dict[int, int]:
    """{rank: pid} of the trainer processes whose command line holds `marker`."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() not in cmd or b"megatron_lev" not in cmd or b"torch.distributed" in cmd:
            continue
        if b"megatron_lev.parallel.torchrun" in cmd:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(pid)
    return found


class _PortTaken(Exception):
    pass


def _wait_for_step(out: Path, procs: list[subprocess.Popen], step: int = 3, timeout: float = 240) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and f'"iteration": {step}' in metrics.read_text()):
        for p in procs:
            if p.poll() is not None:
                _kill_all(procs)
                text = _output(procs)
                if "cannot listen on MASTER_PORT" in text:  # taken since we picked it: pick another
                    raise _PortTaken(text)
                pytest.fail(f"a process ended before step {step}:\n{text[-4000:]}")
        if time.monotonic() > deadline:
            _kill_all(procs)
            pytest.fail(f"training did not reach step {step}:\n{_output(procs)[-4000:]}")
        time.sleep(0.2)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


def _output(procs: list[subprocess.Popen]) -> str:
    parts = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=10)  # killed just before: let it be reaped
        except subprocess.TimeoutExpired:
            continue
        text = p.stdout.read() if p.stdout and not p.stdout.closed else ""
        parts.append(f"--- process {i} (exit {p.returncode}) ---\n{text}")
    return "\n".join(parts)


def _start_running(launcher: str, data: dict, out: Path, extra: dict) -> list[subprocess.Popen]:
    """Two ranks of the trainer that have trained 3 steps (another free port if the one picked
    was taken on this shared machine before rank 0 could listen on it)."""
    for attempt in range(3):
        procs = _start_pair(launcher, data, out, extra)
        try:
            _wait_for_step(out, procs)
            return procs
        except _PortTaken:
            if attempt == 2:
                raise
            for p in procs:
                p.wait()
            shutil.rmtree(out, ignore_errors=True)
    raise AssertionError("unreachable")


def _start_pair(launcher: str, data: dict, out: Path, extra: dict, **env_extra) -> list[subprocess.Popen]:
    over = overrides(
        data,
        out,
        **{
            "train.train_iters": 100000,
            "parallel.heartbeat_timeout_s": HEARTBEAT_S,
            **extra,
        },
    )
    if launcher == "torchrun":
        cmd = [str(ROOT / "scripts" / "torchrun_local.sh"), "--config", str(TINY), *over]
        env = _env(NPROC=2, TMPDIR=str(out.parent))
        return [
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        ]
    port = _free_port()  # as srun + slurm/task.sh start the ranks: one process each, no agent
    procs = []
    for rank in range(2):
        env = _env(
            RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env_extra
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "megatron_lev", "train", "--config", str(TINY), *over],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


# name -> (launcher, rank hit, signal, extra overrides, regex of the survivors' line, regex of
#          the launcher's line or None, seconds from the signal until every process has ended)
PEER_CASES = {
    "frozen-rank-under-torchrun": (
        "torchrun",
        1,
        signal.SIGSTOP,
        {},
        r"megatron-lev train: error: rank 1 did not answer for \d+ s: no heartbeat.*seen by rank 0",
        r"\[torchrun_local\] rank 0 \(pid \d+\) exited with status 1",
        # the watchdog (10 s + 1.5 beats) + torchrun's 30 s before it kills the stopped rank
        HEARTBEAT_S + 1.5 + 30 + 25,
    ),
    "dead-rank-under-torchrun": (
        "torchrun",
        1,
        signal.SIGKILL,
        {},
        r"rank 0 of 2: a collective lost its connection to another rank .*rank 1 stopped answering",
        r"\[torchrun_local\] rank 1 \(pid \d+\) was killed by SIGKILL",
        45,
    ),
    "dead-peer-started-directly": (
        "direct",
        1,
        signal.SIGKILL,
        {},
        r"rank 0 of 2: a collective lost its connection to another rank .*rank 1 stopped answering",
        None,
        45,
    ),
    "frozen-store-host-started-directly": (  # rank 0 holds the rendezvous store without torchrun
        "direct",
        0,
        signal.SIGSTOP,
        {},
        # rank 1 finds either the store or rank 0's heartbeat silent first, by timing; both name rank 0
        r"(the rendezvous store at 127\.0\.0\.1:\d+ \(rank 0\)|rank 0) did not answer for \d+ s"
        r".*seen by rank 1",
        None,
        HEARTBEAT_S + 1.5 + 35,
    ),
}


@pytest.mark.parametrize("case", list(PEER_CASES))
def test_a_frozen_or_dead_peer_ends_every_process_in_bounded_time(case, data, tmp_path):
    launcher, victim, sig, extra, line_re, launcher_re, bound = PEER_CASES[case]
    out = tmp_path / "run"
    procs = _start_running(launcher, data, out, extra)
    try:
        pids = _rank_pids(str(out))
        assert sorted(pids) == [0, 1], pids
        hit = time.monotonic()
        os.kill(pids[victim], sig)
        deadline = hit + bound
        survivors = procs if launcher == "torchrun" else [p for r, p in enumerate(procs) if r != victim]
        for p in survivors:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _kill_all(procs)
                pytest.fail(f"{case}: a process was still running {bound:.0f} s after the {sig.name}")
        took = time.monotonic() - hit
        if launcher == "torchrun":  # the launcher ends the frozen rank too
            left = [pid for pid in pids.values() if _alive(pid)]
            assert not left, f"{case}: rank processes {left} outlived torchrun"
    finally:
        for pid in _rank_pids(str(out)).values():  # a frozen rank with no launcher to end it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _kill_all(procs)
    log = "\n".join(p.stdout.read() for p in procs)
    for p in survivors:
        assert p.returncode not in (0, 75), f"{case}: exit {p.returncode}\n{log[-4000:]}"
    assert re.search(line_re, log), f"{case}: no line matching {line_re!r}\n{log[-5000:]}"
    if launcher_re:
        assert re.search(launcher_re, log), f"{case}: no launcher line {launcher_re!r}\n{log[-5000:]}"
    assert "Traceback" not in log, log[-5000:]
    assert "terminate called" not in log, log[-5000:]
    assert took < bound
    print(f"{case}: every process ended {took:.1f} s after the {sig.name}")
    assert not leftover_processes(str(out))


def _alive(pid: int) -> bool:
    try:
        return ") Z " not in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False


# ------------------------------------------------------------------ the way out


def test_a_two_rank_run_leaves_the_process_group_on_every_rank(data, tmp_path):
    """A run that ends normally: every rank stops its watchdog and destroys the process group
    (its log says so), and no C++ thread is left joinable at exit."""
    out = tmp_path / "run"
    proc = _start_pair("torchrun", data, out, {"train.train_iters": 3})[0]
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        _kill_all([proc])
        pytest.fail("the two-rank run did not end")
    assert proc.returncode == 0, log[-4000:]
    assert "terminate called" not in log and "Traceback" not in log, log[-4000:]
    for rank in (0, 1):
        rank_log = (out / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank} of 2 left the process group (groups destroyed)" in rank_log, rank_log[-2000:]
    assert not leftover_processes(str(out))


def test_a_collective_timeout_ends_with_one_line_and_a_clean_exit(data, tmp_path):
    """The watchdog off, rank 1 frozen: rank 0's gloo collective times out after
    parallel.collective_timeout_s. Leaving without destroying the group would abort with
    'terminate called without an active exception' (status 134)."""
    out = tmp_path / "run"
    procs = _start_running(
        "direct", data, out, {"parallel.heartbeat_timeout_s": 0, "parallel.collective_timeout_s": 8}
    )
    try:
        pids = _rank_pids(str(out))
        hit = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        try:
            procs[0].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 was still waiting 60 s after its peer froze")
        took = time.monotonic() - hit
    finally:
        for pid in _rank_pids(str(out)).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _kill_all(procs)
    log = procs[0].stdout.read()
    assert procs[0].returncode == 1, f"exit {procs[0].returncode}\n{log[-4000:]}"
    assert "terminate called" not in log and "Traceback" not in log, log[-4000:]
    last = [line for line in log.splitlines() if line.strip()][-1]
    assert re.search(
        r"megatron-lev train: error: rank 0 of 2: a collective waited longer than "
        r"parallel\.collective_timeout_s=8 s",
        last,
    ), log[-3000:]
    assert took < 8 + 40
    print(f"collective timeout of 8 s: rank 0 ended {took:.1f} s after its peer froze")
    rank_log = (out / "logs" / "rank0.log").read_text()
    assert "rank 0 of 2 left the process group (groups destroyed)" in rank_log


def test_a_rank_alive_but_slow_in_a_save_is_named_as_slow_with_the_phase(data, tmp_path):
    """Rank 1 writes its checkpoint files 30 s late (a slow file system; its heartbeat goes on): rank 0,
    done writing, times out in the save's last barrier after parallel.collective_timeout_s. Its line
    names rank 1 as alive but still writing, and both phases (before, gloo's 'Application timeout
    caused pair closure' ended it in a traceback). Rank 1 then loses its connection; launched
    directly, rank 0 hosted the store, so rank 1 cannot read rank 0's report any more."""
    out = tmp_path / "run"
    extra = {
        "train.train_iters": 4,
        "train.save_interval": 2,
        "parallel.heartbeat_timeout_s": 60,
        "parallel.collective_timeout_s": 10,
        "train.callbacks": "[megatron_lev.testing.faults:SlowSave]",
    }
    procs = _start_pair("direct", data, out, extra, MEGATRON_LEV_SLOW_SAVE="1:30")
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        _kill_all(procs)
    last = [[line for line in log.splitlines() if line.strip()][-1] for log in logs]
    assert procs[0].returncode != 0 and procs[1].returncode != 0, last
    assert re.search(
        r"rank 0 of 2: a collective waited longer than parallel\.collective_timeout_s=10 s", last[0]
    )
    assert re.search(
        r"rank 1 is alive \(it beats\) but still in 'saving checkpoint iter_0000002: writing", last[0]
    )
    assert (
        "files written, waiting for the other ranks'" in last[0] and "a slow rank, not a dead one" in last[0]
    )
    assert "Traceback" not in logs[0], logs[0][-3000:]
    assert re.search(r"rank 1 of 2: a collective lost its connection", last[1]), last[1]


# ------------------------------------------------------------------ the launchers' report


def test_torchrun_local_names_a_killed_rank_its_signal_and_its_last_lines(tmp_path):
    proc = subprocess.run(
        [str(ROOT / "scripts" / "torchrun_local.sh"), "--go"],
        cwd=ROOT,
        env=_env(NPROC=2, ENTRY="-m tests.reliability.rank_crash_probe", TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = proc.stderr
    assert proc.returncode not in (0, 75), err[-3000:]
    assert re.search(r"\[torchrun_local\] rank 1 \(pid \d+\) was killed by SIGKILL", err), err[-3000:]
    assert re.search(
        r"\[torchrun_local\] the last lines of rank 1's stderr\.log \(.*\):\n"
        r"\[torchrun_local\]   rank 1: loading the model \(the last line before the kill\)",
        err,
    ), err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == "[torchrun_local] error: rank 1 was killed by SIGKILL; its last lines are above", last
    kept = re.search(r"every rank's output: (\S+)", err).group(1)
    assert Path(kept).is_dir(), "the logs of a failed run are kept"
    assert "ChildFailedError" not in err, "torchrun's own traceback replaced by the report"


def _killed_worker():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("rank 1 of the workers: about to be killed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_run_workers_names_a_killed_rank_its_signal_and_its_last_lines(capfd):
    from megatron_lev.parallel.local_workers import WorkerError, run_workers

    with pytest.raises(WorkerError) as info:
        run_workers(_killed_worker, world_size=2, timeout=60)
    message = str(info.value)
    assert "\n" not in message
    assert re.match(r"rank 1 of 2 was killed by SIGKILL without reporting", message), message
    assert info.value.rank == 1
    err = capfd.readouterr().err
    assert re.search(
        r"---- the last lines of rank 1 of 2 ----\n\[rank 1\] rank 1 of the workers: about to be killed", err
    ), err[-3000:]
