"""The fused CPU kernel for LEV's separable product (`csrc/lev_cpu.c`), built on first use.

It is plain C (no PyTorch headers), so building it takes about a second with the
system's C compiler; the shared library is cached by a hash of the source, the
flags, the compiler and the CPU's instruction-set flags (`-march=native` code must
not run on another CPU model of a shared file system), and is written atomically
(temporary file, then rename), so ranks that build at once never load a half-written
library. A library is loaded only from a directory and file this user owns and nobody
else can write; a shared or tampered cache is skipped (with a warning) for a private
temporary build. Without a compiler, or with `MEGATRON_LEV_CPU_KERNEL=0`, LEV uses its
PyTorch path (`phi` by `bmm`) and says so once in the log.

The calls go through `ctypes`, which releases the GIL, so a thread pool of
`torch.get_num_threads()` workers runs disjoint task ranges in parallel.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megatron_lev.model.embeddings.lev_constants import GROUP

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "lev_cpu.c"
ENV_SWITCH = "MEGATRON_LEV_CPU_KERNEL"  # "0": never build or use the kernel
ENV_CACHE = "MEGATRON_LEV_KERNEL_CACHE"  # where built libraries are kept
# No -ffast-math: NaN/inf checks must keep their meaning. Reassociation only, so that the
# r-wide dot products vectorise.
CFLAGS = [
    "-O3",
    "-std=c11",
    "-fPIC",
    "-shared",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]
ARCH_FLAGS = {"x86_64": ["-march=native"], "aarch64": ["-mcpu=native"]}
TASKS_PER_THREAD = 4  # finer ranges than threads: even out uneven tasks

_lock = threading.Lock()
_state: dict[str, object] = {}


def _forget_pool_in_child() -> None:
    """A forked child has none of the parent's pool threads: it makes its own on first use."""
    _state.pop("pool", None)
    _state.pop("threads", None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                return line
    return platform.processor()


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_lev" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_name(cc: str | None = None) -> str:
    """The cached library's file name: a hash of the source, flags, compiler and CPU flags."""
    cc = cc or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc, or $CC) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(_flags()), version, _cpu_flags()]).encode())
    return f"lev_cpu-{key.hexdigest()[:16]}.so"


def _flags() -> list[str]:
    return CFLAGS + ARCH_FLAGS.get(platform.machine(), [])


def untrusted(path: Path, directory: bool) -> str | None:
    """Why a library could not be trusted from `path` (None if it can): another user could have
    written it, because it (or, for a file, the link itself) is theirs or writable by group/others."""
    st = os.stat(path) if directory else os.lstat(path)
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a link?)"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def build(directory: Path | None = None) -> Path:
    """Compile the kernel (or find it cached); returns the shared library's path. Raises on failure.

    Only a cache directory and a library that this user owns and nobody else can write are
    used; otherwise (a shared or planted cache) the kernel is built in a fresh private
    temporary directory, with a warning, so no other user's code is ever loaded.
    """
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc, or $CC) on PATH")
    name = library_name(cc)
    directory = Path(directory or cache_dir())
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = untrusted(directory, directory=True)
    target = directory / name
    if problem is None and (target.is_symlink() or target.exists()):
        what = untrusted(target, directory=False)
        if what is None:
            return target
        problem = f"holds {name}, which {what}"
    if problem is not None:
        private = Path(tempfile.mkdtemp(prefix="megatron_lev-kernel-"))  # mode 0700, ours
        atexit.register(shutil.rmtree, private, True)
        log.warning(
            "LEV CPU kernel: not loading from %s: it %s; building in the private directory %s instead",
            directory,
            problem,
            private,
        )
        return _compile(cc, private / name)
    return _compile(cc, target)


