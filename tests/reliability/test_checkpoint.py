"""Checkpoints under faults: damaged files, markers and pointers, foreign directories, config
changes on resume, preemption signals at start-up, a full disk during a save, pickle payloads.

One real tiny training (two checkpoints, iterations 2 and 4) is shared by the module and
copied per case. Most cases call the code `megatron-lev train` runs before it builds the
model (`training.resume.choose_start` and `ckpt.layout`) in this process; the faults that need a
real process (signals, a full disk, torchrun, a resume that trains) run the CLI.

A full disk is a real one when this user may mount a small tmpfs (root); otherwise
DeepSpeed's file writer is patched in the child process to raise ENOSPC.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zstandard

from megatron_lev.ckpt import io as ckio
from megatron_lev.ckpt import layout as ck
from megatron_lev.engine.deepspeed_engine import DeepSpeedEngine
from megatron_lev.errors import CheckpointDataError
from megatron_lev.testing.distributed import DistributedTestError, run_distributed
from megatron_lev.testing.faults import SAVE_POINTS
from megatron_lev.training import resume
from megatron_lev.utils import dist as ranks
from megatron_lev.utils.io import TEMP_MARK
from tests.reliability.harness import (
    ROOT,
    expect_error,
    expect_ok,
    leftover_processes,
    run_cli_process,
    tiny_run_overrides,
)

pytestmark = pytest.mark.timeout(300)

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
ENGINE_FILES = DeepSpeedEngine.owned_files()
ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
RNG = "rng_state_rank0.pt"
IT2, IT4 = ck.tag_for(2), ck.tag_for(4)


def _env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_LEV_DEBUG")
    }
    env.update(ENV, MAX_FAILURES="0", **extra)  # torchrun_local.sh: one attempt, its report read here
    return env


def overrides(data: dict, out: Path, **extra) -> list[str]:
    """A seconds-long CPU run of the tiny config writing under `out`."""
    return tiny_run_overrides(data["prefix"], data["tokenizer"], data["cache"], out, **extra)


def train(over: list[str], *, timeout: float = 180, **env) -> object:
    return run_cli_process(["train", "--config", TINY, *over], timeout=timeout, env=_env(**env))


def snapshot(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `root` (to prove nothing changed)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------ shared inputs


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_data) -> dict:
    """300 real Wikipedia documents in one shard set, GPT-NeoX tokenizer."""
    return make_data(tmp_path_factory.mktemp("ckdata"), shared_data)


def make_data(work: Path, shared_data: Path) -> dict:
    """The shard set of the `data` fixture, written under `work`."""
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    work.mkdir(parents=True, exist_ok=True)
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


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """The output directory of a finished 4-iteration run with checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("trained") / "run"
    expect_ok(train(overrides(data, out)))
    assert (out / "ckpt" / "latest").read_text().strip() == IT4
    return out


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A private copy of the trained run (output directory with `ckpt/`)."""
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


def flip(path: Path, n: int = 64) -> None:
    """Invert `n` bytes in the middle of `path` (the size stays the same)."""
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + n] = bytes(b ^ 0xFF for b in raw[mid : mid + n])
    path.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_marker(tag_dir: Path, fn) -> None:
    marker = tag_dir / ck.COMPLETE_MARKER
    data = json.loads(marker.read_text())
    fn(data)
    marker.write_text(json.dumps(data))


def _wrong_sha(d):
    d["files"][MODEL]["sha256"] = "0" * 64


def _wrong_size(d):
    d["files"][OPTIM]["size"] += 1


def _escape(d):
    d["files"]["../../outside"] = {"size": 1, "sha256": "0" * 64}


def _extra_listed(d):
    d["files"]["layer_99-model_states.pt"] = {"size": 10, "sha256": "0" * 64}


# ------------------------------------------------------------------ damaged checkpoints (choose another)

DAMAGE = [
    # id, what is done to ckpt/, the tag resume must pick (None: error), regex the warning/error must match
    pytest.param(
        lambda c: flip(c / IT4 / MODEL),
        IT2,
        rf"{IT4}/{MODEL} does not match its checksum",
        id="model-64-bytes-flipped",
    ),
    pytest.param(lambda c: flip(c / IT4 / OPTIM), IT2, rf"{IT4}/{OPTIM} does not match", id="optim-flipped"),
    pytest.param(lambda c: flip(c / IT4 / RNG, 8), IT2, rf"{IT4}/{RNG} does not match", id="rng-flipped"),
    pytest.param(
        lambda c: flip(c / IT4 / "config.yaml", 4),
        IT2,
        rf"{IT4}/config.yaml does not match",
        id="stored-config-flipped",
    ),
    pytest.param(
        lambda c: truncate(c / IT4 / MODEL),
        IT2,
        rf"{MODEL} has \d+ bytes, \d+ expected",
        id="model-truncated",
    ),
    pytest.param(lambda c: truncate(c / IT4 / OPTIM), IT2, rf"{OPTIM} has \d+ bytes", id="optim-truncated"),
    pytest.param(lambda c: (c / IT4 / MODEL).unlink(), IT2, rf"{IT4}/{MODEL} is missing", id="model-deleted"),
    pytest.param(lambda c: (c / IT4 / RNG).unlink(), IT2, rf"{IT4}/{RNG} is missing", id="rng-deleted"),
    pytest.param(
        lambda c: (c / IT4 / ck.COMPLETE_MARKER).unlink(),
        IT2,
        rf"incomplete checkpoint.*{IT4}",
        id="marker-missing",
    ),
    pytest.param(
        lambda c: (c / IT4 / ck.COMPLETE_MARKER).write_text("{not json"),
        IT2,
        rf"{IT4}/complete is unreadable",
        id="marker-garbage",
    ),
    pytest.param(
        lambda c: (c / IT4 / ck.COMPLETE_MARKER).write_bytes(b"\xff\xfe\x00"),
        IT2,
        rf"{IT4}/complete is unreadable",
        id="marker-binary",
    ),
    pytest.param(
        lambda c: edit_marker(c / IT4, _wrong_sha),
        IT2,
        rf"{MODEL} does not match its checksum",
        id="marker-wrong-checksum",
    ),
    pytest.param(
        lambda c: edit_marker(c / IT4, _wrong_size), IT2, rf"{OPTIM} has \d+ bytes", id="marker-wrong-size"
    ),
    pytest.param(
        lambda c: edit_marker(c / IT4, _extra_listed),
        IT2,
        r"layer_99-model_states.pt is missing",
        id="marker-lists-missing-file",
    ),
    pytest.param(
        lambda c: edit_marker(c / IT4, _escape), IT2, r"outside the checkpoint", id="marker-path-escape"
    ),
    pytest.param(
        lambda c: (c / "latest").write_text("iter_0000009\n"),
        IT4,
        r"latest points to 'iter_0000009', which is missing",
        id="latest-names-missing-tag",
    ),
    pytest.param(
        lambda c: (c / "latest").write_text("../../etc\n"),
        IT4,
        r"latest does not name a checkpoint",
        id="latest-garbage",
    ),
    pytest.param(
        lambda c: (c / "latest").write_bytes(b"\x80\x81\xfe"),
        IT4,
        r"latest is unreadable",
        id="latest-binary",
    ),
    pytest.param(
        lambda c: ((c / "latest").write_text(IT2 + "\n"), flip(c / IT2 / MODEL)),
        IT4,
        rf"{IT2}/{MODEL} does not match",
        id="latest-points-to-damaged-older",
    ),
    pytest.param(
        lambda c: (flip(c / IT4 / MODEL), flip(c / IT2 / OPTIM)),
        None,
        r"no usable checkpoint under .*ckpt.*iter_0000004, iter_0000002 failed verification.*restore",
        id="all-damaged",
    ),
]


@pytest.mark.parametrize("damage, expected, pattern", DAMAGE)
def test_damaged_checkpoint_is_named_and_skipped(run_copy, caplog, damage, expected, pattern):
    ckpt = run_copy / "ckpt"
    damage(ckpt)
    before = snapshot(ckpt)
    caplog.set_level("WARNING", logger="megatron_lev")
    if expected is None:
        with pytest.raises(CheckpointDataError) as err:
            resume.choose_start(ckpt, ckpt)
        assert re.search(pattern, str(err.value)), str(err.value)
    else:
        plan = resume.choose_start(ckpt, ckpt)
        assert plan.tag == expected
        assert re.search(pattern, caplog.text), caplog.text
        assert ck.verify_checkpoint(ckpt / plan.tag) == []
    assert snapshot(ckpt) == before, "choosing a checkpoint must not change any file"


def test_checksums_cover_every_file_and_cost_little(trained):
    """Every file of a saved checkpoint is in its marker; verifying the tiny model takes milliseconds."""
    tag_dir = trained / "ckpt" / IT4
    marker = ck.read_marker(tag_dir)
    assert (
        sorted(marker["files"])
        == ck.checkpoint_files(tag_dir)
        == sorted([MODEL, OPTIM, RNG, "config.yaml", "provenance.json"])
    )
    start = time.perf_counter()
    assert ck.verify_checkpoint(tag_dir) == []
    elapsed = time.perf_counter() - start
    size = sum(m["size"] for m in marker["files"].values())
    assert elapsed < 2.0, f"verifying {size / 2**20:.0f} MiB took {elapsed:.2f}s"


def test_flipped_latest_resumes_from_the_previous_checkpoint(run_copy, data):
    """End to end: 64 flipped bytes in the newest model file used to load silently (next loss 1765)."""
    flip(run_copy / "ckpt" / IT4 / MODEL)
    res = train(overrides(data, run_copy, **{"train.train_iters": 6, "train.save_interval": 0}))
    expect_ok(res)
    assert re.search(rf"checkpoint .*{IT4} is damaged: .*{MODEL} does not match its checksum", res.err), (
        res.err
    )
    assert f"resumed from {run_copy / 'ckpt' / IT2}" in res.err
    losses = [float(x) for x in re.findall(r"iter [3-6]/6 \| loss ([0-9.]+)", res.err + res.out)]
    assert len(losses) == 4 and all(5 < x < 11.5 for x in losses), losses
    assert (run_copy / "ckpt" / "latest").read_text().strip() == ck.tag_for(6)
    assert ck.verify_checkpoint(run_copy / "ckpt" / ck.tag_for(6)) == []


def test_resumed_run_whose_short_tail_was_all_skipped_finishes(run_copy, data):
    """Preempted one step before the end: the remaining step is skipped (non-finite loss). The run
    before learnt; this one must save its final checkpoint and exit 0, not fail every requeue."""
    faults = {"train.callbacks": "[megatron_lev.testing.faults:FaultInjection]"}
    res = train(
        overrides(data, run_copy, **{"train.train_iters": 5, "train.save_interval": 0, **faults}),
        MEGATRON_LEV_INJECT_NAN_AT_STEP="5",
    )
    expect_ok(res)
    assert re.search(r"iteration 5: non-finite loss .*update skipped", res.err), res.err[-3000:]
    assert (run_copy / "ckpt" / "latest").read_text().strip() == ck.tag_for(5)
    assert ck.verify_checkpoint(run_copy / "ckpt" / ck.tag_for(5)) == []


def test_every_checkpoint_damaged_exits_with_one_line(run_copy, data):
    flip(run_copy / "ckpt" / IT4 / MODEL)
    truncate(run_copy / "ckpt" / IT2 / OPTIM)
    before = snapshot(run_copy / "ckpt")
    res = train(overrides(data, run_copy))
    expect_error(res, r"no usable checkpoint under .*ckpt", "iter_0000004, iter_0000002", "restore", rc=1)
    assert snapshot(run_copy / "ckpt") == before


# --------------------------------------------------------- a fresh start never destroys what it did not write


def _unmarked(root: Path) -> None:
    d = root / IT4
    d.mkdir(parents=True)
    (d / MODEL).write_bytes(b"weights someone trained")


def _deepspeed_dir(root: Path) -> None:
    (root / "global_step100").mkdir(parents=True)
    (root / "global_step100" / MODEL).write_bytes(b"w")
    (root / "latest").write_text("global_step100")


def _foreign_file(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("mine")


def _latest_only(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "latest").write_text(IT4)


def _our_partial(root: Path) -> None:
    d = root / IT2
    d.mkdir(parents=True)
    (d / ck.STARTED_MARKER).write_text("{}")
    (d / MODEL).write_bytes(b"half")
    for name in ENGINE_FILES:
        (root / name).write_text("# helper")
    (root / f".latest{TEMP_MARK}123").write_text("x")


def _half_created(*temps: str):
    """A tag directory a save of ours created and was killed in before its `started` marker: empty, or
    holding the marker's half-written temp (`temps`: `<host>-<pid>` of its writer)."""

    def prepare(root: Path) -> None:
        d = root / IT2
        d.mkdir(parents=True)
        for tag in temps:
            (d / f".{ck.STARTED_MARKER}{TEMP_MARK}{tag}").write_text('{"itera')

    return prepare


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _host_tag() -> str:
    from megatron_lev.utils.io import temp_tag

    return temp_tag().rsplit("-", 1)[0]


