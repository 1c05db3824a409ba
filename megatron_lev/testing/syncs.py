"""Count the places where Python reads a tensor's value: each one is a host sync on a GPU.

    with HostReads() as reads:
        trainer.train_step(batches)
    reads.total, reads.by_site   # e.g. 1, {".../optim/adamw.py:83 item": 1}

`.item()`, `float(t)`, `int(t)`, `bool(t)` (an `if` on a tensor), `.tolist()` and `.cpu()`
are patched on `torch.Tensor` while the block runs, so the count works on CPU
where nothing waits: it sees the same Python calls a CUDA run would make. Syncs inside
C++ (`torch.unique`'s output size, boolean-mask indexing) are not seen here; on a GPU,
`torch.cuda.set_sync_debug_mode("warn")` sees those too (benchmarks/gpu_acceptance.py).
"""

from __future__ import annotations

import collections
import os
import sys

import torch

# reads of tensors that live on the host even in a GPU run: torch's optimizers keep their
# `step` counter on the CPU (unless capturable or fused) and read it with `_get_value`
HOST_RESIDENT = {"_get_value": "optimizer.py"}
READS = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")  # `.numpy()` works on host tensors only


class HostReads:
    """Context manager counting tensor-to-host reads, by call site (`path:line method`)."""

    def __init__(self) -> None:
        self.by_site: collections.Counter[str] = collections.Counter()
        self.host_resident: collections.Counter[str] = collections.Counter()  # not syncs on a GPU either
        self._saved: dict[str, object] = {}

    @property
    def total(self) -> int:
        return sum(self.by_site.values())

    def _wrap(self, name: str, original):
        def counted(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            code = frame.f_code
            site = f"{code.co_filename}:{frame.f_lineno} {name}"
            if (
                code.co_name in HOST_RESIDENT
                and os.path.basename(code.co_filename) == HOST_RESIDENT[code.co_name]
            ):
                self.host_resident[site] += 1
            else:
                self.by_site[site] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def __enter__(self) -> HostReads:
        for name in READS:
            self._saved[name] = vars(torch.Tensor).get(name)  # None: inherited from the C base class
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name, own in self._saved.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)
        self._saved.clear()

    def count(self, path_part: str) -> int:
        """Reads from call sites whose file path contains `path_part` (e.g. "megatron_lev")."""
        return sum(n for site, n in self.by_site.items() if path_part in site.rsplit(":", 1)[0])

    def summary(self) -> str:
        """One `file:line method xN` entry per site, shortest file names."""
        return (
            ", ".join(f"{os.path.basename(site)} x{n}" for site, n in sorted(self.by_site.items())) or "none"
        )
