"""Shared fixtures. Real data lives in ../shared/data (tests skip nothing when it is present)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))


def shared_data_dir() -> Path:
    """`../shared/data` beside the checkout, or $MEGATRON_LEV_SHARED_DATA."""
    env = os.environ.get("MEGATRON_LEV_SHARED_DATA")
    return Path(env) if env else ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not path.is_dir():
        pytest.fail(f"shared test data not found at {path}; set MEGATRON_LEV_SHARED_DATA")
    return path