FRESH = [
    pytest.param(
        _unmarked,
        r"iter_0000004/ \(no 'complete' marker, not written by this trainer\)",
        id="unmarked-iter-dir",
    ),
    pytest.param(_deepspeed_dir, r"global_step100/", id="deepspeed-global-step-dir"),
    pytest.param(_foreign_file, r"notes\.txt", id="foreign-file"),
    pytest.param(
        _latest_only,
        r"latest \(names iter_0000004, which is not a usable checkpoint\)",
        id="latest-without-checkpoints",
    ),
    pytest.param(_our_partial, None, id="own-interrupted-first-save-is-fine"),
    pytest.param(_half_created(), None, id="own-half-created-tag-dir-empty-is-fine"),
    pytest.param(
        lambda root: _half_created(f"{_host_tag()}-{_dead_pid()}")(root),
        None,
        id="own-half-created-tag-dir-with-dead-started-temp-is-fine",
    ),
    pytest.param(
        _half_created("node17-4242"),
        None,
        id="own-half-created-tag-dir-with-other-hosts-started-temp-is-fine",
    ),
    pytest.param(
        _half_created(f"{_host_tag()}-1"),  # pid 1 is alive: a writer of this host is still at it
        r"iter_0000002/ \(no 'complete' marker, not written by this trainer\)",
        id="tag-dir-with-a-live-writers-temp-is-not-taken-over",
    ),
    pytest.param(lambda root: root.mkdir(parents=True), None, id="empty-dir-is-fine"),
]


