"""How a rank process ends after leaving a group of several ranks (`session.end_process`): with its
exit status, after what a normal exit does for Python code (non-daemon threads joined, `atexit`
handlers run, buffered output written), and without the interpreter's finalization. A process
that never joined such a group exits the usual way."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from megatron_lev.parallel.local_workers import find_free_port
from tests.reliability.harness import ROOT

RANK = textwrap.dedent(
    """
    import atexit, sys, threading, time
    import torch, torch.distributed as dist
    from megatron_lev.parallel import session

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if world > 1:
        session.join("gloo", rank, world, "127.0.0.1", port, timeout_s=60)
        group = dist.new_group(list(range(world)))  # held here, as DeepSpeed holds its groups
        t = torch.ones(4) * (rank + 1)
        dist.all_reduce(t, group=group)
        assert t[0].item() == world * (world + 1) / 2
        session.shutdown()

    def late():  # a non-daemon thread still writing when the command returns
        time.sleep(0.5)
        with open(f"{out}/thread{rank}", "w") as f:
            f.write("done")

    threading.Thread(target=late).start()
    atexit.register(lambda: open(f"{out}/atexit{rank}", "w").write("ran"))
    sys.stdout.write("buffered, no newline")  # written only if the streams are flushed
    session.end_process(7)
    print("after end_process")
    sys.exit(3)
    """
)


def _run(world: int, tmp_path) -> list[subprocess.CompletedProcess]:
    port = find_free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(world), str(port), str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_a_rank_that_left_a_group_of_two_ends_with_its_status_after_threads_and_atexit(tmp_path):
    for rank, proc in enumerate(_run(2, tmp_path)):
        assert proc.returncode == 7, f"rank {rank}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        assert proc.stdout == "buffered, no newline", proc.stdout  # flushed; nothing after the end
        assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert (tmp_path / f"thread{rank}").read_text() == "done"
        assert (tmp_path / f"atexit{rank}").read_text() == "ran"


def test_a_process_that_joined_no_group_exits_the_usual_way(tmp_path):
    (proc,) = _run(1, tmp_path)
    # end_process returned: the code after it ran and chose the status
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout == "buffered, no newlineafter end_process\n"
    assert (tmp_path / "thread0").read_text() == "done"
    assert (tmp_path / "atexit0").read_text() == "ran"


def test_both_entry_points_end_through_cli_entry():
    """`megatron-lev` (the console script) and `python -m megatron_lev` both reach `end_process`."""
    from importlib.metadata import entry_points

    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "megatron-lev"]
    assert script.value == "megatron_lev.cli:entry"
    assert (ROOT / "megatron_lev" / "__main__.py").read_text().rstrip().endswith("entry()")


BUGGY_RANK = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from megatron_lev import cli
    from megatron_lev.parallel import session

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    def main(argv=None):  # a command with a bug: the exception escapes after the group was joined
        session.join("gloo", rank, world, "127.0.0.1", port, timeout_s=60)
        dist.new_group(list(range(world)))  # held, as DeepSpeed holds its groups
        session.shutdown()
        raise ZeroDivisionError("a bug")

    real_end = session.end_process

    def end_process(code):  # the real one, after noting that the exit went through it
        open(f"{out}/ended{rank}", "w").write(str(code))
        real_end(code)

    session.end_process = end_process
    cli.main = main
    atexit.register(lambda: open(f"{out}/atexit{rank}", "w").write("ran"))
    cli.entry()
    """
)


def test_an_exception_escaping_main_still_ends_every_rank_through_end_process(tmp_path):
    """Before, `entry` ran `end_process` only when `main` returned: a bug's exception left the rank to
    the interpreter's finalization (the abort the clean exit was added for). Now: its traceback,
    status 1, atexit handlers run, no abort."""
    port = find_free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUGGY_RANK, str(rank), "2", str(port), str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, f"rank {rank}: exit {proc.returncode}\n{err[-3000:]}"
        assert "ZeroDivisionError: a bug" in err and "terminate called" not in err, err[-3000:]
        assert (tmp_path / f"atexit{rank}").read_text() == "ran"
        assert (tmp_path / f"ended{rank}").read_text() == "1"  # left through end_process, status 1


def test_pretrain_gpt_ends_through_cli_entry():
    """`torchrun pretrain/pretrain_gpt.py` (the documented Megatron-style path) exits as `megatron-lev
    train` does: through `cli.entry`, not `sys.exit(cli.main(...))`."""
    import ast

    tree = ast.parse((ROOT / "pretrain" / "pretrain_gpt.py").read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "entry" in called and "main" not in called
    out = subprocess.run(
        [sys.executable, "pretrain/pretrain_gpt.py", "--config", "no-such.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "no-such.yaml" in out.stderr and "Traceback" not in out.stderr
