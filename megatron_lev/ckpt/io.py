"""Saving and loading one checkpoint tag through an engine, with this rank's RNG streams.

`save_checkpoint` writes the `started` marker, lets the engine write its files, checksums every
file into the `complete` marker, points `latest` and prunes (`ckpt.layout`); a step that fails on
one rank raises on every rank. `load_checkpoint` reads the RNG file with `weights_only=True`
before the engine loads.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import shutil
import socket
import time
from collections.abc import Callable
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_lev.ckpt.layout import (
    COMPLETE_MARKER,
    CONFIG_FILE,
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
    tag_for,
)
from megatron_lev.ckpt.provenance import PROVENANCE_FILE
from megatron_lev.errors import CheckpointDataError
from megatron_lev.log import get_logger
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


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, for this rank, as tensors and plain numbers
    (so the file loads with `torch.load(weights_only=True)`)."""
    from megatron_lev.parallel.random import get_rng_tracker

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
        "tracker": get_rng_tracker().get_states(),
    }


def restore_rng_state(states: dict[str, Any]) -> None:
    from megatron_lev.parallel.random import get_rng_tracker

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
    if states.get("tracker"):
        get_rng_tracker().set_states(states["tracker"])


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
        atomic_save_torch(capture_rng_state(), path / f"rng_state_rank{ranks.rank()}.pt")
        if ranks.rank() == 0 and config_yaml is not None:
            atomic_write_text(path / CONFIG_FILE, config_yaml)
        if ranks.rank() == 0 and provenance is not None:
            atomic_write_json(path / PROVENANCE_FILE, provenance)
    except Exception as exc:  # noqa: BLE001 - a full disk surfaces as OSError or torch's RuntimeError
        error = _save_error(exc, root, path)
    phase(f"saving checkpoint {tag}: its files written, waiting for the other ranks'")
    ranks.raise_on_every_rank(error)  # every rank's files are on disk
    saved = time.perf_counter()
    files = file_checksums(path, checkpoint_files(path))
    if ranks.rank() == 0:
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
            atomic_write_text(root / LATEST_FILE, tag + "\n")
        except OSError as exc:
            (path / COMPLETE_MARKER).unlink(missing_ok=True)
            error = _save_error(exc, root, path)
        else:
            try:
                prune_checkpoints(root, keep_last, current=tag)
            except OSError as exc:  # the save is complete; old checkpoints stay until the next save
                log.warning("could not prune old checkpoints under %s (%s)", root, exc)
    ranks.raise_on_every_rank(error)
    log.info(
        "saved checkpoint %s in %.1fs (checksums %.2fs)",
        path,
        time.perf_counter() - start,
        time.perf_counter() - saved,
    )
    return path


def load_checkpoint(engine, root: str | PathLike, tag: str) -> dict[str, Any]:
    """Collective: load model/optimizer through the engine (`Engine.load`) and this rank's RNG; returns
    the client state. The project's own files (RNG states) are read with `weights_only=True`."""
    root = Path(root)
    rng_path = root / tag / f"rng_state_rank{ranks.rank()}.pt"
    rng = load_rng_file(rng_path) if rng_path.is_file() else None  # before DeepSpeed touches anything
    client_state = engine.load(root, tag)
    if rng is not None:
        restore_rng_state(rng)
    else:
        log.warning("%s not found (different world size?): RNG streams are not restored", rng_path.name)
    try:
        iteration = read_marker(root / tag).get("iteration")
    except ValueError:
        iteration = iteration_of(tag)
    log.info("resumed from %s (iteration %s)", root / tag, iteration)
    return client_state or {}