@pytest.mark.parametrize("prepare, pattern", FRESH)
def test_fresh_start_refuses_a_directory_it_did_not_write(tmp_path, prepare, pattern):
    save = tmp_path / "ckpt"
    prepare(save)
    before = snapshot(save)
    if pattern is None:
        assert resume.choose_start(save, save, engine_files=ENGINE_FILES) == resume.StartPoint(None, None)
    else:
        with pytest.raises(CheckpointDataError) as err:
            resume.choose_start(save, save, engine_files=ENGINE_FILES)
        msg = str(err.value)
        assert re.search(pattern, msg) and f"train.save={save}" in msg and "move them" in msg, msg
        assert snapshot(save) == before


def test_prune_never_removes_unmarked_directories(tmp_path):
    root = tmp_path / "ckpt"
    _unmarked(root)  # iter_0000004 without markers
    for it in (6, 8, 10):
        d = root / ck.tag_for(it)
        d.mkdir()
        (d / ck.STARTED_MARKER).write_text("{}")
        (d / ck.COMPLETE_MARKER).write_text("{}")
    assert ck.prune_checkpoints(root, keep_last=1) == [ck.tag_for(6), ck.tag_for(8)]
    assert (root / IT4 / MODEL).read_bytes() == b"weights someone trained"


class StubEngine:
    """Writes one small file per rank where DeepSpeed would write its model and optimizer files."""

    def save(self, root, tag, client_state):
        rank = ranks.rank()
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / f"stub_rank{rank}.pt").write_bytes(f"weights of rank {rank}".encode())


