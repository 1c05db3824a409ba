"""Preprocess workers that fail at a chosen chunk, for tests: `PreprocessFault`, installed with
`megatron_lev.data.preprocess.set_chunk_hook`. It imports no torch, so the workers stay light.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PreprocessFault:
    """A preprocess worker's fault at chunk `at` (the chunk id): "raise" (a RuntimeError), "exit"
    (the worker dies with status 3) or "sleep" (it stalls for 600 s), e.g.
    `set_chunk_hook(PreprocessFault("raise", 1))`."""

    kind: str
    at: int

    def __post_init__(self) -> None:
        if self.kind not in ("raise", "exit", "sleep"):
            raise ValueError(f"PreprocessFault kind {self.kind!r} must be raise, exit or sleep")

    @classmethod
    def parse(cls, text: str) -> PreprocessFault:
        """`"raise:1"` -> PreprocessFault("raise", 1)."""
        kind, _, at = text.partition(":")
        return cls(kind, int(at))

    def __call__(self, chunk_id: int) -> None:
        if chunk_id != self.at:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at chunk {chunk_id}")
        if self.kind == "exit":
            os._exit(3)
        time.sleep(600)