def _compile(cc: str, target: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=".lev_cpu-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *_flags(), str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}:\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)  # whatever the umask: nobody else may write a library we load
        os.replace(tmp, target)  # atomic: a concurrent rank sees no library or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for suffix in ("f32", "f64"):
        fwd = getattr(lib, f"lev_forward_{suffix}")
        fwd.argtypes = [p, p, i64, i64, i64, i64, i64, i64, i64, p, p, p]
        fwd.restype = ctypes.c_int
        bwd = getattr(lib, f"lev_backward_{suffix}")
        bwd.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, p, p]
        bwd.restype = ctypes.c_int
    lib.lev_group_size.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it is switched off or cannot be built (logged once)."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        if os.environ.get(ENV_SWITCH, "1") != "0":
            try:
                try:
                    path = build()
                except OSError as exc:  # e.g. a read-only home on compute nodes: build in the temp dir
                    # (a name another user can guess: build() checks it is ours and private before using it)
                    fallback = Path(tempfile.gettempdir()) / f"megatron_lev-kernels-{os.getuid()}"
                    log.info(
                        "LEV CPU kernel: cannot write %s (%s); building in %s", cache_dir(), exc, fallback
                    )
                    path = build(fallback)
                lib = _bind(ctypes.CDLL(str(path)))
                _state["path"] = path
                if lib.lev_group_size() != GROUP:
                    raise RuntimeError(
                        f"{SOURCE.name} groups {lib.lev_group_size()} factors, lev_constants.py {GROUP}"
                    )
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("LEV CPU kernel unavailable, using the PyTorch path: %s", exc)
        _state["lib"] = lib
        return lib


def available() -> bool:
    return library() is not None


def _pool() -> ThreadPoolExecutor:
    threads = max(1, torch.get_num_threads())
    pool = _state.get("pool")
    if pool is None or _state.get("threads") != threads:
        if pool is not None:
            pool.shutdown(wait=True)  # type: ignore[union-attr]
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lev-cpu")
        _state["pool"], _state["threads"] = pool, threads
    return pool  # type: ignore[return-value]


def _run_tasks(fn, tasks: int, args_for) -> None:
    threads = max(1, torch.get_num_threads())
    step = max(1, -(-tasks // (threads * TASKS_PER_THREAD)))
    ranges = [(t0, min(tasks, t0 + step)) for t0 in range(0, tasks, step)]
    if threads == 1 or len(ranges) == 1:
        codes = [fn(*args_for(t0, t1)) for t0, t1 in ranges]
    else:
        with _lock:
            pool = _pool()
        codes = list(pool.map(lambda r: fn(*args_for(*r)), ranges))
    if any(codes):
        raise MemoryError("LEV CPU kernel: could not allocate its work buffers")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _suffix(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "f32"
    if dtype == torch.float64:
        return "f64"
    raise TypeError(f"LEV CPU kernel: float32 or float64 only, got {dtype}")


def forward(u: torch.Tensor, shifted: torch.Tensor):
    """u (N,h,d) in [0,1] and shifted = 1 + delta (h,d,kappa,r), contiguous on CPU -> out, log_abs, sign,
    each (N, h, r): the spline basis and the separable product in one pass."""
    lib = library()
    n, h, d = u.shape
    kappa, r = shifted.shape[2], shifted.shape[3]
    log_abs, sign, out = (u.new_empty(n, h, r) for _ in range(3))
    fn = getattr(lib, f"lev_forward_{_suffix(u.dtype)}")
    _run_tasks(
        fn,
        n * h,
        lambda t0, t1: (
            u.data_ptr(),
            shifted.data_ptr(),
            n,
            h,
            d,
            kappa,
            r,
            t0,
            t1,
            log_abs.data_ptr(),
            sign.data_ptr(),
            out.data_ptr(),
        ),
    )
    return out, log_abs, sign


def backward(u, shifted, log_abs, grad_m, signed_grad, need_u: bool, need_delta: bool):
    """Gradients for `u` (N,h,d) and `delta` (h,d,kappa,r) (None where not needed)."""
    lib = library()
    n, h, d = u.shape
    kappa, r = shifted.shape[2], shifted.shape[3]
    grad_u = torch.empty_like(u) if need_u else None
    grad_d = torch.zeros_like(shifted) if need_delta else None
    fn = getattr(lib, f"lev_backward_{_suffix(u.dtype)}")
    tasks = h * -(-d // GROUP)
    _run_tasks(
        fn,
        tasks,
        lambda t0, t1: (
            u.data_ptr(),
            shifted.data_ptr(),
            log_abs.data_ptr(),
            grad_m.data_ptr(),
            signed_grad.data_ptr(),
            n,
            h,
            d,
            kappa,
            r,
            t0,
            t1,
            _ptr(grad_u),
            _ptr(grad_d),
        ),
    )
    return grad_u, grad_d