def _our_checkpoint(root: Path, it: int, complete: bool = True) -> None:
    d = root / ck.tag_for(it)
    d.mkdir(parents=True)
    (d / ck.STARTED_MARKER).write_text("{}")
    (d / MODEL).write_bytes(b"w")
    if complete:
        (d / ck.COMPLETE_MARKER).write_text(json.dumps({"iteration": it, "files": {}}))


PRUNE = [
    # complete tags on disk, partial tags, `latest` before the save, iteration saved, keep_last, tags left
    pytest.param((100, 200, 300), (), 300, 400, 2, (300, 400), id="ordinary-save"),
    pytest.param((100, 200, 300), (), 200, 250, 1, (250, 300), id="resumed-below-damaged-newest"),
    pytest.param((100, 200, 300), (), 200, 210, 2, (200, 210, 300), id="latest-rolled-back"),
    pytest.param((100, 200, 300), (350,), 200, 250, 1, (250, 300, 350), id="abandoned-partial-kept"),
    pytest.param((100, 200), (150,), 200, 300, 1, (300,), id="old-partial-pruned"),
]


@pytest.mark.parametrize("complete, partial, latest, saved, keep_last, left", PRUNE)
def test_prune_keeps_the_save_and_what_latest_names(
    tmp_path, caplog, complete, partial, latest, saved, keep_last, left
):
    """Tags above the iteration just saved belong to a branch the run abandoned when it resumed from
    an older tag: they are kept but never outrank the run's new saves in keep_last."""
    root = tmp_path / "ckpt"
    for it in complete:
        _our_checkpoint(root, it)
    for it in partial:
        _our_checkpoint(root, it, complete=False)
    (root / "latest").write_text(ck.tag_for(latest) + "\n")
    caplog.set_level("WARNING", logger="megatron_lev")
    ckio.save_checkpoint(StubEngine(), root, saved, {}, keep_last=keep_last)
    assert sorted(c.iteration for c in ck.list_checkpoints(root)) == list(left)
    assert ck.read_latest(root)[0] == ck.tag_for(saved)
    assert ck.verify_checkpoint(root / ck.tag_for(saved)) == []
    ahead = [ck.tag_for(it) for it in (*complete, *partial) if it > saved]
    if ahead:
        assert re.search(
            rf"{', '.join(ahead)} under .* newer than {ck.tag_for(saved)}.*rm -r", caplog.text
        ), caplog.text
    else:
        assert "newer than" not in caplog.text


def test_prune_without_a_save_keeps_what_latest_names(tmp_path):
    root = tmp_path / "ckpt"
    for it in (100, 200, 300):
        _our_checkpoint(root, it)
    (root / "latest").write_text(ck.tag_for(100))
    assert ck.prune_checkpoints(root, keep_last=1) == [ck.tag_for(200)]


# ----------------------------------------------------------------- a failure on one rank raises on every rank


def _fail_on(rank: int, name: str, err: int):
    """A replacement for ckio.atomic_write_json that raises OSError(err) on `rank` for files named `name`."""
    real = ckio.atomic_write_json

    def write(path, obj):
        if ranks.rank() == rank and Path(path).name == name:
            raise OSError(err, os.strerror(err), str(path))
        return real(path, obj)

    return write


def _unreadable_on(rank: int):
    real = ck.sha256_file

    def digest(path):
        if ranks.rank() == rank:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real(path)

    return digest


RANK_FAULTS = {  # case -> (what to break, on which operation)
    "foreign-directory-seen-by-rank0": ("foreign", "save"),
    "started-marker-disk-full-on-rank0": ("started", "save"),
    "complete-marker-unwritable-on-rank0": ("complete", "save"),
    "checksum-unreadable-on-rank1": ("checksum", "save"),
    "verify-unreadable-on-rank1": ("checksum", "verify"),
}


def _rank_fault_suite(work: str) -> dict:
    """Every rank: run each fault case; record what this rank raised (or returned)."""
    out = {}
    for case, (fault, op) in RANK_FAULTS.items():
        root = Path(work) / case
        saved = (ckio.atomic_write_json, ck.sha256_file)
        if fault == "foreign" and ranks.rank() == 0:
            _unmarked(root)
        if op == "verify":
            ckio.save_checkpoint(StubEngine(), root, 4, {}, keep_last=2)
        ranks.barrier()
        if fault == "started":
            ckio.atomic_write_json = _fail_on(0, ck.STARTED_MARKER, errno.ENOSPC)
        elif fault == "complete":
            ckio.atomic_write_json = _fail_on(0, ck.COMPLETE_MARKER, errno.EIO)
        elif fault == "checksum":
            ck.sha256_file = _unreadable_on(1)
        try:
            if op == "verify":
                out[case] = {"returned": ck.verify_checkpoint(root / IT4)}
            else:
                ckio.save_checkpoint(StubEngine(), root, 4, {}, keep_last=2)
                out[case] = {"returned": None}
        except Exception as exc:  # noqa: BLE001 - the case checks what each rank raised
            out[case] = {"raised": type(exc).__name__, "message": str(exc)}
        finally:
            ckio.atomic_write_json, ck.sha256_file = saved
    return out


