"""Saving and loading one checkpoint tag through an engine, with this rank's RNG streams.

`save_checkpoint` writes the `started` marker, lets the engine write its files, checksums every
file into the `complete` marker, points `latest` and prunes (`ckpt.layout`); a step that fails on
one rank raises on every rank. `begin_save` is its first part: with `background=True` it returns
once every rank's files are written and the checksums, the marker, `latest` and pruning run on
threads (`PendingSave`; `train.async_save`). `load_checkpoint` reads the RNG file with
`weights_only=True` before the engine loads.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import random
import shutil
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_lev.ckpt.layout import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    DIGESTS_PREFIX,
    LATEST_FILE,
    STARTED_MARKER,
    checkpoint_files,
    clear_interrupted_start,
    file_checksums,
    interrupted_start,
    iteration_of,
    prune_checkpoints,
    read_latest,
    read_marker,
    share_checksums,
    tag_for,
)
from megatron_lev.ckpt.provenance import PROVENANCE_FILE
from megatron_lev.errors import CheckpointDataError
from megatron_lev.log import get_logger
from megatron_lev.parallel.random import RNGStatesTracker
from megatron_lev.parallel.session import no_phase
from megatron_lev.utils import dist as ranks
from megatron_lev.utils.io import (
    DiskFullError,
    atomic_save_torch,
    atomic_write_json,
    atomic_write_text,
    remove_stale_temps,
)

_LOW_SPACE = 16 << 20  # bytes: after a failed write, less than this free means the disk filled up

log = get_logger(__name__)


def capture_rng_state(tracker: RNGStatesTracker | None = None) -> dict[str, Any]:
    """Every RNG a training step may draw from, for this rank, as tensors and plain numbers
    (so the file loads with `torch.load(weights_only=True)`): the process's streams and the model's
    `tracker` (`model.rng`; None for a model without one)."""
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": {
            "version": int(version),
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        # this rank's device only: a resume may see another number of GPUs per task than the save did
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tracker.get_states() if tracker is not None else {},
    }


def model_rng(engine) -> RNGStatesTracker | None:
    """The RNG tracker of the model `engine` trains (`model.rng`, made by `engine.build_model`); None
    for a model built without one."""
    return getattr(getattr(engine, "module", None), "rng", None)


def restore_rng_state(states: dict[str, Any], tracker: RNGStatesTracker | None = None) -> None:
    """Set the process's streams and the model's `tracker` to what `capture_rng_state` recorded."""
    py = states["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = states["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # saved before: every visible device's, the current one's used
            here = torch.cuda.current_device()
            cuda = cuda[here] if here < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda)
    if states.get("tracker") and tracker is not None:
        tracker.set_states(states["tracker"])


def load_rng_file(path: str | PathLike) -> dict[str, Any]:
    """Read an RNG file with `weights_only=True`: tensors and plain values only, never arbitrary objects."""
    try:
        states = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointDataError(
            f"{path} is not a plain tensor file (refused to unpickle it: {str(exc).splitlines()[0][:200]}); "
            "use checkpoints only from a trusted source, or delete this file to resume without restoring "
            "the RNG streams"
        ) from exc
    if not isinstance(states, dict) or not {"python", "numpy", "torch"} <= states.keys():
        raise CheckpointDataError(f"{path} does not hold RNG states; delete it to resume without them")
    return states


# ------------------------------------------------------------------ save and load


def _disk_full(exc: BaseException, directory: Path) -> bool:
    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(e):
            return True
        e = e.__cause__ or e.__context__
    try:  # torch.save to a path reports a full disk as "unexpected pos": look at the disk itself
        return shutil.disk_usage(directory).free < _LOW_SPACE
    except OSError:
        return False


def _not_writable(exc: BaseException) -> OSError | None:
    """The OSError in `exc`'s chain that says a file system or directory refuses writes."""
    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return e
        e = e.__cause__ or e.__context__
    return None


