"""benchmarks/stress_multiprocess.py: the summarising logic on synthetic run records, no processes.

Signatures must group the same failure across runs (numbers, paths, ports, pids and rank
prefixes normalised away) and pick the telling line of a log; the failure class must follow
torchrun's root cause; the interval and the printed and JSON summaries must count what they say.
The loop itself (torchrun, timeouts, leftover ranks) is checked by running the script.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "stress_multiprocess.py"


@pytest.fixture(scope="module")
def sm():
    spec = importlib.util.spec_from_file_location("stress_multiprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def torchrun_report(root_rank: int, root_code: int, other_code: int = -15) -> str:
    """The tail torchrun writes when a rank fails: the other rank it stopped, then the root cause."""

    def entry(rank, code, pid):
        sig = {-15: "SIGTERM", -6: "SIGABRT", -9: "SIGKILL"}.get(code)
        trace = (
            f"Signal {-code} ({sig}) received by PID {pid}" if sig else "To enable traceback see: https://x"
        )
        return [
            f"  rank      : {rank} (local_rank: {rank})",
            f"  exitcode  : {code} (pid: {pid}){f'  ({sig})' if sig else ''}",
            "  error_file: <N/A>",
            f"  traceback : {trace}",
        ]

    pid = 4000 + root_rank
    return "\n".join(
        [
            f"E1201 16:17:13.414000 15589 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
            f"(exitcode: {root_code}) local_rank: {root_rank} (pid: {pid}) of binary: /venv/bin/python",
            "Traceback (most recent call last):",
            '  File "/venv/bin/torchrun", line 6, in <module>',
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "=" * 60,
            "megatron_lev FAILED",
            "-" * 60,
            "Failures:",
            "[1]:",
            *entry(1 - root_rank, other_code, 5000),
            "-" * 60,
            "Root Cause (first observed failure):",
            "[0]:",
            *entry(root_rank, root_code, pid),
            "=" * 60,
        ]
    )


# ---------------------------------------------------------------- normalisation and key lines


def test_normalise_removes_what_changes_between_runs(sm):
    a = (
        "[rank1]: RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
        "closed by peer [127.0.0.1]:29500 (pid 1234, 0x7f00e9430b80) in /tmp/stress/run_0007/train/ckpt"
    )
    b = (
        "RuntimeError: [/build/third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection "
        "closed by peer [10.0.0.12]:41877 (pid 99, 0x7fa996d826c0) in /data/other/run_0123/train/ckpt"
    )
    assert sm.normalise(a) == sm.normalise(b)
    n = sm.normalise(a)
    for gone in ("rank1", "29500", "1234", "0x7f", "/tmp", "127.0.0.1"):
        assert gone not in n, (gone, n)
    assert n.startswith("RuntimeError: [<path>/pair.cc:<n>] Connection closed by peer")
    # log prefixes, time stamps, ports in host:port, cache hashes, uuids; a ratio is not a path
    assert (
        sm.normalise("16:17:09 [INFO] [rank 0] x: iter 3/3 at localhost:29400")
        == "[INFO] x: iter <n>/<n> at <addr>"
    )
    assert sm.normalise("idx_6cac124a6bf834ec_doc.npy id 123e4567-e89b-12d3-a456-426614174000") == (
        "idx_<hex>_doc.npy id <uuid>"
    )
    assert sm.normalise("terminate called without an active exception") == (
        "terminate called without an active exception"
    )


def test_key_line_prefers_terminate_then_fatal_then_the_first_exception(sm):
    traceback = "\n".join(
        [
            "12:00:00 [INFO] [rank 0] training: iter 1/3 | loss 10.79",
            "[rank1]: Traceback (most recent call last):",
            '[rank1]:   File "/x/megatron_lev/engine/pipeline.py", line 12, in step',
            "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:29500",
            "ValueError: a later, secondary error",
        ]
    )
    report = torchrun_report(0, -6)
    i, line = sm.key_line(traceback + "\n" + report)
    assert "RuntimeError: Connection closed" in line and i == 3
    with_abort = "terminate called without an active exception\nFatal Python error: Aborted\n" + traceback
    assert sm.key_line(with_abort)[1] == "terminate called without an active exception"
    assert sm.key_line("Fatal Python error: Aborted\n" + traceback)[1] == "Fatal Python error: Aborted"
    cli = "12:00:00 [WARNING] x: careful\nmegatron-lev train: config error: parallel.zero_stage=5 is bad\n"
    assert "config error" in sm.key_line(cli + report)[1]
    # only the launcher's report: its root cause, not the rank it stopped with SIGTERM
    assert "Signal 6 (SIGABRT)" in sm.key_line(report)[1]
    # nothing recognisable: the last line that is not a banner; stdout when stderr is empty
    assert sm.key_line("starting\nsomething odd happened\n" + "=" * 20)[1] == "something odd happened"
    assert sm.key_line("", "last words\n") == (-1, "last words")
    assert sm.key_line("", "") is None


def test_signatures_group_the_same_failure_and_keep_the_first_lines(sm):
    def log(pid, port):
        return "\n".join(
            [
                f"12:00:0{pid % 10} [INFO] [rank 0] start on 127.0.0.1:{port}",
                "terminate called after throwing an instance of 'c10::DistBackendError'",
                f"  what():  [../third_party/gloo/transport/tcp/unbound_buffer.cc:81] Timed out {pid} ms",
                "Fatal Python error: Aborted",
                torchrun_report(1, -6),
            ]
        )

    sig_a, excerpt = sm.signature_of("rank-signal:SIGABRT", log(11, 29500))
    sig_b, _ = sm.signature_of("rank-signal:SIGABRT", log(4242, 41234))
    assert sig_a == sig_b
    assert sig_a.startswith("rank-signal:SIGABRT | terminate called after throwing an instance of 'c10::")
    assert "what(): [<path>/unbound_buffer.cc:<n>] Timed out <n> ms" in sig_a
    assert excerpt[0].startswith("12:00:01 [INFO]") and "terminate called" in excerpt[1]
    assert len(excerpt) <= sm.EXCERPT_BEFORE + sm.EXCERPT_AFTER
    assert sm.signature_of("timeout", "") == ("timeout | (no output)", [])


# ---------------------------------------------------------------- failure classes


def test_the_class_follows_torchruns_root_cause(sm):
    assert sm.classify(0, False, "") is None
    assert sm.classify(1, False, torchrun_report(1, 3)) == "exit:3"  # not the SIGTERM it sent rank 0
    assert sm.classify(1, False, torchrun_report(0, -6)) == "rank-signal:SIGABRT"
    assert sm.classify(1, False, torchrun_report(0, -9, other_code=1)) == "rank-signal:SIGKILL"
    assert sm.classify(1, False, "E1201 x] failed (exitcode: 2) local_rank: 0 (pid: 7)") == "exit:2"
    launcher = "E1201 16:17:13.414000 15589 torch/distributed/elastic/multiprocessing/api.py:1002] failed"
    assert sm.normalise(launcher) == "torch/distributed/elastic/multiprocessing/api.py:<n>] failed"
    assert sm.classify(1, False, "no report at all") == "exit:1"
    assert sm.classify(-6, False, "") == "signal:SIGABRT"
    assert sm.classify(-9, True, torchrun_report(0, -6)) == "timeout"
    assert sm.classify(0, False, "", leftover=1) == "leftover-process"
    assert sm.classify(0, False, "", problems=["metrics.jsonl steps [1, 2]"]) == "bad-output"


def test_layout_names(sm):
    lay = sm.Layout.parse("resume-pp2-zero1")
    assert (lay.tp, lay.pp, lay.zero, lay.resume) == (1, 2, 1, True)
    assert lay.phases(3) == [("save", 0, 3), ("resume", 3, 6)]
    assert sm.Layout.parse("tp2-zero0").phases(5) == [("train", 0, 5)]
    assert sm.Layout.parse("tp2-zero0").overrides()["parallel.tensor_model_parallel_size"] == 2
    for bad in ("dp4-zero0", "pp2-zero4", "resume_dp2-zero1", "dp2"):
        with pytest.raises(ValueError, match="unknown layout"):
            sm.Layout.parse(bad)
    assert all(sm.Layout.parse(name) for name in sm.DEFAULT_LAYOUTS)


def test_output_check_of_a_finished_command(sm, tmp_path):
    out = tmp_path / "train"
    (out / "ckpt").mkdir(parents=True)

    def write(rows, tag):
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "ckpt" / "latest").write_text(tag)

    def step(i, loss=10.0):
        return {"kind": "train", "iteration": i, "loss": loss}

    start = {"kind": "event", "event": "start", "iteration": 0}
    end = {"kind": "event", "event": "end", "exit_code": 0}
    save = {"first_iteration": 0, "last_iteration": 3}
    resume = {"first_iteration": 3, "last_iteration": 6}
    write([start, step(1), step(2), step(3), end], "iter_0000003")
    assert sm.check_outputs(out, save, "") == []
    # a resume appends to the same metrics.jsonl: only the rows after the last start count
    write([start, step(1), step(2), step(3), end, start, step(4), step(5), step(6), end], "iter_0000006")
    assert sm.check_outputs(out, resume, "x: resumed from /a/ckpt/iter_0000003 (iteration 3)\n") == []
    problems = sm.check_outputs(out, resume, "x: no checkpoint under /a/ckpt: starting from scratch\n")
    assert problems == ["no 'resumed from ... (iteration 3)' line in the resume's log"]
    write([start, step(1), step(3, float("nan")), {**end, "exit_code": 3}], "iter_0000002")
    problems = sm.check_outputs(out, save, "")
    assert len(problems) == 4, problems
    assert "expected 1 to 3" in problems[0] and "non-finite loss at step(s) [3]" in problems[1]
    assert "exit code 0" in problems[2] and "'iter_0000002'" in problems[3]
    (out / "metrics.jsonl").unlink()
    assert "unreadable" in sm.check_outputs(out, save, "")[0]


# ---------------------------------------------------------------- interval and summary


def test_rate_interval(sm):
    low, high, method = sm.rate_interval(0, 500)
    assert low == 0.0 and high == pytest.approx(1 - 0.05 ** (1 / 500)) and 0.0059 < high < 0.0061
    assert "exact" in method
    assert sm.rate_line(0, 500) == (
        "0 failures in 500 runs, 95% upper bound 0.597% (one-sided exact binomial upper bound)"
    )
    low, high, method = sm.rate_interval(5, 100)  # Wilson: 2.15% - 11.2%
    assert low == pytest.approx(0.02154, abs=1e-4) and high == pytest.approx(0.11175, abs=1e-4)
    assert method.startswith("Wilson")
    assert (
        sm.rate_line(5, 100)
        == "5 failures in 100 runs (5%), 95% interval 2.15% - 11.2% (Wilson score interval)"
    )
    low, high, _ = sm.rate_interval(3, 3)
    assert high == 1.0 and 0.4 < low < 0.5
    assert sm.rate_interval(0, 0) is None and sm.rate_line(0, 0) == "no finished run"


def _record(run, layout, status, seconds, phases=None, **failure):
    names = phases or ["train"]
    rec = {
        "run": f"run_{run:04d}",
        "layout": layout,
        "status": status,
        "seconds": seconds,
        "phases": [{"name": n, "seconds": seconds / len(names)} for n in names],
    }
    rec.update(failure)
    return rec


def test_summary_counts_groups_and_prints(sm):
    terminate = "rank-signal:SIGABRT | terminate called without an active exception"
    gloo = "exit:1 | RuntimeError: Connection closed by peer [<addr>]"
    records = [
        _record(1, "dp2-zero0", "ok", 10.0),
        _record(
            2,
            "dp2-zero0",
            "failed",
            12.0,
            klass="rank-signal:SIGABRT",
            signature=terminate,
            phase="train",
            log="/o/run_0002/train.stderr.log",
            excerpt=["terminate called without an active exception", "Fatal Python error: Aborted"],
        ),
        _record(3, "pp2-zero0", "ok", 20.0),
        _record(4, "pp2-zero0", "ok", 30.0),
        _record(
            5,
            "resume-dp2-zero1",
            "failed",
            40.0,
            phases=["save", "resume"],
            klass="rank-signal:SIGABRT",
            signature=terminate,
            phase="resume",
            log="/o/run_0005/resume.stderr.log",
            excerpt=["terminate called without an active exception"],
        ),
        _record(6, "resume-dp2-zero1", "ok", 44.0, phases=["save", "resume"]),
        _record(
            7,
            "pp2-zero0",
            "failed",
            25.0,
            klass="exit:1",
            signature=gloo,
            phase="train",
            log="/o/run_0007/train.stderr.log",
            excerpt=["RuntimeError: Connection closed by peer [127.0.0.1]:29500"],
        ),
        _record(8, "dp2-zero0", "interrupted", 3.0),
    ]
    s = sm.summarise(records)
    json.dumps(s)  # summary.json holds it as is
    assert (s["runs"], s["failures"], s["interrupted"]) == (7, 3, 1)
    assert s["failure_rate"] == pytest.approx(3 / 7)
    assert (
        s["interval_95"]["method"].startswith("Wilson")
        and s["interval_95"]["low"] < 3 / 7 < s["interval_95"]["high"]
    )
    assert s["layouts"]["dp2-zero0"] == {
        "runs": 2,
        "failures": 1,
        "seconds": {"median": 11.0, "mean": 11.0, "min": 10.0, "max": 12.0},
    }
    assert s["layouts"]["pp2-zero0"]["seconds"]["median"] == 25.0
    assert s["layouts"]["resume-dp2-zero1"]["phase_seconds"]["save"]["median"] == 21.0
    first, second = s["signatures"]
    assert first["signature"] == terminate and first["count"] == 2
    assert first["layouts"] == {"dp2-zero0": 1, "resume-dp2-zero1:resume": 1}
    assert first["runs"] == ["run_0002", "run_0005"]
    assert first["example"]["log"] == "/o/run_0002/train.stderr.log"
    assert second["signature"] == gloo and second["count"] == 1
    text = sm.format_summary(s)
    assert text.splitlines()[0].startswith("runs 7, failures 3: 3 failures in 7 runs (42.9%), 95% interval")
    assert "(1 run(s) interrupted, not counted)" in text
    assert "2 distinct failure signature(s):" in text
    assert f"[2x] {terminate}" in text and "layouts: dp2-zero0 x1, resume-dp2-zero1:resume x1" in text
    assert "| terminate called without an active exception" in text
    assert "example log: /o/run_0002/train.stderr.log" in text
    assert "save 21.0, resume 21.0" in text  # the pair's median seconds per command: 20 and 22


def test_summary_of_clean_and_empty_campaigns(sm):
    ok = [_record(i, "tp2-zero1", "ok", 15.0 + i) for i in range(1, 501)]
    s = sm.summarise(ok)
    assert s["failures"] == 0 and s["signatures"] == []
    assert math.isclose(s["interval_95"]["high"], 1 - 0.05 ** (1 / 500))
    assert sm.format_summary(s).splitlines()[0] == (
        "runs 500, failures 0: 0 failures in 500 runs, 95% upper bound 0.597% "
        "(one-sided exact binomial upper bound)"
    )
    empty = sm.summarise([_record(1, "tp2-zero1", "interrupted", 1.0)])
    assert empty["runs"] == 0 and empty["failure_rate"] is None and empty["interval_95"] is None
    assert "no finished run" in sm.format_summary(empty)


# ---------------------------------------------------------------- batches and the cumulative report


def test_batches_add_up_by_label_without_machine_paths(sm, tmp_path):
    out = tmp_path / "stress-night"
    terminate = "rank-signal:SIGABRT | terminate called without an active exception"

    def rec(i, status, **failure):
        r = _record(i, "pp2-zero0", status, 30.0 + i, **failure)
        r["dir"] = str(out / r["run"])
        r["phases"][0]["stderr"] = str(out / r["run"] / "train.stderr.log")
        return r

    failed = rec(
        2,
        "failed",
        klass="rank-signal:SIGABRT",
        signature=terminate,
        phase="train",
        log=str(out / "run_0002" / "train.stderr.log"),
        excerpt=[f"terminate called without an active exception in {sm.ROOT}/megatron_lev/x.py"],
    )
    options = {"host": "node-17", "started": "2026-12-02T10:00:00", "layouts": ["pp2-zero0"]}
    folder = tmp_path / "stress"
    batches = {
        "after-1.json": ("after", [rec(1, "ok"), failed, rec(3, "ok")]),
        "after-2.json": ("after", [rec(1, "ok"), rec(2, "ok"), rec(3, "interrupted")]),
        "before-1.json": ("before", [rec(1, "ok")]),
    }
    for name, (label, records) in batches.items():
        records[0]["phases"][0]["command"] = f"torchrun ... data.tokenizer_path={tmp_path}/data/tok.json"
        batch = sm.batch_record(label, options, records, out, {str(tmp_path / "data"): "<shared-data>"})
        text = json.dumps(batch)
        assert str(tmp_path) not in text and str(sm.ROOT) not in text and "node-17" not in text
        assert "data.tokenizer_path=<shared-data>/tok.json" in text
        assert batch["label"] == label and "dir" not in batch["records"][0]
        assert batch["records"][0]["phases"][0]["stderr"] == "<out>/run_0001/train.stderr.log"
        sm.write_atomic(folder / name, text)
    md = sm.report(folder)
    before, after = md.index("## before"), md.index("## after")
    assert before < after  # before first, whatever the file names
    assert "**0 failures in 1 runs" in md[before:after]
    assert "**1 failure in 5 runs (20%)" in md[after:]  # the interrupted run is not counted
    assert "| `after-1.json` |" in md and "| 3 | 1 | 0 |" in md and "| 2 | 0 | 1 |" in md
    assert f"**1x** `{terminate}` (pp2-zero0 x1; runs after-1/run_0002)" in md
    assert "terminate called without an active exception in <repo>/megatron_lev/x.py" in md


def test_report_of_a_folder_without_batches_says_so(sm, tmp_path):
    (tmp_path / "notes.json").write_text('{"label": "after"}')
    with pytest.raises(SystemExit, match=r"notes.json: not a batch file written by --record"):
        sm.report(tmp_path)
    with pytest.raises(SystemExit, match=r"--report .*empty: no batch file"):
        sm.report(tmp_path / "empty")


def test_record_needs_a_label_and_a_new_file(sm, tmp_path, capsys):
    with pytest.raises(SystemExit):
        sm.parse_args(["--record", str(tmp_path / "b.json")])
    assert "--record needs --label" in capsys.readouterr().err
    (tmp_path / "b.json").write_text("{}")
    with pytest.raises(SystemExit, match="already exists; give a new file"):
        sm.main(["--record", str(tmp_path / "b.json"), "--label", "after"])


def test_git_state_names_changed_files_but_not_the_batch_folder(sm, tmp_path):
    import subprocess

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "script.py").write_text("old\n")
    git("add", "script.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    (tmp_path / "script.py").write_text("new\n")  # the `before` batches: this script copied in
    (tmp_path / "results" / "stress").mkdir(parents=True)
    (tmp_path / "results" / "stress" / "after-1.json").write_text("{}")  # an earlier batch, uncommitted
    (tmp_path / "notes.txt").write_text("x")
    state = sm.git_state(tmp_path, ignore=tmp_path / "results" / "stress")
    assert len(state["commit"]) == 40
    assert state["modified"] == ["notes.txt (untracked)", "script.py"]
    assert "results/stress/after-1.json (untracked)" in sm.git_state(tmp_path)["modified"]