@pytest.fixture(scope="module")
def rank_faults(tmp_path_factory):
    work = tmp_path_factory.mktemp("rank-faults")
    try:
        return run_distributed(_rank_fault_suite, world_size=2, args=(str(work),), timeout=90)
    except DistributedTestError as exc:
        return str(exc)[-3000:]


RANK_FAULT_EXPECTED = [
    # case, exception every rank must raise (None: returned), regex of every rank's message
    pytest.param(
        "foreign-directory-seen-by-rank0",
        {"CheckpointDataError"},
        r"not written by this trainer",
        id="foreign-directory-seen-by-rank0",
    ),
    pytest.param(
        "started-marker-disk-full-on-rank0",
        {"DiskFullError"},
        r"no space left on the device",
        id="started-marker-disk-full-on-rank0",
    ),
    pytest.param(
        "complete-marker-unwritable-on-rank0",
        {"OSError", "RuntimeError"},
        r"Input/output error",
        id="complete-marker-unwritable-on-rank0",
    ),
    pytest.param(
        "checksum-unreadable-on-rank1",
        {"CheckpointDataError"},
        r"cannot checksum .*Input/output error",
        id="checksum-unreadable-on-rank1",
    ),
    pytest.param(
        "verify-unreadable-on-rank1",
        None,
        r"is unreadable \(.*Input/output error",
        id="verify-unreadable-on-rank1",
    ),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, raised, pattern", RANK_FAULT_EXPECTED)
def test_failure_on_one_rank_raises_on_every_rank(rank_faults, case, raised, pattern):
    """Two gloo ranks: a save step that fails on one rank used to leave the other in a barrier."""
    if isinstance(rank_faults, str):
        pytest.fail(f"the two-rank fault suite hung or crashed: {rank_faults}")
    results = [r[case] for r in rank_faults]
    if raised is None:
        assert results[0] == results[1] and results[0]["returned"], results
        assert all(re.search(pattern, line) for line in results[0]["returned"][:1]), results
        return
    for rank, r in enumerate(results):
        assert r.get("raised") in raised and re.search(pattern, r["message"]), (rank, r)


def test_fresh_start_into_unmarked_checkpoints_exits_before_training(data, tmp_path):
    out = tmp_path / "run"
    _unmarked(out / "ckpt")
    before = snapshot(out / "ckpt")
    res = train(overrides(data, out))
    expect_error(res, rf"train.save={out / 'ckpt'}", r"iter_0000004/", "move them", rc=1)
    assert snapshot(out / "ckpt") == before
    assert not (out / "metrics.jsonl").exists()


def test_explicit_load_without_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointDataError, match=r"train.load=.*nowhere holds no complete checkpoint"):
        resume.choose_start(tmp_path / "nowhere", tmp_path / "ckpt")


SAME_DIR = [  # how train.load spells the directory train.save names (absolute)
    pytest.param(lambda tmp: "ckpt", id="load-relative"),
    pytest.param(lambda tmp: "./sub/../ckpt/", id="load-relative-with-dots"),
    pytest.param(lambda tmp: (tmp / "link").symlink_to(tmp / "ckpt") or tmp / "link", id="load-via-symlink"),
]


