"""The checkpoint directory format: tags, `latest`, completion markers with checksums, pruning.

Layout under a save directory:

    iter_0000100/            the engine's files + rng_state_rank{R}.pt + config.yaml
    iter_0000100/started     written by rank 0 before the save: this directory is ours
    iter_0000100/complete    written by rank 0 after every rank finished: size and sha256 of every file
    latest                   the newest complete tag (same format as DeepSpeed's `latest`)

A directory without `complete` (a save interrupted by a kill) is never loaded, and one whose
files disagree with the checksums in `complete` is refused. Directories and files without our
markers are never pruned. Pruning first renames a tag to `.trash-<tag>-<pid>` (one atomic rename)
and then deletes it, so a kill in the middle leaves either the whole tag (pruned again next time) or
a trash directory, which the next save or start removes (`empty_trash`) and names in the log.
This module is the one home of the format: the engine, the trainer,
the converters and the analyses all read it from here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lev.errors import CheckpointDataError
from megatron_lev.log import get_logger
from megatron_lev.utils import dist as ranks
from megatron_lev.utils.io import TEMP_MARK, sha256_file, temp_owner, temp_writer_running

COMPLETE_MARKER = "complete"
STARTED_MARKER = "started"
# a rank's share of a save's checksums, while the save completes in the background (`ckpt.io.begin_save`):
# `checksums-rank<r>.json`, removed when rank 0 has merged them into the `complete` marker
DIGESTS_PREFIX = "checksums-rank"
LATEST_FILE = "latest"
CONFIG_FILE = "config.yaml"
_TAG_RE = re.compile(r"^iter_(\d+)$")
TRASH_PREFIX = ".trash-"  # a pruned tag on its way out: `.trash-iter_0000100-<pid>`
_TRASH_RE = re.compile(r"^\.trash-(iter_\d+)-(\d+)$")

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
    ours: bool = True  # has our `started` or `complete` marker, or is an `interrupted_start`


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
            ours = complete or (child / STARTED_MARKER).is_file() or interrupted_start(child)
            found.append(CheckpointInfo(it, child.name, child, complete, ours))
    return sorted(found, key=lambda c: c.iteration)


def interrupted_start(path: str | os.PathLike) -> bool:
    """Whether tag directory `path` is one a save of this trainer created and was killed in before its
    `started` marker was in place: no marker, and nothing in it but temp files (`utils.io.temp_path`)
    that no live process of this host is writing (the `started` marker's own, half written). Such
    a directory is ours to clean (`clear_interrupted_start`); one holding anything else is not."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return False
    if (path / STARTED_MARKER).exists() or (path / COMPLETE_MARKER).exists():
        return False
    try:
        children = list(path.iterdir())
    except OSError:
        return False
    return all(
        c.is_file() and not c.is_symlink() and temp_owner(c.name) and not temp_writer_running(c.name)
        for c in children
    )


def clear_interrupted_start(path: str | os.PathLike) -> list[Path]:
    """Remove the dead writers' temp files from tag directory `path` (a save is about to write into
    it: an `interrupted_start`, or one with our `started` marker that a killed save left). Returns
    what was removed."""
    removed = []
    for child in Path(path).iterdir():
        if child.is_file() and temp_owner(child.name) and not temp_writer_running(child.name):
            child.unlink(missing_ok=True)
            removed.append(child)
    return removed


def read_latest(root: str | os.PathLike, any_tag: bool = False) -> tuple[str | None, str | None]:
    """(tag named by `root/latest`, problem); both None when there is no `latest`. The one reader of
    the pointer: the trainer's tags are `iter_<n>`; with `any_tag` any one directory name is taken
    (a DeepSpeed checkpoint another tool saved: `global_step1000`), never a path."""
    pointer = Path(root) / LATEST_FILE
    if not pointer.is_file():
        return None, None
    try:
        text = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{pointer} is unreadable ({exc})"
    named = text and text not in (".", "..") and "/" not in text and "\\" not in text
    if not named or (not any_tag and iteration_of(text) is None):
        return None, f"{pointer} does not name a checkpoint tag ({text[:40]!r})"
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


# ------------------------------------------------------------------ markers and checksums


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """Every file of a checkpoint directory (relative, sorted), without our markers and temp files."""
    path = Path(path)
    names = []
    for p in path.rglob("*"):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and rel not in (COMPLETE_MARKER, STARTED_MARKER) and TEMP_MARK not in p.name:
            if not (rel.startswith(DIGESTS_PREFIX) and rel.endswith(".json")):
                names.append(rel)
    return sorted(names)


def share_checksums(path: str | os.PathLike, names: list[str], rank: int, world: int) -> list[tuple]:
    """`(name, size, sha256)` of rank `rank`'s share of `names` (every `world`-th file); no collective.
    A file that cannot be read is a CheckpointDataError naming the checkpoint."""
    path = Path(path)
    try:
        return [(n, os.path.getsize(path / n), sha256_file(path / n)) for n in names[rank::world]]
    except OSError as exc:
        raise CheckpointDataError(f"cannot checksum the files of checkpoint {path} ({exc})") from exc


def file_checksums(path: str | os.PathLike, names: list[str]) -> dict[str, dict[str, Any]]:
    """Collective: `{name: {"size", "sha256"}}`; each rank hashes every world-size-th file."""
    mine, error = [], None
    try:
        mine = share_checksums(path, names, ranks.rank(), ranks.world_size())
    except CheckpointDataError as exc:
        error = exc
    ranks.raise_on_every_rank(error)
    return {n: {"size": size, "sha256": digest} for n, size, digest in ranks.gather_lists(mine)}


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
        if ranks.rank() == 0:
            log.warning(
                "%s records no checksums (saved by an older version): its files are not verified",
                path / COMPLETE_MARKER,
            )
        return []
    problems = []
    for name in sorted(files)[ranks.rank() :: ranks.world_size()]:
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
    return sorted(ranks.gather_lists(problems))


# ------------------------------------------------------------------ pruning


_warned_abandoned: set[tuple[str, str]] = set()  # (root, tags): each abandoned branch is named once


def _discard(path: Path) -> None:
    """Rename tag directory `path` to a trash name (atomic), then delete it: a kill leaves the whole tag
    or a trash directory, never a tag without its markers."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def empty_trash(root: str | os.PathLike) -> list[str]:
    """Delete what a killed prune left under `root` (`.trash-<tag>-<pid>`: the save directory's lock lets
    one trainer at a time save and prune there, and a prune renames and deletes in one call, so any
    trash found between prunes is a leftover, also one named with this process's pid: a container's
    restarted trainer often gets the pid of the one that died) and say so in one line; returns the
    tags it removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for child in sorted(root.iterdir()):
        m = _TRASH_RE.match(child.name)
        if m is None or not child.is_dir() or child.is_symlink():
            continue
        shutil.rmtree(child, ignore_errors=True)
        if not child.exists():
            removed.append(m.group(1))
    if removed:
        log.info(
            "removed %s under %s: checkpoint(s) an interrupted prune had started to delete",
            ", ".join(removed),
            root,
        )
    return removed


def prune_checkpoints(root: str | os.PathLike, keep_last: int, current: str | None = None) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints, and our partial saves older than
    those. Never deleted: directories without our markers, `current` (the tag just saved), the tag
    `latest` names, and every checkpoint above `current`'s iteration. Those belong to a branch
    this run abandoned when it resumed from an older tag (the newer one was damaged, or `latest` was
    rolled back); they are kept, named in a warning, and not counted in `keep_last`, so they can
    never push the run's own new checkpoints out."""
    root = Path(root)
    empty_trash(root)
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
        _discard(c.path)
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
