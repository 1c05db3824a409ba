"""Checkpoint directories: save through the engine, mark completion, keep the last few, resume safely.

Layout under `train.save`:

    iter_0000100/            the engine's files + rng_state_rank{R}.pt + config.yaml
    iter_0000100/started     written by rank 0 before the save: this directory is ours
    iter_0000100/complete    written by rank 0 after every rank finished: size and sha256 of every file
    latest                   the newest complete tag (same format as DeepSpeed's `latest`)

A directory without `complete` (a save interrupted by a kill) is never loaded, and
one whose files disagree with the checksums in `complete` is skipped with a
warning: resume takes the newest checkpoint that verifies and says so. Directories
and files this module did not write are never pruned, and a fresh start refuses a
save directory that holds any (they may be someone's checkpoints).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_lev.engine.checkpoint_files import ENGINE_HELPER_FILES
from megatron_lev.errors import CheckpointDataError
from megatron_lev.logging import get_logger
from megatron_lev.training import resume_config
from megatron_lev.utils.io import (
    TEMP_MARK,
    DiskFullError,
    atomic_save_torch,
    atomic_write_json,
    atomic_write_text,
    sha256_file,
)

COMPLETE_MARKER = "complete"
STARTED_MARKER = "started"
LATEST_FILE = "latest"
CONFIG_FILE = "config.yaml"
RUN_OUTPUTS = (
    "config.yaml",
    "metrics.jsonl",
    "logs",
    "tensorboard",
)  # when train.save is the output directory
_TAG_RE = re.compile(r"^iter_(\d+)$")
_LOW_SPACE = 16 << 20  # bytes: after a failed write, less than this free means the disk filled up

log = get_logger(__name__)


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(tag: str) -> int | None:
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointInfo:
    iteration: int
    tag: str
    path: Path
    complete: bool
    ours: bool = True  # has our `started` or `complete` marker


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointInfo]:
    """Every `iter_*` directory under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        it = iteration_of(child.name)
        if it is not None and child.is_dir():
            complete = (child / COMPLETE_MARKER).is_file()
            found.append(
                CheckpointInfo(
                    it, child.name, child, complete, complete or (child / STARTED_MARKER).is_file()
                )
            )
    return sorted(found, key=lambda c: c.iteration)


def read_latest(root: str | os.PathLike) -> tuple[str | None, str | None]:
    """(tag named by `root/latest`, problem); both None when there is no `latest`."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None, None
    try:
        text = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{pointer} is unreadable ({exc})"
    if iteration_of(text) is None:
        return None, f"{pointer} does not name a checkpoint ({text[:40]!r})"
    return text, None


def resume_candidates(root: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(complete tags to try, best first: `latest`, then newest to oldest; warnings to log)."""
    root = Path(root)
    ckpts = list_checkpoints(root)
    complete = [c for c in ckpts if c.complete]
    notes = []
    wanted, problem = read_latest(root)
    if problem:
        notes.append(problem + ": ignoring it")
    newest_partial = [
        c for c in ckpts if not c.complete and (not complete or c.iteration > complete[-1].iteration)
    ]
    if newest_partial:
        notes.append(
            f"ignoring incomplete checkpoint(s) {', '.join(c.tag for c in newest_partial)} "
            f"(no '{COMPLETE_MARKER}' marker: the save was interrupted)"
        )
    tags = [c.tag for c in reversed(complete)]
    if wanted in tags:
        tags.remove(wanted)
        tags.insert(0, wanted)
    elif wanted and tags:
        notes.append(
            f"{root / LATEST_FILE} points to {wanted!r}, which is missing or incomplete; "
            f"resuming from {tags[0]} instead"
        )
    return tags, notes


def find_resume_tag(root: str | os.PathLike) -> str | None:
    """The tag to resume from (not yet verified): `latest` if complete, else the newest complete one."""
    tags, notes = resume_candidates(root)
    for note in notes:
        log.warning("%s", note)
    return tags[0] if tags else None