@pytest.mark.parametrize("spell", SAME_DIR)
def test_load_and_save_naming_one_directory_are_the_same(tmp_path, monkeypatch, spell):
    """train.load and train.save spelled differently but naming one empty directory: a fresh start,
    not "train.load holds no complete checkpoint"."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resume.choose_start(spell(tmp_path), tmp_path / "ckpt") == resume.StartPoint(None, None)


# ------------------------------------------------------------------ config differences on resume


CONFIG_DIFFS = [
    # override, allowed via --allow-change, expected: None (allowed) or regex of the refusal
    pytest.param({"model.hidden_size": 64}, (), r"model.hidden_size differ.*weights", id="model-width"),
    pytest.param({"model.embedding": "tied"}, (), r"model.embedding differ", id="model-embedding"),
    pytest.param(
        {"model.rope_theta": 500000.0},
        ("model.rope_theta",),
        r"model.rope_theta differ",
        id="model-change-cannot-be-allowed",
    ),
    pytest.param({"train.precision": "bf16"}, (), r"train.precision differ", id="precision"),
    pytest.param({"parallel.zero_stage": 2}, (), r"parallel.zero_stage differ.*reshard", id="zero-stage"),
    pytest.param(
        {"train.seed": 7}, (), r"resume exactly.*train.seed.*--allow-change train.seed", id="train-seed"
    ),
    pytest.param({"data.seed": 7}, (), r"data.seed", id="data-seed"),
    pytest.param({"data.split": "90,10,0"}, (), r"data.split", id="data-split"),
    pytest.param({"train.lr": 1e-3}, (), r"train.lr differ", id="lr-refused"),
    pytest.param({"train.lr": 1e-3}, ("train.lr",), None, id="lr-allowed-by-flag"),
    pytest.param({"train.micro_batch_size": 4}, (), r"train.micro_batch_size", id="batch-size"),
    pytest.param({"train.train_iters": 40}, (), None, id="train-iters-allowed"),
    pytest.param({"train.save_interval": 7, "train.keep_last": 5}, (), None, id="save-interval-allowed"),
    pytest.param({"logging.log_interval": 5, "logging.tensorboard": True}, (), None, id="logging-allowed"),
    pytest.param({"model.activation_checkpointing": True}, (), None, id="activation-checkpointing-allowed"),
    pytest.param(
        {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}, (), None, id="dropout-allowed"
    ),
    pytest.param(
        {"model.init_std": 0.01, "model.lev.w_out_init_scale": 0.5}, (), None, id="init-scales-allowed"
    ),
    pytest.param(
        {"model.seq_length": 64},
        (),
        r"resume exactly.*model.seq_length.*--allow-change model.seq_length",
        id="seq-length-refused-without-flag",
    ),
    pytest.param({"model.seq_length": 64}, ("model.seq_length",), None, id="seq-length-allowed-by-flag"),
    pytest.param(
        {"model.num_layers": 3},
        ("model.num_layers",),
        r"model.num_layers differ.*weights",
        id="model-depth-cannot-be-allowed",
    ),
]


@pytest.mark.parametrize("change, allow, refusal", CONFIG_DIFFS)
def test_config_differences_on_resume(run_copy, data, caplog, change, allow, refusal):
    from megatron_lev.config import load_config

    ckpt = run_copy / "ckpt"
    cfg = load_config([TINY], overrides(data, run_copy, **change), validate=False)
    caplog.set_level("WARNING", logger="megatron_lev")
    if refusal is None:
        assert resume.choose_start(ckpt, ckpt, cfg, allow) == resume.StartPoint(ckpt, IT4)
    else:
        with pytest.raises(CheckpointDataError) as err:
            resume.choose_start(ckpt, ckpt, cfg, allow)
        assert re.search(refusal, str(err.value)), str(err.value)
        assert "\n" not in str(err.value)
    for key, value in change.items():  # every difference is printed, with its verdict
        assert re.search(
            rf"{re.escape(key)}: .* -> {re.escape(repr(value))} \((allowed|refused)", caplog.text
        ), caplog.text


def test_model_change_on_resume_exits_with_the_differences(run_copy, data):
    before = snapshot(run_copy / "ckpt")
    res = train(overrides(data, run_copy, **{"model.hidden_size": 64, "train.train_iters": 8}))
    expect_error(res, r"cannot resume from .*iter_0000004", "model.hidden_size", rc=1)
    assert (
        "model.hidden_size: 32 -> 64 (refused" in res.err and "train.train_iters: 4 -> 8 (allowed)" in res.err
    )
    assert snapshot(run_copy / "ckpt") == before


# ------------------------------------------------------------------ code in checkpoint files is never run


class _Payload:
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_rng_file_round_trips_with_weights_only(tmp_path):
    import random

    import numpy as np
    import torch

    from megatron_lev.utils.io import atomic_save_torch

    atomic_save_torch(ckio.capture_rng_state(), tmp_path / RNG)
    a = (random.random(), np.random.rand(), torch.rand(2))
    ckio.restore_rng_state(ckio.load_rng_file(tmp_path / RNG))
    b = (random.random(), np.random.rand(), torch.rand(2))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.mark.parametrize(
    "reseal",
    [
        pytest.param(True, id="payload-with-matching-checksum"),
        pytest.param(False, id="payload-caught-by-checksum"),
    ],
)
def test_pickle_payload_in_rng_file_is_refused_not_run(run_copy, tmp_path, reseal):
    import torch

    target = tmp_path / "pwned"
    tag_dir = run_copy / "ckpt" / IT4
    torch.save({"python": _Payload(target), "numpy": 0, "torch": 0}, tag_dir / RNG)
    if reseal:  # whoever can write the file can rewrite the marker too
        digest = hashlib.sha256((tag_dir / RNG).read_bytes()).hexdigest()
        edit_marker(
            tag_dir,
            lambda d: d["files"].update({RNG: {"size": (tag_dir / RNG).stat().st_size, "sha256": digest}}),
        )
        assert ck.verify_checkpoint(tag_dir) == []
        with pytest.raises(
            CheckpointDataError, match=rf"{RNG} is not a plain tensor file \(refused to unpickle"
        ):
            ckio.load_rng_file(tag_dir / RNG)
    else:
        assert resume.choose_start(run_copy / "ckpt", run_copy / "ckpt").tag == IT2
    assert not target.exists(), "the payload ran"


def test_plain_pickle_in_rng_file_is_refused(tmp_path):
    target = tmp_path / "pwned"
    (tmp_path / RNG).write_bytes(pickle.dumps(_Payload(target), protocol=2))
    with pytest.raises(CheckpointDataError, match="refused to unpickle"):
        ckio.load_rng_file(tmp_path / RNG)
    assert not target.exists()


# ------------------------------------------------------------------ preemption at start-up


@pytest.mark.parametrize(
    "sig, delay",
    [
        pytest.param(signal.SIGTERM, 0.2, id="sigterm-during-imports"),
        pytest.param(signal.SIGUSR1, 0.6, id="sigusr1-during-imports"),
        pytest.param(signal.SIGTERM, 1.5, id="sigterm-later-in-start-up"),
    ],
)
def test_signal_during_start_up_exits_75(data, tmp_path, sig, delay):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_lev", "train", "--config", str(TINY), *overrides(data, out)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    time.sleep(delay)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the trainer did not exit after a preemption signal")
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err
    assert re.search(r"preempted.*(before the first step|exiting with status 75)", err.splitlines()[-1]), err[
        -2000:
    ]
    assert not list((out / "ckpt").glob("iter_*")), "nothing may be saved before the first step"


def _run_script(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [str(ROOT / "scripts" / "torchrun_local.sh"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.multiprocess
def test_torchrun_local_passes_the_ranks_75_through(data, tmp_path):
    """Slurm signals every process of the step: script, torchrun and ranks get SIGUSR1 mid-run.
    torchrun reports the ranks' 75 as 1; the script must exit 75, with a complete checkpoint."""
    out = tmp_path / "run"
    env = _env(NPROC="2")
    proc = _run_script(
        [
            "--config",
            str(TINY),
            *overrides(data, out, **{"train.train_iters": 2000, "train.save_interval": 0}),
        ],
        env,
    )
    deadline = time.monotonic() + 150
    while not ((out / "metrics.jsonl").exists() and 'iteration": 3' in (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("training did not start")
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGUSR1)
    try:
        log, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun did not stop after SIGUSR1")
    assert proc.returncode == 75, log[-4000:]
    assert "[torchrun_local] preempted: exiting with status 75" in log
    tag = (out / "ckpt" / "latest").read_text().strip()
    assert ck.verify_checkpoint(out / "ckpt" / tag) == []
    assert {RNG, "rng_state_rank1.pt"} <= set(ck.read_marker(out / "ckpt" / tag)["files"])
    assert not leftover_processes(str(out))


def test_torchrun_local_rank_killed_at_start_up_is_a_failure(tmp_path):
    """A rank killed by SIGKILL (out of memory, a crash) writes no status; torchrun then stops its
    siblings, which report 75 from the start-up handler. Nobody preempted the job: not 75."""
    env = {
        **_env(NPROC="2", ENTRY="-m tests.reliability.rank_crash_probe", TMPDIR=str(tmp_path)),
        "PET_SHUTDOWN_TIMEOUT": "10",
    }
    proc = _run_script(["--go"], env)
    try:
        log, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun_local.sh did not exit after a rank was killed")
    assert proc.returncode not in (0, 75), log[-3000:]
    assert "preempted (SIGTERM) during start-up" in log, "the sibling was not stopped during start-up"
    assert "[torchrun_local] preempted" not in log, log[-3000:]


def test_torchrun_local_signal_during_start_up_exits_75(data, tmp_path):
    out = tmp_path / "run"
    proc = _run_script(["--config", str(TINY), *overrides(data, out)], _env(NPROC="2"))
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)  # to the script only: it forwards to torchrun
    try:
        log, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun_local.sh did not exit after SIGTERM")
    assert proc.returncode == 75, log[-3000:]
    assert not leftover_processes(str(out))


