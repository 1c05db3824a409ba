"""`utils.host_malloc.keep_freed_memory`, which `train` calls on CPU: with MEGATRON_LEV_HOST_MALLOC=1,
once the heap has grown to a step's peak, the step's large buffers, freed and allocated again, are
served from it without their pages being faulted in anew; without it glibc's default (a fresh mmap
for every such buffer) stays."""

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
for step in range(10):  # a step: buffers of 64, 32 and 80 MiB (above glibc's 32 MiB mmap ceiling)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 << 20); y = torch.ones(8 << 20); del x; z = torch.ones(20 << 20); del y, z
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sum(faults[-3:]))  # the last three steps
"""


def _probe(switch: str) -> tuple[bool, int]:
    env = {**os.environ, "MEGATRON_LEV_HOST_MALLOC": switch, "PYTHONPATH": str(ROOT)}
    env.pop("GLIBC_TUNABLES", None)
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


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
    pages = 3 * (176 << 20) // os.sysconf("SC_PAGE_SIZE")  # the last three steps' buffers
    assert applied and not default_applied
    if not _thp_always():
        assert default_faults > pages // 2, (
            f"glibc's default should fault the buffers in again: {default_faults}"
        )
    # the heap's layout depends on what the interpreter allocated before: allow one buffer's worth
    assert faults < default_faults // 10, f"{faults} page faults against {default_faults} by default"
