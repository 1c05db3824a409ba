"""A newcomer's log: no progress-bar frames in files, no MFU on CPU, no third-party warnings that
say nothing to act on.

Every command runs as a real process whose stderr is a pipe (as under `make demo`, Slurm or
`> log 2>&1`), except the row that gives it a pseudo-terminal: there the bar must stay.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import zstandard

from tests.reliability.harness import ROOT, expect_ok, run_cli_process
from tests.tiny_run import CONFIG_SCHEDULE, tiny_overrides

pytestmark = pytest.mark.timeout(900)

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
CPU = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
# what a clean log never holds (any of them fails the row, naming it)
NOISE = {
    "progress-bar frame": re.compile(r"\r|\d%\||\u2588"),  # a carriage return, or a drawn bar
    "MFU on CPU": re.compile(r"MFU"),
    "DeepSpeed's untested-optimizer warning": re.compile(r"untested optimizer"),
    "DeepSpeed's accelerator guess": re.compile(r"Setting accelerator to CPU"),
    "a Python warning": re.compile(r"(Future|Deprecation|User|Runtime)Warning"),
    "a traceback": re.compile(r"Traceback"),
}


def noise_in(text: str) -> list[str]:
    return [
        f"{name}: {m.group(0)!r} in {text[max(m.start() - 80, 0) : m.end() + 80]!r}"
        for name, rx in NOISE.items()
        if (m := rx.search(text))
    ]


def _env(**extra) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR")
    }
    env.update(CPU, **extra)
    return env


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_data) -> Path:
    lines = []
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            lines.append(line)
            if len(lines) == 300:
                break
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def neox(shared_data) -> str:
    return str(shared_data / "tokenizers" / "gpt-neox-20b.json")


def preprocess_argv(corpus, prefix, neox) -> list:
    # progress left on (the default): the bar, or its plain lines, is what the rows look at
    return [
        "preprocess",
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--tokenizer",
        neox,
        "--chunk-mb",
        "0.02",
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus, neox) -> dict:
    """Two CPU ranks under the user-facing launcher (ZeRO-1, as the demo), 4 steps; its whole output."""
    work = tmp_path_factory.mktemp("cleanlog")
    prefix = work / "wiki"
    expect_ok(run_cli_process(preprocess_argv(corpus, prefix, neox), env=_env()))
    out = work / "run"
    over = tiny_overrides(
        prefix,
        neox,
        out,
        cache=work / "cache",
        **{
            **CONFIG_SCHEDULE,
            "data.split": "90,10,0",
            "train.train_iters": 4,
            "train.eval_interval": 2,
            "train.eval_iters": 2,
            "logging.progress_bar": None,  # keeps its default (true)
        },
    )
    proc = subprocess.run(
        [
            str(ROOT / "scripts" / "torchrun_local.sh"),
            "--config",
            str(TINY),
            *over,
        ],
        cwd=ROOT,
        env=_env(NPROC="2", DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "prefix": prefix, "log": proc.stdout + proc.stderr}


# ------------------------------------------------------------------ the rows


def row_preprocess_off_a_terminal(tmp_path, corpus, neox, trained):
    res = run_cli_process(preprocess_argv(corpus, tmp_path / "set", neox), env=_env())
    expect_ok(res)
    assert re.search(r"^preprocess: 300 docs \[", res.err, re.MULTILINE), res.err[-2000:]  # the final state
    return res.out + res.err


def row_preprocess_on_a_terminal_keeps_its_bar(tmp_path, corpus, neox, trained):
    """A guard: on a terminal the bar (carriage-return frames) stays."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 x 0
    argv = [sys.executable, "-m", "megatron_lev", *map(str, preprocess_argv(corpus, tmp_path / "set", neox))]
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=120) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert "\r" in text and "docs" in text, text[-1000:]
    return None


def row_training_on_two_cpu_ranks(tmp_path, corpus, neox, trained):
    log = trained["log"]
    assert re.search(r"iter 4/4 \| loss [\d.]+ .*TFLOP/s/dev \| mem", log), log[-2000:]
    return log


def row_convert_and_evaluate_the_export_without_ds_accelerator(tmp_path, corpus, neox, trained):
    """DeepSpeed guesses the device (DS_ACCELERATOR unset); transformers loads the export twice."""
    log = ""
    for argv in (
        ["convert", trained["out"] / "ckpt", tmp_path / "hf", "--tokenizer", neox],
        [
            "evaluate",
            tmp_path / "hf",
            "--data",
            trained["prefix"],
            "--split",
            "valid",
            "--split-spec",
            "90,10,0",
            "--seq-len",
            "32",
            "--threads",
            "1",
            "--out",
            tmp_path / "eval",
        ],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_lev", *map(str, argv)],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        log += proc.stdout + proc.stderr
    assert (tmp_path / "eval" / "eval.json").is_file()
    return log


def row_evaluate_off_a_terminal(tmp_path, corpus, neox, trained):
    res = run_cli_process(
        [
            "evaluate",
            trained["out"] / "ckpt",
            "--data",
            trained["prefix"],
            "--split",
            "valid",
            "--split-spec",
            "90,10,0",
            "--seq-len",
            "32",
            "--threads",
            "1",
            "--out",
            tmp_path / "eval",
        ],
        env=_env(),
        timeout=300,
    )
    expect_ok(res)
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["results"][0]["tokens"] > 0
    assert re.search(r"^evaluating: [\d.]+k? tok \[", res.err, re.MULTILINE), res.err[-2000:]
    return res.out + res.err


ROWS = [
    pytest.param(row_preprocess_off_a_terminal, id="preprocess-progress-off-a-terminal-is-plain-lines"),
    pytest.param(
        row_preprocess_on_a_terminal_keeps_its_bar, id="preprocess-progress-on-a-terminal-keeps-the-bar"
    ),
    pytest.param(row_training_on_two_cpu_ranks, id="train-two-cpu-ranks-no-mfu-no-third-party-warnings"),
    pytest.param(
        row_convert_and_evaluate_the_export_without_ds_accelerator,
        id="convert-and-evaluate-export-no-device-guess-no-loading-bars",
    ),
    pytest.param(row_evaluate_off_a_terminal, id="evaluate-progress-off-a-terminal-is-plain-lines"),
]


@pytest.mark.parametrize("row", ROWS)
def test_a_clean_log(row, tmp_path, corpus, neox, trained):
    log = row(tmp_path, corpus, neox, trained)
    if log is not None:
        assert not noise_in(log), noise_in(log)


def test_plain_progress_writes_at_most_one_line_per_interval_and_the_final_state(monkeypatch):
    from megatron_lev.utils import progress

    stream = io.StringIO()
    bar = progress.progress_bar(total=1000, desc="evaluating", unit="tok", file=stream)
    for _ in range(1000):  # a refresh per update, as `set_postfix` asks for
        bar.update(1)
        bar.set_postfix(tok_per_s="1")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith("evaluating: 1000/1000 tok (100%)"), lines
    assert "\r" not in stream.getvalue()