# ------------------------------------------------------------------ disk full during a save


_ENOSPC_DRIVER = """
import errno, sys
from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine as m
orig = m.TorchCheckpointEngine.save
def save(self, state, path):
    if "iter_0000004" in str(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return orig(self, state, path)
m.TorchCheckpointEngine.save = save
from megatron_lev.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _small_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir(parents=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_disk_full_during_save_names_the_path_and_keeps_the_previous(data, tmp_path):
    """A 34 MiB tmpfs holds the first checkpoint (26 MiB) but not the second; without root the
    child process's DeepSpeed writer raises ENOSPC for the second instead."""
    disk = tmp_path / "disk"
    real = _small_tmpfs(disk, "34m")
    try:
        out = tmp_path / "run"
        over = overrides(data, out, **{"train.save": str(disk / "ckpt")})
        if real:
            res = train(over)
        else:
            disk.mkdir(exist_ok=True)
            cmd = [sys.executable, "-c", _ENOSPC_DRIVER, "train", "--config", str(TINY), *over]
            p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
            from tests.reliability.harness import Outcome

            res = Outcome(p.returncode, p.stdout, p.stderr)
        expect_error(
            res,
            r"saving checkpoint .*ckpt/iter_0000004 failed: no space left on the device",
            rf"{disk / 'ckpt' / IT2} and .*latest are unchanged",
            rc=1,
        )
        ckpt = disk / "ckpt"
        assert (ckpt / "latest").read_text().strip() == IT2
        assert ck.verify_checkpoint(ckpt / IT2) == []
        assert not (ckpt / IT4 / ck.COMPLETE_MARKER).exists()
        assert resume.choose_start(ckpt, ckpt).tag == IT2
        assert not [p for p in ckpt.rglob("*") if TEMP_MARK in p.name]
    finally:
        if real:
            subprocess.run(["umount", str(disk)], capture_output=True)


def test_disk_full_is_recognised_from_the_errno_chain(tmp_path):
    exc = RuntimeError("unexpected pos 576 vs 534")
    exc.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert ckio._disk_full(exc, tmp_path)
    assert not ckio._disk_full(RuntimeError("a bug"), tmp_path)


def test_resuming_from_train_load_refuses_a_foreign_save_directory(run_copy, tmp_path):
    save = tmp_path / "new-save"
    _unmarked(save)
    with pytest.raises(CheckpointDataError, match=rf"train.save={save} already holds iter_0000004/"):
        resume.choose_start(run_copy / "ckpt", save)
    assert resume.choose_start(run_copy / "ckpt", tmp_path / "empty-save") == resume.StartPoint(
        run_copy / "ckpt", IT4
    )


