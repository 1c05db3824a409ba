"""Two writers into one output: `preprocess` into one prefix, `train` into one save or output
directory. The second is refused in one line naming the output, the holder (host, pid) and the
lock file, and the first one's output is untouched; a killed holder leaves nothing locked.

Each case starts a real holder process that is caught mid-run (a preprocess whose worker stalls
at chunk 2; a training with a budget it will not reach), then runs the second writer.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import zstandard

from megatron_lev.utils.lock import DIR_LOCK_NAME
from tests.reliability.harness import ROOT, Outcome, expect_error, expect_ok, run_cli_process
from tests.tiny_run import CONFIG_SCHEDULE, tiny_overrides

pytestmark = pytest.mark.timeout(600)

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
HOST = re.escape(socket.gethostname())

# `megatron-lev` whose preprocess worker stalls at chunk 2: a run in progress, holding its lock
STALLING_PREPROCESS = (
    "import sys\n"
    "from megatron_lev.data.preprocess import set_chunk_hook\n"
    "from megatron_lev.testing.preprocess_faults import PreprocessFault\n"
    "set_chunk_hook(PreprocessFault('sleep', 2))\n"
    "from megatron_lev.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _env() -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_LEV_DEBUG")
    }
    env.update(ENV)
    return env


# ------------------------------------------------------------------ inputs


@pytest.fixture(scope="module")
def neox(shared_data) -> str:
    return str(shared_data / "tokenizers" / "gpt-neox-20b.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shared_data) -> Path:
    """300 Wikipedia documents as JSON lines."""
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
def shard(tmp_path_factory, corpus, neox) -> str:
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    prefix = tmp_path_factory.mktemp("shard") / "wiki_text_document"
    preprocess(PreprocessOptions([str(corpus)], str(prefix), "hf", neox, workers=1, progress=False))
    return str(prefix)


def preprocess_argv(corpus, prefix, neox, *extra) -> list:
    return [
        "preprocess",
        "--input",
        corpus,
        "--output-prefix",
        prefix,
        "--tokenizer",
        neox,
        "--no-progress",
        *extra,
    ]


def train_overrides(shard: str, neox: str, out: Path, **extra) -> list[str]:
    return tiny_overrides(
        shard, neox, out, cache=out.parent / "cache", **{**CONFIG_SCHEDULE, "train.train_iters": 2, **extra}
    )


# ------------------------------------------------------------------ the holders


@dataclass
class Holder:
    proc: subprocess.Popen
    lock: Path  # the lock file it holds

    def stop(self) -> Outcome:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        out, err = self.proc.communicate(timeout=60)
        return Outcome(self.proc.returncode, out, err)


def _start(argv: list, ready, lock: Path, what: str) -> Holder:
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    holder = Holder(proc, lock)
    deadline = time.monotonic() + 240
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not ready():
        res = holder.stop()
        pytest.fail(f"the {what} holding the lock did not get going (exit {res.rc}): {res.err[-2000:]}")
    return holder


def preprocess_holder(corpus, prefix: Path, neox) -> Holder:
    """A preprocess into `prefix` whose worker stalls at chunk 2 (it holds the prefix's lock)."""
    from megatron_lev.data.preprocess import lock_path

    lock = lock_path(prefix)
    argv = [sys.executable, "-c", STALLING_PREPROCESS]
    argv += map(str, preprocess_argv(corpus, prefix, neox, "--workers", "2", "--chunk-mb", "0.005"))
    staging = lambda: any(prefix.parent.glob(f".{prefix.name}.staging*"))  # noqa: E731 - made under the lock
    return _start(argv, staging, lock, "preprocess")


def train_holder(shard, neox, out: Path, **extra) -> Holder:
    """A training into `out` that has logged its first step and will not end by itself."""
    over = train_overrides(
        shard, neox, out, **{"train.train_iters": 100000, "train.save_interval": 0, **extra}
    )
    argv = [sys.executable, "-m", "megatron_lev", "train", "--config", str(TINY), *over]
    metrics = out / "metrics.jsonl"
    return _start(
        argv,
        lambda: metrics.is_file() and '"kind": "train"' in metrics.read_text(),
        out / DIR_LOCK_NAME,
        "training",
    )


def holder_line(holder: Holder) -> str:
    return rf"host {HOST}, pid {holder.proc.pid}\b"


# ------------------------------------------------------------------ the cases


def case_preprocess_same_prefix(tmp_path, corpus, neox, shard):
    prefix = tmp_path / "out" / "set"
    holder = preprocess_holder(corpus, prefix, neox)
    try:
        res = run_cli_process(preprocess_argv(corpus, prefix, neox, "--workers", "1"), env=_env())
        line = expect_error(
            res, r"--output-prefix .*/out/set\b", r"another megatron-lev preprocess", holder_line(holder)
        )
        assert str(holder.lock) in line
        assert not Path(f"{prefix}.manifest.json").exists()  # the second wrote nothing
    finally:
        holder.stop()


def case_preprocess_other_prefix_same_dir(tmp_path, corpus, neox, shard):
    """No false conflict: the lock is the prefix's, not the directory's."""
    prefix = tmp_path / "out" / "set"
    holder = preprocess_holder(corpus, prefix, neox)
    try:
        expect_ok(run_cli_process(preprocess_argv(corpus, tmp_path / "out" / "other", neox), env=_env()))
        assert Path(f"{tmp_path}/out/other.manifest.json").is_file()
        assert holder.proc.poll() is None  # still holding its own
    finally:
        holder.stop()


def case_preprocess_after_holder_killed(tmp_path, corpus, neox, shard):
    """SIGKILL (the OOM killer) cannot leave the prefix locked: the kernel drops the lock."""
    prefix = tmp_path / "out" / "set"
    holder = preprocess_holder(corpus, prefix, neox)
    assert holder.stop().rc == -signal.SIGKILL
    expect_ok(run_cli_process(preprocess_argv(corpus, prefix, neox), env=_env()))
    assert Path(f"{prefix}.manifest.json").is_file()
    assert not holder.lock.exists()  # the next writer took the stale file over and removed it


def case_train_same_save_dir(tmp_path, corpus, neox, shard):
    first, second = tmp_path / "a", tmp_path / "b"
    holder = train_holder(shard, neox, first)
    try:
        over = train_overrides(shard, neox, second, **{"train.save": first / "ckpt"})
        res = run_cli_process(["train", "--config", TINY, *over], env=_env(), timeout=240)
        line = expect_error(res, r"train.save=.*/a/ckpt", r"another megatron-lev train", holder_line(holder))
        assert str(first / "ckpt" / DIR_LOCK_NAME) in line
        assert not (second / "metrics.jsonl").exists()
    finally:
        holder.stop()


def case_train_same_output_dir(tmp_path, corpus, neox, shard):
    first = tmp_path / "a"
    holder = train_holder(shard, neox, first)
    try:
        before = (first / "metrics.jsonl").read_text()
        over = train_overrides(shard, neox, first, **{"train.save": tmp_path / "other-ckpt"})
        res = run_cli_process(["train", "--config", TINY, *over], env=_env(), timeout=240)
        expect_error(res, r"logging.output_dir=.*/a\b", r"another megatron-lev train", holder_line(holder))
        # the holder's metrics have one start event: the refused run wrote none into them
        events = [json.loads(x) for x in (first / "metrics.jsonl").read_text().splitlines() if '"event"' in x]
        assert [e["event"] for e in events] == ["start"], events
        assert (first / "metrics.jsonl").read_text().startswith(before)
    finally:
        holder.stop()


def case_train_two_ranks_refused_on_every_rank(tmp_path, corpus, neox, shard):
    """Under a launcher only rank 0 takes the lock; every rank stops with the same one line."""
    from tests.reliability.test_dp_change import train as train_ranks

    first = tmp_path / "a"
    holder = train_holder(shard, neox, first)
    try:
        res = train_ranks(2, ["--config", TINY, *train_overrides(shard, neox, first)])
        for r in res:
            assert r["rc"] == 1 and "Traceback" not in r["err"], r["err"][-2000:]
        line = [x for x in res[0]["err"].splitlines() if x.strip()][-1]
        assert re.search(r"another megatron-lev train", line) and re.search(holder_line(holder), line), line
    finally:
        holder.stop()


def case_train_after_holder_killed(tmp_path, corpus, neox, shard):
    first = tmp_path / "a"
    holder = train_holder(shard, neox, first)
    assert holder.stop().rc == -signal.SIGKILL
    assert (first / "ckpt" / DIR_LOCK_NAME).exists()  # left behind, but nobody holds it
    expect_ok(
        run_cli_process(
            ["train", "--config", TINY, *train_overrides(shard, neox, first)], env=_env(), timeout=240
        )
    )
    assert (first / "ckpt" / "latest").is_file()
    assert not (first / "ckpt" / DIR_LOCK_NAME).exists() and not (first / DIR_LOCK_NAME).exists()


CASES = [
    pytest.param(case_preprocess_same_prefix, id="preprocess-two-writers-one-prefix-refused"),
    pytest.param(case_preprocess_other_prefix_same_dir, id="preprocess-other-prefix-same-directory-runs"),
    pytest.param(case_preprocess_after_holder_killed, id="preprocess-after-sigkilled-holder-runs"),
    pytest.param(case_train_same_save_dir, id="train-two-runs-one-save-dir-refused"),
    pytest.param(case_train_same_output_dir, id="train-two-runs-one-output-dir-refused"),
    pytest.param(case_train_two_ranks_refused_on_every_rank, id="train-two-ranks-refused-on-every-rank"),
    pytest.param(case_train_after_holder_killed, id="train-after-sigkilled-holder-runs"),
]


@pytest.mark.parametrize("case", CASES)
def test_one_writer_per_output(case, tmp_path, corpus, neox, shard):
    case(tmp_path, corpus, neox, shard)
