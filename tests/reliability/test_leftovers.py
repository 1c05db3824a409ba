"""What a killed or stopped run leaves behind, and the start that follows it.

- A SIGKILL inside checkpoint pruning (after the tag's markers are gone, before its data files) must
  not strand the tag: the next save or start removes what is left and says so, so `keep_last`
  bounds the disk.
- A run stopped at the skip limit (exit 3) and rerun with the same command exits 3 again, saying why,
  instead of 0 "completed".
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_lev.ckpt import layout as ck
from megatron_lev.training import resume
from tests.reliability.harness import ROOT
from tests.reliability.test_checkpoint import data  # noqa: F401 - the shared tiny corpus fixture

FAULTS = "[megatron_lev.testing.faults:FaultInjection]"

pytestmark = pytest.mark.timeout(300)


def _tag(root: Path, iteration: int, size: int = 1 << 16) -> Path:
    """A complete tag as a save leaves it (markers and data files; their content is not read here)."""
    path = root / ck.tag_for(iteration)
    path.mkdir(parents=True)
    (path / ck.STARTED_MARKER).write_text("{}")
    (path / ck.COMPLETE_MARKER).write_text("{}")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (path / name).write_bytes(os.urandom(size))
    return path


KILLED_PRUNE = textwrap.dedent(
    """
    import os, shutil, sys
    from pathlib import Path
    from megatron_lev.ckpt import layout as ck

    real = shutil.rmtree

    def killed(path, *args, **kwargs):  # the markers go first (os.scandir order is not ours to pick)
        path = Path(path)
        for marker in (ck.COMPLETE_MARKER, ck.STARTED_MARKER):
            (path / marker).unlink(missing_ok=True)
        os._exit(9)  # SIGKILL-like: no cleanup, no finally

    shutil.rmtree = killed
    ck.prune_checkpoints(sys.argv[1], keep_last=1, current=ck.tag_for(3))
    """
)


def test_a_prune_killed_part_way_strands_nothing(tmp_path, caplog):
    root = tmp_path / "ckpt"
    for it in (1, 2, 3):
        _tag(root, it)
    (root / ck.LATEST_FILE).write_text(ck.tag_for(3) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", KILLED_PRUNE, str(root)], env=env, capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()[-2000:]
    with caplog.at_level(logging.INFO):
        resume.choose_start(None, root)  # the next start (a start that resumes iter 3)
    stranded = [p.name for p in root.iterdir() if p.is_dir() and not (p / ck.COMPLETE_MARKER).exists()]
    assert stranded == [], stranded  # neither a tag without markers nor a trash directory
    assert "interrupted prune" in caplog.text  # and the start said what it removed
    ck.prune_checkpoints(root, keep_last=1, current=ck.tag_for(3))  # the next save's prune
    assert sorted(p.name for p in root.iterdir()) == [ck.tag_for(3), ck.LATEST_FILE]


# ---------------------------------------------------------------- a rerun after a skip-limit stop


def test_a_rerun_after_a_skip_limit_stop_stays_non_zero_and_says_why(data, tmp_path):  # noqa: F811
    """The run stops at the skip limit at its last iteration with a checkpoint of the last good weights
    (exit 3); the same command again has nothing left to train and must not exit 0 as completed."""
    from tests.reliability.harness import expect_error
    from tests.reliability.test_checkpoint import overrides, train

    over = overrides(data, tmp_path / "run", **{"train.callbacks": FAULTS, "train.max_consecutive_skips": 2})
    first = train(over, MEGATRON_LEV_INJECT_NAN_AT_STEP="3,4")
    assert first.rc == 3 and "stopped with a checkpoint of the last good weights" in first.err, first.err[
        -2000:
    ]
    again = train(over, MEGATRON_LEV_INJECT_NAN_AT_STEP="3,4")
    expect_error(again, "nothing left to train", "stopped at the skip limit", r"iteration 4", rc=3)


# ---------------------------------------------------------------- messages that name what they are about


def test_a_lock_path_that_is_a_directory_is_named():
    """Something made a directory where the save directory's lock file goes: one line naming it, not
    an IsADirectoryError traceback."""
    import tempfile

    from megatron_lev.errors import LockedError
    from megatron_lev.utils.lock import DIR_LOCK_NAME, exclusive_lock

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / DIR_LOCK_NAME
        path.mkdir()
        with pytest.raises(LockedError) as err:
            with exclusive_lock(path, f"train.save={tmp}", "megatron-lev train"):
                pass
        assert f"{path} is a directory" in str(err.value) and f"train.save={tmp}" in str(err.value)
        path.rmdir()
        with exclusive_lock(path, f"train.save={tmp}", "megatron-lev train"):  # the healthy twin
            assert path.is_file()


def test_a_prefix_re_preprocessed_into_shards_names_its_shards_not_a_missing_file(tmp_path):
    """`preprocess` run again into P with --shard-size-mb replaces P.bin/.idx by P_00000, ...: a run
    still given P is told the shards' prefixes, not to delete a P.bin that no longer exists."""
    import numpy as np

    from megatron_lev.data.indexed import IndexedDatasetBuilder
    from megatron_lev.data.manifest import ShardSetError, verify_shard_set, write_manifest

    prefix = tmp_path / "pile"
    shards = []
    for k in range(2):
        shard = tmp_path / f"pile_{k:05d}"
        b = IndexedDatasetBuilder(shard, np.uint16)
        b.add_document(np.arange(1, 50))
        b.finalize()
        shards.append(str(shard))
    fp = {"type": "hf", "name": "t", "file": "t.json", "sha256": "0" * 64, "vocab_size": 100, "eod": 0}
    write_manifest(prefix, shards, fp, 49)
    with pytest.raises(ShardSetError) as err:
        verify_shard_set(prefix)
    message = str(err.value)
    assert "no such shard" in message and "pile_00000" in message and "delete" not in message
    verify_shard_set(shards[0])  # the shards themselves pass


def test_trash_named_with_this_process_pid_is_removed(tmp_path):
    """A restarted trainer in a container often gets the pid of the one a kill stopped mid-prune: its
    `.trash-<tag>-<pid>` was skipped as if this process were still deleting it, and stayed forever.
    Any trash found between prunes is a leftover; the run's tags and other directories stay."""
    import os

    from megatron_lev.ckpt.layout import empty_trash

    mine = tmp_path / f".trash-iter_0000004-{os.getpid()}"
    other = tmp_path / ".trash-iter_0000002-1"
    keep = [tmp_path / "iter_0000006", tmp_path / ".trash-notes", tmp_path / "trash-iter_0000001-5"]
    for d in (mine, other, *keep):
        (d / "sub").mkdir(parents=True)
    assert sorted(empty_trash(tmp_path)) == ["iter_0000002", "iter_0000004"]
    assert not mine.exists() and not other.exists() and all(d.is_dir() for d in keep)
