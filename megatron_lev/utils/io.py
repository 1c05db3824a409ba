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
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from megatron_lev.errors import UserError

TEMP_MARK = ".tmp."  # every temp name contains it: `.<name>.tmp.<pid>`


class DiskFullError(UserError, OSError):
    """No space left while writing `path`."""


def temp_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def raise_if_disk_full(exc: OSError, path: str | os.PathLike) -> None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise DiskFullError(f"{path}: no space left on the device while writing; "
                            f"free space or choose another directory, then rerun") from exc


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


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


def remove_stale_temps(directory: str | os.PathLike, pattern: str = "*") -> list[Path]:
    """Remove temp files left in `directory` by writers that died (`.name.tmp.<pid>`),
    skipping those of processes still alive. Returns what was removed."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for p in directory.glob(f".{pattern}"):
        name = p.name
        if TEMP_MARK not in name:
            continue
        pid = name.rsplit(TEMP_MARK, 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            if p.is_dir():
                import shutil

                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