# ------------------------------------------------------------------ checksums


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(items: list) -> list:
    """Concatenate every rank's list (in rank order)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return items
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def _raise_on_every_rank(exc: BaseException | None) -> None:
    """Collective: raise on every rank when any rank failed (`exc` is this rank's failure, or None).

    The rank that failed re-raises its own exception; the others raise one of the same kind
    (DiskFullError, CheckpointDataError, else RuntimeError) naming the failing rank, so no rank
    waits in a later collective for one that already gave up."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if exc is not None:
            raise exc
        return
    mine = None
    if exc is not None:
        kind = (
            "disk"
            if isinstance(exc, DiskFullError)
            else "data"
            if isinstance(exc, CheckpointDataError)
            else "other"
        )
        mine = (kind, f"{type(exc).__name__}: {exc}" if kind == "other" else str(exc))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if exc is not None:
        raise exc
    failed = [(rank, part) for rank, part in enumerate(parts) if part is not None]
    if failed:
        rank, (kind, msg) = failed[0]
        cls = {"disk": DiskFullError, "data": CheckpointDataError}.get(kind, RuntimeError)
        raise cls(f"{msg} (on rank {rank})")


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """Every file of a checkpoint directory (relative, sorted), without our markers and temp files."""
    path = Path(path)
    names = []
    for p in path.rglob("*"):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and rel not in (COMPLETE_MARKER, STARTED_MARKER) and TEMP_MARK not in p.name:
            names.append(rel)
    return sorted(names)


def file_checksums(path: str | os.PathLike, names: list[str]) -> dict[str, dict[str, Any]]:
    """Collective: `{name: {"size", "sha256"}}`; each rank hashes every world-size-th file."""
    path = Path(path)
    mine, error = [], None
    try:
        mine = [(n, os.path.getsize(path / n), sha256_file(path / n)) for n in names[_rank() :: _world()]]
    except OSError as exc:
        error = CheckpointDataError(f"cannot checksum the files of checkpoint {path} ({exc})")
        error.__cause__ = exc
    _raise_on_every_rank(error)
    return {n: {"size": size, "sha256": digest} for n, size, digest in _gather(mine)}


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The completion marker of checkpoint directory `path`; ValueError if it is damaged."""
    marker = Path(path) / COMPLETE_MARKER
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{marker} is unreadable ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{marker} is not a JSON object")
    return data


def _listed_files(marker: dict[str, Any]) -> dict[str, tuple[int, str]] | None:
    """name -> (size, sha256) from a marker; None for markers without checksums; ValueError if malformed."""
    files = marker.get("files")
    if files is None:
        return None
    try:
        out = {str(n): (int(m["size"]), str(m["sha256"])) for n, m in files.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"its file list is malformed ({exc!r})") from exc
    for name in out:
        if name.startswith("/") or ".." in Path(name).parts:
            raise ValueError(f"it lists a file outside the checkpoint ({name!r})")
    return out


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Collective: problems with checkpoint directory `path` (damaged marker, missing, resized or
    altered files), the same list on every rank; empty if it verifies."""
    path = Path(path)
    try:
        files = _listed_files(read_marker(path))
    except ValueError as exc:
        msg = str(exc) if str(exc).startswith(str(path)) else f"{path / COMPLETE_MARKER}: {exc}"
        return [msg]
    if files is None:
        if _rank() == 0:
            log.warning(
                "%s records no checksums (saved by an older version): its files are not verified",
                path / COMPLETE_MARKER,
            )
        return []
    problems = []
    for name in sorted(files)[_rank() :: _world()]:
        size, digest = files[name]
        p = path / name
        try:
            if not p.is_file():
                problems.append(f"{p} is missing")
            elif p.stat().st_size != size:
                problems.append(
                    f"{p} has {p.stat().st_size} bytes, {size} expected (truncated or overwritten)"
                )
            elif sha256_file(p) != digest:
                problems.append(f"{p} does not match its checksum (the file was altered or damaged)")
        except OSError as exc:  # a problem like the others: every rank still reaches the gather
            problems.append(f"{p} is unreadable ({exc})")
    return sorted(_gather(problems))


# ------------------------------------------------------------------ choosing what to resume


@dataclass(frozen=True)
class ResumePlan:
    """Where a run starts: `tag` under `root`, or from scratch (`tag` None)."""

    root: Path | None
    tag: str | None


def _foreign_entries(root: Path, cfg=None) -> list[str]:
    """What in save directory `root` a fresh start would prune or overwrite but did not write."""
    if not root.is_dir():
        return []
    outputs = ()
    if cfg is not None and Path(cfg.logging.output_dir).resolve() == root.resolve():
        outputs = RUN_OUTPUTS
    found = []
    for child in sorted(root.iterdir()):
        name = child.name
        if TEMP_MARK in name or name in ENGINE_HELPER_FILES or name in outputs:
            continue
        if iteration_of(name) is not None and child.is_dir():
            if (child / COMPLETE_MARKER).is_file():
                found.append(f"{name}/ (a complete checkpoint)")
            elif not (child / STARTED_MARKER).is_file():
                found.append(f"{name}/ (no '{COMPLETE_MARKER}' marker, not written by this trainer)")
            continue
        if name == LATEST_FILE:
            wanted, _ = read_latest(root)
            found.append(
                f"{LATEST_FILE} (names {wanted or 'nothing readable'}, which is not a usable checkpoint)"
            )
            continue
        found.append(name + ("/" if child.is_dir() else ""))
    return found


def check_fresh_start(save_dir: str | os.PathLike, cfg=None) -> None:
    """Refuse to start from scratch into a save directory holding files a fresh run would prune or
    overwrite."""
    root = Path(save_dir)
    found = _foreign_entries(root, cfg)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise CheckpointDataError(
            f"train.save={root} already holds {shown}, and no checkpoint there can be resumed; a fresh start "
            "would prune or overwrite them: move them elsewhere (or delete them), or set train.save to an "
            "empty directory"
        )


def check_resume_config(path: str | os.PathLike, cfg, allow=()) -> None:
    """Print how `cfg` differs from the config stored in checkpoint `path`; refuse changes that
    would load the weights wrongly or make the resume inexact (unless allowed by name)."""
    import yaml

    stored_file = Path(path) / CONFIG_FILE
    if not stored_file.is_file():
        if _rank() == 0:
            log.warning("%s not found (saved by an older version): the config is not compared", stored_file)
        return
    try:
        stored = yaml.safe_load(stored_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CheckpointDataError(
            f"{stored_file} is unreadable ({exc}); restore it from the run's "
            "output directory or remove the checkpoint"
        ) from exc
    if not isinstance(stored, dict):
        raise CheckpointDataError(
            f"{stored_file} is not a config mapping; restore it or remove the checkpoint"
        )
    diffs = resume_config.differences(stored, cfg.to_dict())
    if not diffs:
        return
    lines, fixed, exact = resume_config.judge(diffs, frozenset(allow))
    if _rank() == 0:
        log.warning("the config differs from the checkpoint's (%s):\n%s", stored_file, "\n".join(lines))
    if fixed:
        raise CheckpointDataError(
            f"cannot resume from {path}: {', '.join(fixed)} differ from the checkpoint's config "
            f"({stored_file}), whose weights and optimizer states were saved for the old values: "
            "restore them, "
            "convert or reshard the checkpoint, or start a new run with another train.save"
        )
    if exact:
        flags = " ".join(f"--allow-change {k}" for k in exact)
        raise CheckpointDataError(
            f"cannot resume exactly from {path}: {', '.join(exact)} differ from the checkpoint's config "
            f"({stored_file}): restore them, or pass {flags} to accept a resume that is not exact"
        )


def _resolved(path: str | os.PathLike) -> Path:
    """`path` absolute with symlinks resolved (as far as it exists), to compare two spellings of a
    directory."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def plan_resume(
    load_dir: str | os.PathLike | None, save_dir: str | os.PathLike | None, cfg=None, allow=()
) -> ResumePlan:
    """Collective: the newest checkpoint that verifies, looked for in `save_dir` first (a requeued run
    continues its own checkpoints), then `load_dir`; damaged ones are named and skipped. With none,
    checks that starting from scratch loses nothing. Directories are compared resolved: a relative
    path or a symlink naming `save_dir` is the same directory."""
    roots: list[Path] = []
    for d in (save_dir, load_dir):
        if d and all(_resolved(d) != _resolved(r) for r in roots):
            roots.append(Path(d))
    for root in roots:
        tags, notes = resume_candidates(root)
        if _rank() == 0:
            for note in notes:
                log.warning("%s", note)
        if not tags:
            continue
        damaged = []
        for tag in tags:
            problems = verify_checkpoint(root / tag)
            if not problems:
                if damaged and _rank() == 0:
                    log.warning("resuming from %s instead of the damaged %s", root / tag, ", ".join(damaged))
                if cfg is not None:
                    check_resume_config(root / tag, cfg, allow)
                if save_dir and _resolved(save_dir) != _resolved(root):  # from train.load: saves go elsewhere
                    check_fresh_start(save_dir, cfg)
                return ResumePlan(root, tag)
            damaged.append(tag)
            if _rank() == 0:
                more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
                log.warning("checkpoint %s is damaged: %s%s; skipping it", root / tag, problems[0], more)
        raise CheckpointDataError(
            f"no usable checkpoint under {root}: {', '.join(damaged)} failed verification (see the warnings "
            "above); restore them from a backup, or move the directory away to start from scratch"
        )
    if save_dir:
        check_fresh_start(save_dir, cfg)
    if load_dir and save_dir and _resolved(load_dir) != _resolved(save_dir):
        raise CheckpointDataError(
            f"train.load={load_dir} holds no complete checkpoint: fix the path, or unset "
            "train.load to start from scratch"
        )
    if _rank() == 0:
        log.info("no checkpoint under %s: starting from scratch", save_dir or load_dir)
    return ResumePlan(None, None)


# ------------------------------------------------------------------ RNG states (plain tensors)


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
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
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
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if states.get("tracker"):
        get_rng_tracker().set_states(states["tracker"])


def load_rng_file(path: str | os.PathLike) -> dict[str, Any]:
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


# ------------------------------------------------------------------ save, prune, load


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


def _save_failed(exc: BaseException, root: Path, path: Path) -> None:
    """Raise DiskFullError naming `path` if `exc` came from a full disk (freeing our partial save)."""
    if not _disk_full(exc, root):
        return
    previous, _ = read_latest(root)
    if _world() == 1 and not (path / COMPLETE_MARKER).exists():
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
    """The error to report for a failed save step: DiskFullError for a full disk, else `exc`."""
    try:
        _save_failed(exc, root, path)
    except DiskFullError as full:
        return full
    return exc


def save_checkpoint(
    engine,
    root: str | os.PathLike,
    iteration: int,
    client_state: dict[str, Any],
    keep_last: int,
    config_yaml: str | None = None,
) -> Path:
    """Collective: save through the engine (`Engine.save`), then (after a barrier) checksum every file
    into the completion marker, point `latest`, prune. A step that fails on one rank raises on every rank."""
    root = Path(root)
    tag = tag_for(iteration)
    path = root / tag
    start = time.perf_counter()
    error: BaseException | None = None
    if _rank() == 0:
        if path.is_dir() and not (path / STARTED_MARKER).is_file() and not (path / COMPLETE_MARKER).is_file():
            error = CheckpointDataError(
                f"{path} exists and was not written by this trainer; saving would "
                "overwrite it: move it elsewhere, or set train.save to another directory"
            )
        else:
            try:  # re-saving a tag: it is not complete until this save is
                (path / COMPLETE_MARKER).unlink(missing_ok=True)
                atomic_write_json(
                    path / STARTED_MARKER,
                    {
                        "iteration": iteration,
                        "world_size": _world(),
                        "host": socket.gethostname(),
                        "time": time.time(),
                    },
                )
            except Exception as exc:  # noqa: BLE001 - shared with every rank below
                error = _save_error(exc, root, path)
    _raise_on_every_rank(error)  # also the barrier: `started` is on disk before any rank writes
    try:
        engine.save(root, tag, client_state)
        atomic_save_torch(capture_rng_state(), path / f"rng_state_rank{_rank()}.pt")
        if _rank() == 0 and config_yaml is not None:
            atomic_write_text(path / CONFIG_FILE, config_yaml)
    except Exception as exc:  # noqa: BLE001 - a full disk surfaces as OSError or torch's RuntimeError
        error = _save_error(exc, root, path)
    _raise_on_every_rank(error)  # every rank's files are on disk
    saved = time.perf_counter()
    files = file_checksums(path, checkpoint_files(path))
    if _rank() == 0:
        try:
            atomic_write_json(
                path / COMPLETE_MARKER,
                {"iteration": iteration, "world_size": _world(), "time": time.time(), "files": files},
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
    _raise_on_every_rank(error)
    log.info(
        "saved checkpoint %s in %.1fs (checksums %.2fs)",
        path,
        time.perf_counter() - start,
        time.perf_counter() - saved,
    )
    return path


_warned_abandoned: set[tuple[str, str]] = set()  # (root, tags): each abandoned branch is named once


def prune_checkpoints(root: str | os.PathLike, keep_last: int, current: str | None = None) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints, and our partial saves older than
    those. Never deleted: directories without our markers, `current` (the tag just saved), the tag
    `latest` names, and every checkpoint above `current`'s iteration. Those belong to a branch
    this run abandoned when it resumed from an older tag (the newer one was damaged, or `latest` was
    rolled back); they are kept, named in a warning, and not counted in `keep_last`, so they can
    never push the run's own new checkpoints out."""
    root = Path(root)
    ckpts = list_checkpoints(root)
    at = iteration_of(current) if current else None
    ahead = [c for c in ckpts if at is not None and c.iteration > at]
    ranked = [c for c in ckpts if c.complete and c not in ahead]
    keep = {c.tag for c in ranked[-keep_last:]}
    keep |= {c.tag for c in ahead}
    latest, _ = read_latest(root)
    keep |= {t for t in (current, latest) if t}
    newest = ranked[-1].iteration if ranked else -1
    removed = []
    for c in ckpts:
        if c.tag in keep or not c.ours or (not c.complete and c.iteration > newest):
            continue
        shutil.rmtree(c.path, ignore_errors=True)
        removed.append(c.tag)
    abandoned = [c for c in ahead if c.ours]
    key = (str(root), ",".join(c.tag for c in abandoned))
    if abandoned and key not in _warned_abandoned:
        _warned_abandoned.add(key)
        log.warning(
            "checkpoint(s) %s under %s are newer than %s, the one just saved: left by an earlier run "
            "this one did not continue from; they are kept and not counted in train.keep_last. Once "
            "they are not needed, delete them (rm -r %s)",
            ", ".join(c.tag for c in abandoned),
            root,
            current,
            " ".join(str(c.path) for c in abandoned),
        )
    return removed


def load_checkpoint(engine, root: str | os.PathLike, tag: str) -> dict[str, Any]:
    """Collective: load model/optimizer through the engine (`Engine.load`) and this rank's RNG; returns
    the client state. The project's own files (RNG states) are read with `weights_only=True`."""
    root = Path(root)
    rng_path = root / tag / f"rng_state_rank{_rank()}.pt"
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
