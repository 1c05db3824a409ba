"""Shared fixtures. Real data lives in ../shared/data (tests skip nothing when it is present)."""

from __future__ import annotations

import os
import shutil
import tempfile
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


# ------------------------------------------------------------------------------------------ test tiers
# `make test-quick` runs `-m "not multiprocess and not slurm and not slow"`. `multiprocess` and `slurm`
# are marked in the test files; `slow` is given here, in one place, to the tests that train a model or
# drive a pipeline of subprocesses on one process: whole modules, the tests that use a fixture that
# trains, and single tests. `make test` runs every tier.
SLOW_MODULES = (
    "test_install.py",  # pip-installs the package into a fresh site, then trains with it
    "training/test_numbers_fixed.py",  # three recorded trainings, bit for bit
    "model/test_triton_kernel.py",  # compiles the Triton kernels in a subprocess per test
    "model/test_compile.py",  # torch.compile with inductor on CPU: about a minute a model
    "reliability/test_clean_log.py",
    "reliability/test_concurrency.py",
    "reliability/test_io_faults.py",
    "reliability/test_memory.py",
    "reliability/test_provenance.py",
    "reliability/test_weights.py",
)
SLOW_FIXTURES = frozenset(
    {
        "trained",  # reliability/test_checkpoint.py's trained run (and `run_copy`, a copy of it)
        "run_copy",
        "ds_checkpoints",  # convert/: DeepSpeed checkpoints trained by gloo processes
        "single_rank_results",  # training/: runs of the real trainer
        "two_rank_results",
        "installed",  # test_install.py's pip install
    }
)
SLOW_TESTS = (
    "training/test_callbacks.py::test_wandb_offline_mirrors_the_logged_metrics",
    "training/test_callbacks.py::test_a_callback_that_does_not_import_stops_train_at_start_in_one_line",
    "reliability/test_data.py::test_worker_failure_stops_the_run_cleanly",
    "reliability/test_data.py::test_signals_never_hang_or_orphan_workers",
    "reliability/test_leftovers.py::test_a_rerun_after_a_skip_limit_stop_stays_non_zero_and_says_why",
    "reliability/test_checkpoint.py::test_signal_during_start_up_exits_75",
    "reliability/test_checkpoint.py::test_torchrun_local_rank_killed_at_start_up_is_a_failure",
    "reliability/test_checkpoint.py::test_disk_full_during_save_names_the_path_and_keeps_the_previous",
)


# A whole run holds up to about 3.2 GiB under the temporary directory at once (the disk's growth over
# a run with pyproject's tmp_path_retention_policy = "failed"; 9.9 GiB when every directory is kept).
PEAK_TMP_GIB = 3.2


def pytest_report_header(config):
    """One line on the temporary directory's free space; a second line when it has less than twice that.

    Only a warning: a selection of tests needs much less than the whole run, and a full disk shows
    itself as `No space left on device` in the tests that write, which this line then explains."""
    given = config.getoption("basetemp", None)
    where = Path(given or os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()).absolute()
    probe = where
    while not probe.exists() and probe != probe.parent:  # --basetemp is made later
        probe = probe.parent
    free_gib = shutil.disk_usage(probe).free / 2**30
    lines = [
        f"temporary directory: {where}, {free_gib:.1f} GiB free (a whole run holds up to {PEAK_TMP_GIB} GiB)"
    ]
    if free_gib < 2 * PEAK_TMP_GIB:
        lines.append(
            f"WARNING: {where} has {free_gib:.1f} GiB free; tests that write checkpoints may fail with "
            "'No space left on device': free space there or give --basetemp on a larger disk"
        )
    return lines


def pytest_configure(config):
    tests = Path(__file__).resolve().parent
    named = (*SLOW_MODULES, *(t.split("::")[0] for t in SLOW_TESTS))
    missing = [p for p in named if not (tests / p).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py names test files that are not there: {missing}")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    for item in items:
        rel = Path(item.fspath).resolve().relative_to(tests).as_posix()
        name = f"{rel}::{item.originalname or item.name}"
        if rel in SLOW_MODULES or name in SLOW_TESTS or SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)
