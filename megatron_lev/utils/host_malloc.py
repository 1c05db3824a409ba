"""Keep glibc from handing a CPU training step's large buffers back to the kernel after every use.

glibc serves an allocation above its mmap threshold (at most 32 MiB on 64-bit) with a fresh `mmap`
and unmaps it on free, so the next step's buffer of the same size is new zero-filled pages again. A
CPU step over GPT-NeoX's vocabulary allocates several such buffers (the logits of one micro-batch
of 8 x 256 tokens are 412 MB in fp32, the table's gradient 39 MB). With `M_MMAP_MAX` 0 every
allocation comes from the heap, and with `M_TRIM_THRESHOLD` at -1 (mallopt(3): no trimming) freed
memory stays there for the next step. A finite threshold is not enough: the regime trainer frees
about 1.6 GB at the top of its heap at once, so a 1 GiB threshold gave the heap back every step
(326,000 page faults and 1.3 s of system time a step, as with glibc's defaults).

Measured (`benchmarks/bench_host_malloc.py`, `benchmarks/results/host_malloc.md`), on the regime
experiment's model shape: system time 1.2-1.5 s -> under 0.02 s per step, page faults about 340,000
-> 0 per step, the step's CPU time 1.57x (TIED) and 1.45x (LEV) lower, losses bit-identical.
torch's own switch, transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`), cuts the faults 50-fold but
not the system time. The cost is memory: the heap stays near its peak between steps and grows with
the variety of buffers (peak RSS 1.75 instead of 1.50 GiB in the benchmark; in the regime runs,
which also evaluate, the trainers' RSS reached 3.1 GiB (LEV) and 4.4 GiB (TIED) against a memory
estimate of about 2.0 GiB).

Hence opt-in: `MEGATRON_LEV_HOST_MALLOC=1` makes `train` call it on CPU (never with CUDA, whose
caching allocator holds the large buffers); `python -m studies run` sets it for its runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV_SWITCH = "MEGATRON_LEV_HOST_MALLOC"  # "1": `train` on CPU keeps freed memory (default: glibc's)
M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's malloc.h
M_MMAP_MAX = -4
# mallopt(3): -1 turns trimming off (glibc stores it as SIZE_MAX; an int cannot say more than 2 GiB)
TRIM_THRESHOLD = -1


def keep_freed_memory(force: bool = False) -> bool:
    """With MEGATRON_LEV_HOST_MALLOC=1 (or `force`), set glibc's `M_MMAP_MAX` to 0 and
    `M_TRIM_THRESHOLD` to -1 (never trim) for this process and the processes it forks. Returns whether it did
    (False without the switch, or off glibc)."""
    if not force and os.environ.get(ENV_SWITCH, "0") != "1":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl and others have other knobs
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
