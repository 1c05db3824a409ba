"""A real trainer process killed with SIGKILL, resumed, then stopped by SIGTERM (exit 75, checkpoint).

The per-step losses in metrics.jsonl must equal an uninterrupted run's (same config,
run in the single-rank suite) to 1e-6 on CPU in fp32.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from megatron_lev.ckpt.layout import list_checkpoints
from megatron_lev.training.signals import PREEMPTED_EXIT_CODE
from tests.training.conftest import ROOT, kill_overrides, train_command, train_env, train_losses

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def _launch(overrides: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        train_command(1, overrides),
        cwd=ROOT,
        env=train_env(),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def _wait_for(proc: subprocess.Popen, condition, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before the condition was met")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the trainer")
        time.sleep(0.02)


def _logged_iterations(out: Path) -> int:
    return max(train_losses(out), default=0) if (out / "metrics.jsonl").exists() else 0


def test_sigkill_resume_then_sigterm_matches_uninterrupted(
    single_rank_results, minipile_prefix, tokenizer_path, tmp_path
):
    out = tmp_path / "run"
    over = kill_overrides(minipile_prefix, tokenizer_path, out)
    ckpt = out / "ckpt"

    # 1. SIGKILL as soon as the checkpoint of iteration 2 is complete
    proc = _launch(over, tmp_path / "kill.log")
    _wait_for(proc, lambda: (ckpt / "iter_0000002" / "complete").exists())
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    killed_at = _logged_iterations(out)
    assert killed_at < 16, "the run finished before it was killed"

    # 2. resume; SIGTERM once it is past where it was killed: finish the step, save, exit 75
    proc = _launch(over, tmp_path / "term.log")
    _wait_for(proc, lambda: _logged_iterations(out) >= killed_at + 2)
    proc.send_signal(signal.SIGTERM)
    log = (tmp_path / "term.log").read_text
    assert proc.wait(120) == PREEMPTED_EXIT_CODE, log()[-3000:]
    assert "resumed from" in log() and "preempted at iteration" in log()
    stopped_at = _logged_iterations(out)
    assert killed_at < stopped_at < 16, "the run finished before SIGTERM arrived"

    # the preemption checkpoint is complete, pointed to, and loads (DeepSpeed's model-states file)
    tag = f"iter_{stopped_at:07d}"
    assert (ckpt / "latest").read_text().strip() == tag
    assert stopped_at in [c.iteration for c in list_checkpoints(ckpt) if c.complete]
    states = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert states["train_state"]["iteration"] == stopped_at
    assert states["train_state"]["consumed_samples"] == stopped_at * 2
    assert (ckpt / tag / "rng_state_rank0.pt").is_file()

    # every logged step, including those after the SIGKILL resume, equals the uninterrupted run
    reference = single_rank_results["reference"]
    resumed = train_losses(out)
    assert sorted(resumed) == list(range(1, stopped_at + 1))
    for it in range(1, stopped_at + 1):
        assert resumed[it] == pytest.approx(reference[it], abs=1e-6), (it, resumed[it], reference[it])
