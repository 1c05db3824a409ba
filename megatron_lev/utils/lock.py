"""One writer per output: an exclusive `flock` on a lock file beside it.

    with exclusive_lock(Path(save_dir) / LOCK_NAME, f"train.save={save_dir}", "megatron-lev train"):
        ...  # a second writer gets LockedError naming this one (host, pid, since when)

The kernel releases a `flock` when its holder dies, so a crashed or killed writer never leaves
the output locked: its lock file stays behind, holds no lock, and the next writer takes it over.
A holder that ends normally removes its lock file. The lock file records who holds it (host,
pid, start time, command) for the refusal message; the lock is the kernel's, not the file's
existence.

On a file system without `flock` support (some Lustre mounts without `-o flock`) the lock cannot
be taken: a warning says so and the writer goes on unlocked. NFS (v4, or v3 with NLM) and local
file systems support it across processes and, for NFS, across hosts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from megatron_lev.errors import LockedError

DIR_LOCK_NAME = ".megatron-lev.lock"  # the lock file of a directory a run writes into (train.save)
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the lock file ("unknown" if not yet written)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"{info['command']} on host {info['host']}, pid {info['pid']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "a process that has not yet said who it is"


def acquire(path: str | os.PathLike, what: str, command: str) -> int | None:
    """Take the exclusive lock on lock file `path` (created if missing) without waiting; returns its
    file descriptor, or None where the file system cannot lock (a warning is printed). A lock held by
    another process raises LockedError naming `what` (the output), the holder and `path`."""
    path = Path(path)
    while True:
        # read-only: a held lock keeps no file of the directory open for writing, so the directory's
        # file system can still be remounted read-only under a running job (flock needs no write mode)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except IsADirectoryError:
            raise LockedError(
                f"{path} is a directory, where the lock file of {what} goes (it is not one this program "
                "made): move it away or remove it, then start again"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise LockedError(
                f"{what} is being written by another {holder} (it holds {path}); two writers would "
                "interleave their outputs: wait for it to end, or write somewhere else"
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno in _UNSUPPORTED:
                print(
                    f"warning: cannot lock {path} ({exc.strerror}: the file system does not support "
                    f"flock); nothing stops a second writer into {what}",
                    file=sys.stderr,
                )
                return None
            raise
        try:  # a holder that ended removed the file it locked: ours must still be the one at `path`
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "command": command}
        out = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(out, json.dumps(record).encode())
        finally:
            os.close(out)
        return fd


def release(fd: int | None, path: str | os.PathLike) -> None:
    """Remove lock file `path` and drop the lock (`fd` from `acquire`; None: nothing was locked).
    Removing it while still holding the lock is what lets `acquire` detect a stale descriptor."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(path)
    os.close(fd)


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str, command: str) -> Iterator[None]:
    """Hold the lock on `path` for the block (see `acquire`)."""
    fd = acquire(path, what, command)
    try:
        yield
    finally:
        release(fd, path)
