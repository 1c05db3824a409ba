"""Atomic writes and checksums: the one place the project writes a file safely.

A file is written to a hidden temp file beside its destination, flushed and
fsynced, then renamed over it, so a reader sees the old file or the new one, never
half of one. A failed write removes its temp file and, when the disk is full, says
so and names the path.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from megatron_lev.errors import UserError

TEMP_MARK = ".tmp."  # every temp name contains it: `.<name>.tmp.<host>-<pid>`
STALE_FOREIGN_TEMP_S = 24 * 3600  # a temp of another host (or of unknown host) is reaped only when older


class DiskFullError(UserError, OSError):
    """No space left while writing `path`."""


def temp_tag() -> str:
    """`<host>-<pid>`: who writes a temp file. The host makes it unique on a filesystem that
    several nodes share, and tells `remove_stale_temps` where the writer's pid means something."""
    return f"{_host()}-{os.getpid()}"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "localhost"


def temp_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}{TEMP_MARK}{temp_tag()}")


def raise_if_disk_full(exc: OSError, path: str | os.PathLike) -> None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(
            f"{path}: no space left on the device while writing; "
            f"free space or choose another directory, then rerun"
        ) from exc


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """Open a temp file beside `path`; on success fsync and rename it over `path`."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files; mode {mode!r} is not 'w' or 'wb'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise_if_disk_full(exc, path)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_save_torch(obj: Any, path: str | os.PathLike) -> None:
    """`torch.save` through a temp file and a rename."""
    import torch

    with atomic_open(path, "wb") as f:
        torch.save(obj, f)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def remove_stale_temps(
    directory: str | os.PathLike, name: str, marks: tuple[str, ...] = (TEMP_MARK,)
) -> list[Path]:
    """Remove the temp files and directories that dead writers of `name` left in `directory`.
    Returns what was removed.

    Only temps of `name` itself are considered: `.<name>.tmp.<tag>`, `.<name>.<...>.tmp.<tag>` and
    `.<name>_<...>.tmp.<tag>` (so `pile_1` never touches `.pile_10...`; `marks` may list other
    markers than `.tmp.`), and only when `<tag>` is `<host>-<pid>` (see `temp_tag`) or a bare
    pid; anything else is not a temp of ours and is left.
    Liveness can only be checked on this host: a temp of this host is removed when its pid is no
    longer running. A temp of another host (the directory is on a filesystem shared by several
    nodes), or with a bare pid from a version that did not record the host, may belong to a run
    still going elsewhere: it is left alone unless older than STALE_FOREIGN_TEMP_S (24 hours)."""
    removed: list[Path] = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    mark = "|".join(map(re.escape, marks))
    ours = re.compile(
        rf"^\.{re.escape(name)}(?:[._].*)?(?:{mark})(?:(?P<host>[A-Za-z0-9_-]+)-)?(?P<pid>\d+)$"
    )
    here, now = _host(), time.time()
    for p in directory.iterdir():
        m = ours.match(p.name)
        if m is None:
            continue
        pid = int(m["pid"])
        if m["host"] == here:
            if pid != os.getpid() and _alive(pid):
                continue
        elif now - _last_change(p) < STALE_FOREIGN_TEMP_S:
            continue
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


_TEMP_NAME = re.compile(rf"^\..+{re.escape(TEMP_MARK)}(?:(?P<host>[A-Za-z0-9_-]+)-)?(?P<pid>\d+)$")


def temp_owner(name: str) -> tuple[str | None, int] | None:
    """(host, pid) of the writer of the temp file called `name` (`.<dest>.tmp.<host>-<pid>`, see
    `temp_path`; host None for a bare pid), or None when `name` is not a temp name."""
    m = _TEMP_NAME.match(name)
    return None if m is None else (m["host"], int(m["pid"]))


def temp_writer_running(name: str) -> bool:
    """Whether the temp file called `name` is being written by a live process of this host other
    than this one (a writer on another host cannot be asked: False)."""
    owner = temp_owner(name)
    return owner is not None and owner[0] == _host() and owner[1] != os.getpid() and _alive(owner[1])


def _last_change(path: Path) -> float:
    """The newest mtime of `path` and, for a directory, of what it holds (a staging directory
    whose one shard is still growing is in use); +inf when it cannot be read."""
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            for entry in os.scandir(path):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:
        return float("inf")
    return newest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