def test_save_never_overwrites_a_directory_it_did_not_write(tmp_path):
    root = tmp_path / "ckpt"
    _unmarked(root)

    class NoEngine:  # the guard runs before DeepSpeed is asked to write anything
        def save(self, *a, **k):
            raise AssertionError("DeepSpeed must not be called")

    with pytest.raises(CheckpointDataError, match=r"iter_0000004 exists and was not written by this trainer"):
        ckio.save_checkpoint(NoEngine(), root, 4, {}, keep_last=2)
    assert (root / IT4 / MODEL).read_bytes() == b"weights someone trained"


# ------------------------------------------------------------------ a kill at every step of a save

KILL = "[megatron_lev.testing.faults:SaveKill]"
_BEFORE_COMPLETE = SAVE_POINTS[: SAVE_POINTS.index("complete")]
KILL_POINTS = [  # (iteration whose save is killed, the step): every step of the second save, whose
    # rerun resumes from iteration 2, and the steps of the first save a fresh start must take over
    *[pytest.param(4, point, id=f"second-save-{point}") for point in SAVE_POINTS],
    *[
        pytest.param(2, point, id=f"first-save-{point}")
        for point in ("dir", "started.tmp", "engine", "complete")
    ],
]


@pytest.mark.parametrize("iteration, point", KILL_POINTS)
def test_sigkill_at_every_step_of_a_save_resumes_on_rerun(trained, data, tmp_path, iteration, point):
    """A real run SIGKILLed at one step of a checkpoint save (`testing.faults.SaveKill`), then the
    same command again (a requeue): it must resume from the newest complete checkpoint, take over
    what the killed save left, end with the same weights as a run never killed, and leave no temp
    file behind."""
    out = tmp_path / "run"
    over = overrides(data, out, **{"train.callbacks": KILL})
    killed = train(over, MEGATRON_LEV_KILL_SAVE=f"{iteration}:{point}")
    assert killed.rc == -signal.SIGKILL, killed.err[-3000:]
    assert f"SIGKILL at save point {point}" in killed.err, killed.err[-3000:]
    ckpt, tag = out / "ckpt", ck.tag_for(iteration)
    assert (ckpt / tag).is_dir()
    assert (ckpt / tag / ck.COMPLETE_MARKER).exists() == (point not in _BEFORE_COMPLETE)

    res = train(over)
    expect_ok(res)
    if iteration == 4 and point in ("latest", "pruned"):
        resumed = IT4
    elif iteration == 4 or point == "complete":
        resumed = IT2
    else:
        resumed = None
    if resumed is None:
        assert "starting from scratch" in res.err, res.err[-3000:]
    else:
        assert f"resumed from {ckpt / resumed}" in res.err, res.err[-3000:]
    assert "not written by this trainer" not in res.err
    assert (ckpt / "latest").read_text().strip() == IT4
    assert [c.tag for c in ck.list_checkpoints(ckpt)] == [IT2, IT4]
    assert ck.verify_checkpoint(ckpt / IT2) == [] and ck.verify_checkpoint(ckpt / IT4) == []
    assert not [p for p in ckpt.rglob("*") if TEMP_MARK in p.name], sorted(ckpt.rglob("*"))
    got = torch.load(ckpt / IT4 / MODEL, map_location="cpu", weights_only=False)["module"]
    want = torch.load(trained / "ckpt" / IT4 / MODEL, map_location="cpu", weights_only=False)["module"]
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_cuda_rng_saved_on_eight_gpus_restores_on_a_task_that_sees_one(tmp_path, monkeypatch):
    """A save records this rank's CUDA generator only, and a checkpoint of the earlier format (every
    visible device's state) restores on a task that sees fewer GPUs: the current device's entry.
    Before, `set_rng_state_all` with 8 states on 1 visible GPU failed the resume. No GPU here: torch's
    CUDA generator calls are replaced by a recorder of what the code asks of them."""
    import torch

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": torch.full((8,), 5, dtype=torch.uint8)
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": calls.__setitem__("set", state)
    )

    def one_device_only(states):
        if len(states) != 1:
            raise RuntimeError(f"{len(states)} states for 1 visible device")

    monkeypatch.setattr(torch.cuda, "set_rng_state_all", one_device_only)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(8, dtype=torch.uint8)] * 8)
    captured = ckio.capture_rng_state()
    assert torch.equal(captured["cuda"], torch.full((8,), 5, dtype=torch.uint8))  # one state, not a list
    old_format = {**captured, "cuda": [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]}
    ckio.restore_rng_state(old_format)  # 8 saved, 1 visible: the current device's (0) is taken
    assert torch.equal(calls["set"], torch.zeros(8, dtype=torch.uint8))
    ckio.restore_rng_state(captured)
    assert torch.equal(calls["set"], torch.full((8,), 5, dtype=torch.uint8))


def test_torchrun_local_passes_a_skip_limit_stop_through_as_3(data, tmp_path):
    """Both ranks stop at the skip limit (status 3); torchrun reports 1, the script passes the ranks'
    common status through (before, 3 became 1). A crash of one rank stays a failure (its own test)."""
    out = tmp_path / "run"
    env = _env(NPROC="2", MEGATRON_LEV_INJECT_NAN_AT_STEP="2,3")
    extra = {
        "train.train_iters": 6,
        "train.max_consecutive_skips": 2,
        "train.callbacks": "[megatron_lev.testing.faults:FaultInjection]",
    }
    proc = _run_script(["--config", str(TINY), *overrides(data, out, **extra)], env)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, log[-4000:]
    assert "[torchrun_local] every rank exited with status 3" in log
