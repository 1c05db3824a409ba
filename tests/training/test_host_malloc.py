"""`utils.host_malloc.keep_freed_memory`, which `train` calls on CPU: with MEGATRON_LEV_HOST_MALLOC=1,
once the heap has grown to a step's peak, the step's large buffers, freed and allocated again, are
served from it without their pages being faulted in anew; without it glibc's default (a fresh mmap
for every such buffer) stays.

How many steps the heap takes to reach its peak depends on where the interpreter's own small
allocations land between the buffers: here it grew over the first 3-6 of 10 steps (twelve probes),
and once, in a full suite, 96 MiB were faulted in over steps 8-10. So the probe runs
20 steps and the test asks what the switch promises: steps served wholly from the heap, and a
bounded growth where glibc's default faults every step in again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import resource
import torch
from megatron_lev.utils.host_malloc import keep_freed_memory
applied = keep_freed_memory()
faults = []
for step in range(20):  # a step: buffers of 64, 32 and 80 MiB (above glibc's 32 MiB mmap ceiling)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 << 20); y = torch.ones(8 << 20); del x; z = torch.ones(20 << 20); del y, z
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults[-10:])  # the last ten steps
"""


def _probe(switch: str) -> tuple[bool, list[int]]:
    env = {**os.environ, "MEGATRON_LEV_HOST_MALLOC": switch, "PYTHONPATH": str(ROOT)}
    env.pop("GLIBC_TUNABLES", None)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    applied, *faults = out.stdout.split()
    return applied == "True", [int(f) for f in faults]


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


def _thp_always() -> bool:
    """Transparent huge pages for every mapping: glibc's default then faults a buffer in 2 MiB at a
    time, so its fault count is small."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.is_file() and "[always]" in path.read_text()


@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt: glibc only")
def test_a_freed_large_buffer_is_reused_without_page_faults():
    applied, faults = _probe("1")
    default_applied, default_faults = _probe("0")
    step = (176 << 20) // os.sysconf("SC_PAGE_SIZE")  # one step's buffers, in pages
    assert applied and not default_applied
    if not _thp_always():
        assert min(default_faults) > step // 2, (
            f"glibc's default should fault the buffers in again every step: {default_faults}"
        )
    # served from the heap: at least one of the last five steps faults (next to) nothing in
    assert min(faults[-5:]) < step // 100, f"page faults of the last steps: {faults}"
    # and the heap's growth is bounded: the last ten steps fault in a fifth of what the default does
    assert sum(faults) < sum(default_faults) // 5, f"{faults} page faults against {default_faults} by default"
