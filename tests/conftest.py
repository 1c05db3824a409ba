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


# Directories whose conftest builds session fixtures (a trained run, DeepSpeed checkpoints, a
# preprocessed corpus, the Slurm test cluster) that several of their files use.
SHARED_FIXTURE_DIRS = ("tests/analysis/", "tests/convert/", "tests/data/", "tests/slurm/", "tests/training/")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`) a test file runs on one worker,
    so its module fixtures are built once, and the files of a directory in SHARED_FIXTURE_DIRS run
    on one worker, so its session fixtures are too. A test's own `xdist_group` mark wins. Without
    xdist the marks change nothing."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::", 1)[0]
            group = next((d for d in SHARED_FIXTURE_DIRS if path.startswith(d)), path)
            item.add_marker(pytest.mark.xdist_group(group))