def _save_failed(exc: BaseException, root: Path, path: Path) -> None:
    """Raise DiskFullError naming `path` if `exc` came from a full disk (freeing our partial save),
    CheckpointDataError if the save directory refuses writes (read-only or without permission)."""
    refused = _not_writable(exc)
    if refused is not None:
        previous, _ = read_latest(root)
        kept = f"{root / previous} is unchanged" if previous else "there is no earlier checkpoint"
        reason = "a read-only file system" if refused.errno == errno.EROFS else "permission denied"
        where = f" ({refused.filename})" if refused.filename else ""
        raise CheckpointDataError(
            f"saving checkpoint {path} failed: train.save={root} is not writable ({reason}{where}); "
            f"{kept}; make the directory writable or set train.save to a writable directory, then rerun"
            + (f" to resume from {previous}" if previous else "")
        ) from exc
    if not _disk_full(exc, root):
        return
    previous, _ = read_latest(root)
    if ranks.world_size() == 1 and not (path / COMPLETE_MARKER).exists():
        shutil.rmtree(path, ignore_errors=True)  # ours and useless: give the space back
    kept = (
        f"{root / previous} and {root / LATEST_FILE} are unchanged"
        if previous
        else "there is no earlier checkpoint"
    )
    then = f", then rerun to resume from {previous}" if previous else ", then rerun"
    raise DiskFullError(
        f"saving checkpoint {path} failed: no space left on the device; {kept}; free space "
        f"or set train.save to a directory with room{then}"
    ) from exc


def _save_error(exc: BaseException, root: Path, path: Path) -> BaseException:
    """The error to report for a failed save step: DiskFullError for a full disk, CheckpointDataError
    for a directory that refuses writes, else `exc`."""
    try:
        _save_failed(exc, root, path)
    except (DiskFullError, CheckpointDataError) as known:
        return known
    return exc


def check_save_dir(save_dir: str | PathLike) -> None:
    """Refuse at start a save directory (or, while it does not exist, the directory it would be
    created in) that refuses writes, rather than after the first steps."""
    where = Path(save_dir)
    while not where.exists() and where.parent != where:
        where = where.parent
    if where.is_dir() and not os.access(where, os.W_OK):
        raise CheckpointDataError(
            f"train.save={save_dir} is not writable ({where} refuses writes: a read-only file system "
            "or no permission); make it writable or set train.save to a writable directory"
        )


def save_checkpoint(
    engine,
    root: str | PathLike,
    iteration: int,
    client_state: dict[str, Any],
    keep_last: int,
    config_yaml: str | None = None,
    provenance: dict[str, Any] | None = None,
    phase: Callable[[str], None] = no_phase,
) -> Path:
    """Collective: save through the engine (`Engine.save`), then (after a barrier) checksum every file
    into the completion marker, point `latest`, prune. A step that fails on one rank raises on every rank.

    `config_yaml` and `provenance` (`ckpt.provenance`: the data and tokenizer the weights were trained
    on) are written by rank 0 into the tag directory, covered by the marker's checksums."""
    return begin_save(engine, root, iteration, client_state, keep_last, config_yaml, provenance, phase).wait()


@dataclass
class PendingSave:
    """A save whose files every rank has written; its completion may still be running on background
    threads: every rank checksums its share of the files (`share`), and rank 0 merges the shares into
    the `complete` marker, points `latest` and prunes (`finish`). Until then the tag is not complete,
    so nothing reads it and a resume takes the checkpoint before.

    `wait()` is collective: every rank calls it (before the next save, and when training ends). The
    ranks first agree that every share was written (a rank that could not write its share stops rank
    0's merge), then on rank 0's merge; a failure on any rank raises on every rank."""

    path: Path
    share: Future  # this rank's share of the checksums
    finish: Future | None  # rank 0: the merge, `latest`, pruning; its result is the seconds since `written`
    started: float  # perf_counter at the save's start
    written: float  # perf_counter when every rank's files were on disk
    stop: threading.Event = field(default_factory=threading.Event)  # ends rank 0's wait for the shares

    def done(self) -> bool:
        return self.share.done() and (self.finish is None or self.finish.done())

    def wait(self) -> Path:
        try:
            ranks.raise_on_every_rank(self.share.exception())
        except BaseException:
            self.stop.set()  # a share will not come: rank 0's merge stops waiting for it
            raise
        ranks.raise_on_every_rank(self.finish.exception() if self.finish is not None else None)
        if self.finish is not None:
            log.info(
                "saved checkpoint %s: files written in %.1fs, completed (checksums, latest) in %.2fs",
                self.path,
                self.written - self.started,
                self.finish.result(),
            )
        return self.path

    def abandon(self) -> BaseException | None:
        """Not collective (after an exception, when peers may be gone): stop waiting for other ranks'
        shares and let this rank's threads end; the first error, if any. The tag stays incomplete unless
        rank 0 already had every share."""
        self.stop.set()
        errors = [f.exception() for f in (self.share, self.finish) if f is not None]
        return next((e for e in errors if e is not None), None)


