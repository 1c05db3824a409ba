"""`train.async_save`: a save returns once every rank's files are written, and rank 0 completes it (the
checksums into `complete`, `latest`, pruning) on a background thread. Until then the tag is not read; a
completion that fails raises on every rank at the next wait; training with it gives the same numbers
and the same complete checkpoints as saving synchronously."""

from __future__ import annotations

import errno
import threading
from concurrent.futures import ThreadPoolExecutor

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
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = ckio.begin_save(StubEngine(), root, 4, {}, keep_last=2, background=pool)
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
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = ckio.begin_save(StubEngine(), root, 4, {}, keep_last=2, background=pool)
        release.set()
        with pytest.raises(CheckpointDataError, match=r"cannot checksum the files of .*iter_0000004"):
            pending.wait()  # the error a synchronous save raises
    assert not (root / ck.tag_for(4) / ck.COMPLETE_MARKER).exists()
    assert ck.resume_candidates(root)[0] == [ck.tag_for(2)]


def test_shares_left_by_a_killed_completion_are_not_merged_into_the_tag_saved_again(tmp_path):
    root = tmp_path / "ckpt"
    tag = root / ck.tag_for(4)
    tag.mkdir(parents=True)
    (tag / ck.STARTED_MARKER).write_text("{}")  # a save of iteration 4 was killed mid-completion
    for rank in (0, 1):  # a two-rank run's shares; a rerun's rank 0 could read a stale peer's
        (tag / f"checksums-rank{rank}.json").write_text('{"files": [["stub_rank0.pt", 1, "0"]]}')
    with ThreadPoolExecutor(max_workers=1) as pool:
        ckio.begin_save(StubEngine(), root, 4, {}, keep_last=2, background=pool).wait()
    assert ck.verify_checkpoint(tag) == []  # the new save's own checksums
    assert not list(tag.glob("checksums-rank*"))
    assert "checksums-rank0.json" not in ck.checkpoint_files(tag)


def _two_ranks_background(root: str, failing_rank: int | None):
    import torch.distributed as dist

    from megatron_lev.ckpt import io as ckio
    from megatron_lev.ckpt import layout as ck
    from tests.reliability.test_checkpoint import StubEngine

    if dist.get_rank() == failing_rank:
        ck.sha256_file = _fails  # this rank cannot read its share of the files
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = ckio.begin_save(StubEngine(), root, 6, {}, keep_last=2, background=pool)
        try:
            pending.wait()  # collective
        except Exception as exc:  # noqa: BLE001 - returned for the test to compare
            return f"{type(exc).__name__}: {exc}"
    return "ok"


def _fails(path):
    raise OSError(errno.EIO, "Input/output error")


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
