"""`train.async_save`: a save returns once every rank's files are written; every rank checksums its share
on a background thread and rank 0 merges the shares into `complete`, points `latest` and prunes. Until
then the tag is not read; a share or a merge that fails raises on every rank at the next wait (a share
that never comes stops rank 0's merge); after an exception the save is abandoned without a collective.
(Training with it: `tests/training/test_async_save.py`.)"""

from __future__ import annotations

import errno
import json
import threading

import pytest

from megatron_lev.ckpt import io as ckio
from megatron_lev.ckpt import layout as ck
from megatron_lev.errors import CheckpointDataError
from megatron_lev.testing.distributed import run_distributed
from tests.reliability.test_checkpoint import StubEngine


def _held_checksums(monkeypatch, release: threading.Event, failure: OSError | None = None):
    """Make reading a file for its checksum wait for `release` (then fail with `failure`, if given)."""
    real = ck.sha256_file

    def held(path):
        assert release.wait(60), "the test never released the completion"
        if failure is not None:
            raise failure
        return real(path)

    monkeypatch.setattr(ck, "sha256_file", held)


def test_a_save_completing_in_the_background_is_not_read_until_it_completes(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    ckio.save_checkpoint(StubEngine(), root, 2, {}, keep_last=2)  # the healthy twin: complete at once
    assert ck.read_latest(root)[0] == ck.tag_for(2)
    release = threading.Event()
    _held_checksums(monkeypatch, release)
    pending = ckio.begin_save(StubEngine(), root, 4, {}, keep_last=2, background=True)
    assert not pending.done()  # the caller is back before the checksums ran
    assert (root / ck.tag_for(4) / "stub_rank0.pt").is_file()  # the files are written
    assert not (root / ck.tag_for(4) / ck.COMPLETE_MARKER).exists()
    assert ck.read_latest(root)[0] == ck.tag_for(2)
    tags, notes = ck.resume_candidates(root)
    assert tags == [ck.tag_for(2)] and "iter_0000004" in notes[0]  # a resume now takes iteration 2
    release.set()
    assert pending.wait() == root / ck.tag_for(4)
    assert ck.read_latest(root)[0] == ck.tag_for(4)
    assert ck.verify_checkpoint(root / ck.tag_for(4)) == []
    assert ck.resume_candidates(root)[0] == [ck.tag_for(4), ck.tag_for(2)]


def test_a_failed_background_completion_raises_at_the_wait_and_leaves_the_tag_incomplete(
    tmp_path, monkeypatch
):
    root = tmp_path / "ckpt"
    ckio.save_checkpoint(StubEngine(), root, 2, {}, keep_last=2)
    release = threading.Event()
    _held_checksums(monkeypatch, release, OSError(errno.EIO, "Input/output error"))
    pending = ckio.begin_save(StubEngine(), root, 4, {}, keep_last=2, background=True)
    release.set()
    with pytest.raises(CheckpointDataError, match=r"cannot checksum the files of .*iter_0000004"):
        pending.wait()  # the error a synchronous save raises
    assert not (root / ck.tag_for(4) / ck.COMPLETE_MARKER).exists()
    assert ck.resume_candidates(root)[0] == [ck.tag_for(2)]


def test_an_abandoned_save_ends_without_waiting_for_a_share_that_never_comes(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    stop = threading.Event()
    ckio.save_checkpoint(StubEngine(), root, 2, {}, keep_last=2)
    (root / ck.tag_for(4)).mkdir()
    # rank 0 of a two-rank save whose peer died: rank 1's share never comes
    finish = ckio._in_thread(
        "complete", ckio._complete_in_background, root, root / ck.tag_for(4), 4, 2, [], 2, 0.0, stop
    )
    ckio._checksum_share(root / ck.tag_for(4), [], 0, 2)
    assert not finish.done()
    stop.set()  # what `PendingSave.abandon` and a failed share at `wait` do
    with pytest.raises(CheckpointDataError, match="left incomplete"):
        finish.result(timeout=5)
    assert not (root / ck.tag_for(4) / ck.COMPLETE_MARKER).exists()
    assert ck.read_latest(root)[0] == ck.tag_for(2)


def test_a_share_listing_other_files_is_not_merged(tmp_path):
    root = tmp_path / "ckpt"
    tag = root / ck.tag_for(4)
    tag.mkdir(parents=True)
    (tag / "a.pt").write_bytes(b"a")
    (tag / "b.pt").write_bytes(b"b")
    stop = threading.Event()
    ckio._checksum_share(tag, ["a.pt", "b.pt"], 0, 2)
    ckio._checksum_share(tag, ["a.pt"], 1, 2)  # a rank that did not see b.pt yet
    with pytest.raises(CheckpointDataError, match="rank 1 listed other files than rank 0"):
        ckio._complete_in_background(root, tag, 4, 2, ["a.pt", "b.pt"], 2, 0.0, stop)
    assert not (tag / ck.COMPLETE_MARKER).exists()
    ckio._checksum_share(tag, ["a.pt", "b.pt"], 1, 2)  # the healthy twin: the same list
    ckio._complete_in_background(root, tag, 4, 2, ["a.pt", "b.pt"], 2, 0.0, stop)
    assert set(json.loads((tag / ck.COMPLETE_MARKER).read_text())["files"]) == {"a.pt", "b.pt"}


def test_shares_left_by_a_killed_completion_are_not_merged_into_the_tag_saved_again(tmp_path):
    root = tmp_path / "ckpt"
    tag = root / ck.tag_for(4)
    tag.mkdir(parents=True)
    (tag / ck.STARTED_MARKER).write_text("{}")  # a save of iteration 4 was killed mid-completion
    for rank in (0, 1):  # a two-rank run's shares; a rerun's rank 0 could read a stale peer's
        (tag / f"checksums-rank{rank}.json").write_text('{"files": [["stub_rank0.pt", 1, "0"]]}')
    ckio.begin_save(StubEngine(), root, 4, {}, keep_last=2, background=True).wait()
    assert ck.verify_checkpoint(tag) == []  # the new save's own checksums
    assert not list(tag.glob("checksums-rank*"))
    assert "checksums-rank0.json" not in ck.checkpoint_files(tag)


def _two_ranks_background(root: str, failing_rank: int | None, unwritable: bool = False):
    import torch.distributed as dist

    from megatron_lev.ckpt import io as ckio
    from megatron_lev.ckpt import layout as ck
    from tests.reliability.test_checkpoint import StubEngine

    if dist.get_rank() == failing_rank:
        if unwritable:
            ckio.atomic_write_json = _no_space_for_shares  # this rank cannot write its share
        else:
            ck.sha256_file = _fails  # this rank cannot read its share of the files
    pending = ckio.begin_save(StubEngine(), root, 6, {}, keep_last=2, background=True)
    try:
        pending.wait()  # collective
    except Exception as exc:  # noqa: BLE001 - returned for the test to compare
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _fails(path):
    raise OSError(errno.EIO, "Input/output error")


def _no_space_for_shares(path, data):
    from megatron_lev.utils.io import atomic_write_json

    if "checksums-rank" in str(path):
        raise OSError(errno.EIO, "Input/output error", str(path))
    atomic_write_json(path, data)


@pytest.mark.multiprocess
@pytest.mark.parametrize("failing", [0, 1])
def test_two_ranks_share_the_checksums_and_both_raise_when_one_cannot_read(tmp_path, failing):
    ok = run_distributed(_two_ranks_background, world_size=2, args=(str(tmp_path / "good"), None))
    assert ok == ["ok", "ok"]
    assert ck.verify_checkpoint(tmp_path / "good" / ck.tag_for(6)) == []
    assert sorted(p.name for p in (tmp_path / "good" / ck.tag_for(6)).glob("stub_rank*")) == [
        "stub_rank0.pt",
        "stub_rank1.pt",
    ]
    assert not list((tmp_path / "good" / ck.tag_for(6)).glob("checksums-rank*"))  # merged, then removed
    bad = run_distributed(_two_ranks_background, world_size=2, args=(str(tmp_path / "bad"), failing))
    assert all(r.startswith("CheckpointDataError: cannot checksum") for r in bad), bad
    assert all("Input/output error" in r for r in bad), bad
    assert not (tmp_path / "bad" / ck.tag_for(6) / ck.COMPLETE_MARKER).exists()


@pytest.mark.multiprocess
def test_a_peer_that_cannot_write_its_share_fails_the_wait_at_once_on_both_ranks(tmp_path):
    # rank 0's merge would wait for the share; the wait's first exchange stops it
    results = run_distributed(
        _two_ranks_background, world_size=2, args=(str(tmp_path / "ckpt"), 1, True), timeout=60
    )
    assert all("Input/output error" in r for r in results), results
    assert not (tmp_path / "ckpt" / ck.tag_for(6) / ck.COMPLETE_MARKER).exists()