def _in_thread(name: str, fn: Callable[..., Any], *args) -> Future:
    """Run `fn(*args)` on a new daemon thread (one that never holds up the process's exit: a save left
    incomplete is never read); its result or exception in the returned future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def begin_save(
    engine,
    root: str | PathLike,
    iteration: int,
    client_state: dict[str, Any],
    keep_last: int,
    config_yaml: str | None = None,
    provenance: dict[str, Any] | None = None,
    phase: Callable[[str], None] = no_phase,
    background: bool = False,
) -> PendingSave:
    """Collective: the first part of `save_checkpoint` (the `started` marker, every rank's files, a
    barrier), then its completion: with `background`, on threads, so the caller goes on while the
    checksums run; else here. Call `wait()` on the result before the next save."""
    root = Path(root)
    tag = tag_for(iteration)
    path = root / tag
    start = time.perf_counter()
    error: BaseException | None = None
    if ranks.rank() == 0:
        ours = (path / STARTED_MARKER).is_file() or (path / COMPLETE_MARKER).is_file()
        if path.is_dir() and not ours and not interrupted_start(path):
            error = CheckpointDataError(
                f"{path} exists and was not written by this trainer; saving would "
                "overwrite it: move it elsewhere, or set train.save to another directory"
            )
        else:
            try:  # re-saving a tag: it is not complete until this save is
                if path.is_dir():  # left by a save that was killed: its temp files go
                    cleared = clear_interrupted_start(path)
                    if cleared or not ours:
                        log.info("%s was left by an interrupted save: saving it again", path)
                remove_stale_temps(root, LATEST_FILE)
                (path / COMPLETE_MARKER).unlink(missing_ok=True)
                for stale in path.glob(f"{DIGESTS_PREFIX}*.json"):  # a killed background completion's
                    stale.unlink()
                atomic_write_json(
                    path / STARTED_MARKER,
                    {
                        "iteration": iteration,
                        "world_size": ranks.world_size(),
                        "host": socket.gethostname(),
                        "time": time.time(),
                    },
                )
            except Exception as exc:  # noqa: BLE001 - shared with every rank below
                error = _save_error(exc, root, path)
    ranks.raise_on_every_rank(error)  # also the barrier: `started` is on disk before any rank writes
    phase(f"saving checkpoint {tag}: writing this rank's files")  # what a peer's timeout names
    try:
        engine.save(root, tag, client_state)
        atomic_save_torch(capture_rng_state(model_rng(engine)), path / f"rng_state_rank{ranks.rank()}.pt")
        if ranks.rank() == 0 and config_yaml is not None:
            atomic_write_text(path / CONFIG_FILE, config_yaml)
        if ranks.rank() == 0 and provenance is not None:
            atomic_write_json(path / PROVENANCE_FILE, provenance)
    except Exception as exc:  # noqa: BLE001 - a full disk surfaces as OSError or torch's RuntimeError
        error = _save_error(exc, root, path)
    phase(f"saving checkpoint {tag}: its files written, waiting for the other ranks'")
    ranks.raise_on_every_rank(error)  # every rank's files are on disk
    written = time.perf_counter()
    rank, world = ranks.rank(), ranks.world_size()
    if not background:  # here: the ranks share the checksums (collective), rank 0 completes
        share: Future = Future()
        share.set_result(file_checksums(path, checkpoint_files(path)))
        finish: Future | None = None
        if rank == 0:
            finish = Future()
            try:
                finish.set_result(_finish_save(root, path, iteration, keep_last, share.result(), written))
            except Exception as exc:  # noqa: BLE001 - raised on every rank by `wait`
                finish.set_exception(exc)
        return PendingSave(path, share, finish, start, written)
    names = checkpoint_files(path)  # every rank's files are on disk: the same list on every rank
    share = _in_thread(f"checksums {tag}", _checksum_share, path, names, rank, world)
    pending = PendingSave(path, share, None, start, written)
    if rank == 0:
        args = (root, path, iteration, keep_last, names, world, written, pending.stop)
        pending.finish = _in_thread(f"complete {tag}", _complete_in_background, *args)
    return pending


def _digests(path: Path, rank: int) -> Path:
    return path / f"{DIGESTS_PREFIX}{rank}.json"


def _names_digest(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def _checksum_share(path: Path, names: list[str], rank: int, world: int) -> None:
    """Every rank, on a background thread: checksum this rank's share of `names` into its digests file,
    or write the error there so rank 0 does not wait for the share; raises that error here too."""
    try:
        record = {
            "names": _names_digest(names),
            "files": [list(entry) for entry in share_checksums(path, names, rank, world)],
        }
    except Exception as exc:  # noqa: BLE001 - reported to rank 0 through the file, and raised below
        record, error = {"error": str(exc)}, exc
    else:
        error = None
    try:
        atomic_write_json(_digests(path, rank), record)
    except OSError as exc:  # rank 0 does not get the share; `PendingSave.wait` tells it
        raise _save_error(exc, path.parent, path) from exc
    if error is not None:
        raise error


def _complete_in_background(
    root: Path,
    path: Path,
    iteration: int,
    keep_last: int,
    names: list[str],
    world: int,
    written: float,
    stop: threading.Event,
    patience: float = 1800.0,
) -> float:
    """Rank 0's background thread: every rank's digests file (its own included), checked to cover
    exactly the files rank 0 listed, then `_finish_save`. Stops when `stop` is set (a share will not
    come) or a peer is silent for `patience` seconds. No collective."""
    files: dict[str, dict[str, Any]] = {}
    listed = _names_digest(names)
    deadline = time.monotonic() + patience
    for rank in range(world):
        digests = _digests(path, rank)
        while not digests.is_file():
            if stop.wait(0.05):
                raise CheckpointDataError(f"checkpoint {path} was left incomplete: a rank's checksums failed")
            if time.monotonic() > deadline:
                raise CheckpointDataError(
                    f"checkpoint {path} was left incomplete: rank {rank} wrote no checksums in "
                    f"{patience:.0f}s"
                )
        record = json.loads(digests.read_text(encoding="utf-8"))
        if "error" in record:
            raise CheckpointDataError(f"{record['error']} (on rank {rank})")
        if record.get("names") != listed:  # so the shares cover exactly `names`
            raise CheckpointDataError(
                f"checkpoint {path} was left incomplete: rank {rank} listed other files than rank 0 "
                "(a shared file system that showed the ranks different directory contents)"
            )
        files.update({n: {"size": size, "sha256": digest} for n, size, digest in record["files"]})
    seconds = _finish_save(root, path, iteration, keep_last, dict(sorted(files.items())), written)
    for rank in range(world):
        _digests(path, rank).unlink(missing_ok=True)
    return seconds


def _finish_save(
    root: Path, path: Path, iteration: int, keep_last: int, files: dict[str, dict[str, Any]], written: float
) -> float:
    """Rank 0, with every file's checksum: the `complete` marker, `latest`, pruning; the seconds since
    the files were `written`. No collective."""
    try:
        atomic_write_json(
            path / COMPLETE_MARKER,
            {
                "iteration": iteration,
                "world_size": ranks.world_size(),
                "time": time.time(),
                "files": files,
            },
        )
        atomic_write_text(root / LATEST_FILE, path.name + "\n")
    except OSError as exc:
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        raise _save_error(exc, root, path) from exc
    try:
        prune_checkpoints(root, keep_last, current=path.name)
    except OSError as exc:  # the save is complete; old checkpoints stay until the next save
        log.warning("could not prune old checkpoints under %s (%s)", root, exc)
    return time.perf_counter() - written


def load_checkpoint(engine, root: str | PathLike, tag: str) -> dict[str, Any]:
    """Collective: load model/optimizer through the engine (`Engine.load`) and this rank's RNG; returns
    the client state. The project's own files (RNG states) are read with `weights_only=True`."""
    root = Path(root)
    rng_path = root / tag / f"rng_state_rank{ranks.rank()}.pt"
    rng = load_rng_file(rng_path) if rng_path.is_file() else None  # before DeepSpeed touches anything
    client_state = engine.load(root, tag)
    if rng is not None:
        restore_rng_state(rng, model_rng(engine))
    else:
        log.warning("%s not found (different world size?): RNG streams are not restored", rng_path.name)
    try:
        iteration = read_marker(root / tag).get("iteration")
    except ValueError:
        iteration = iteration_of(tag)
    log.info("resumed from %s (iteration %s)", root / tag, iteration)
    return client_state or {}
