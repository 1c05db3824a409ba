"""Preemption flag, skip counting, NaN injection hook, launcher env parsing and metrics files."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from megatron_lev.optim import GuardedAdamW, param_groups
from megatron_lev.testing.faults import INJECT_NAN_ENV, NaNInjector, injected_nan_steps
from megatron_lev.training.health import SkipTracker, TooManySkippedSteps
from megatron_lev.training.metrics import MetricsWriter, read_metrics, throughput
from megatron_lev.training.rendezvous import read_dist_env
from megatron_lev.training.signals import PREEMPTED_EXIT_CODE, PreemptionWatcher


def test_exit_code_is_ex_tempfail():
    assert PREEMPTED_EXIT_CODE == 75


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_the_flag_and_handlers_are_restored(sig):
    before = signal.getsignal(sig)
    with PreemptionWatcher() as w:
        assert not w.should_stop()
        os.kill(os.getpid(), sig)
        assert w.should_stop() and w.received == sig
    assert signal.getsignal(sig) == before


def test_skip_tracker_counts_and_stops_after_the_limit():
    t = SkipTracker(max_consecutive=3)
    for it, skipped in enumerate([True, False, True, True], start=1):
        t.update(skipped, it)
    assert (t.total, t.consecutive) == (3, 2)
    with pytest.raises(TooManySkippedSteps, match="max_consecutive_skips=3"):
        t.update(True, 5)
    restored = SkipTracker(3)
    restored.load_state_dict(t.state_dict())
    assert restored.total == 4


def test_nan_injection_env_and_hook():
    assert injected_nan_steps({INJECT_NAN_ENV: "3, 5"}) == {3, 5}
    assert injected_nan_steps({}) == set()
    with pytest.raises(ValueError, match=INJECT_NAN_ENV):
        injected_nan_steps({INJECT_NAN_ENV: "x"})
    layer = torch.nn.Linear(2, 2)
    inj = NaNInjector(layer)
    assert torch.isfinite(layer(torch.ones(1, 2))).all()
    inj.armed = True
    assert torch.isnan(layer(torch.ones(1, 2))).all()
    inj.remove()


def test_weight_decay_excludes_norms_biases_and_vectors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    assert [p.shape for p in groups["decay"]["params"]] == [torch.Size([4, 4])]
    assert len(groups["no_decay"]["params"]) == 3 and groups["no_decay"]["weight_decay"] == 0.0


def test_guarded_adamw_skips_non_finite_and_forced_steps():
    p = torch.nn.Parameter(torch.ones(3))
    opt = GuardedAdamW([p], lr=0.1)
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    opt.begin_iteration()
    opt.step()
    assert opt.iteration_skipped and torch.equal(p.detach(), torch.ones(3)) and not opt.state
    p.grad = torch.ones(3)
    opt.begin_iteration(force_skip=True)
    opt.step()
    assert opt.iteration_skipped and torch.equal(p.detach(), torch.ones(3))
    opt.begin_iteration()
    opt.step()
    assert not opt.iteration_skipped and not torch.equal(p.detach(), torch.ones(3))


def test_launcher_environments():
    tr = read_dist_env(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    )
    assert (tr.rank, tr.world_size, tr.local_rank, tr.source) == (3, 4, 1, "torchrun")
    sl = read_dist_env(
        {
            "SLURM_PROCID": "2",
            "SLURM_NTASKS": "4",
            "SLURM_STEP_ID": "0",  # started by srun
            "SLURM_LOCALID": "0",
            "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_JOB_ID": "17",
        }
    )
    assert (sl.rank, sl.world_size, sl.master_addr, sl.source) == (2, 4, "n1", "slurm")
    assert read_dist_env({}).world_size == 1
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        read_dist_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_throughput_and_mfu():
    tp = throughput(tokens=1000, seconds=2.0, flops_per_token=1e12, n_devices=4, peak_tflops=100.0)
    assert tp["tokens_per_s"] == 500 and tp["tflops_per_device"] == pytest.approx(125.0)
    assert tp["mfu"] == pytest.approx(1.25)
    assert "mfu" not in throughput(10, 1.0, None, 1, 1.0)


def test_metrics_jsonl_and_tensorboard(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    w.record("train", 1, {"loss": 2.5, "lr": 1e-3}, tokens=64)
    w.record("valid", 1, {"loss": 2.0, "ppl": math.exp(2.0)})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "iter')  # a writer killed mid-line
    rows = read_metrics(tmp_path / "metrics.jsonl", kind="train")
    assert rows == [{"kind": "train", "iteration": 1, "tokens": 64, "loss": 2.5, "lr": 1e-3}]
    assert any((tmp_path / "tensorboard").iterdir())
    MetricsWriter(tmp_path / "other", enabled=False, tensorboard=True).record("train", 1, {"loss": 1.0})
    assert not (tmp_path / "other").exists()


def test_weight_growth_from_sums_of_squares():
    from megatron_lev.training.trainer import growth

    assert growth(4.0, 16.0) == 2.0 and growth(4.0, 4.0) == 1.0
    assert growth(4.0, float("inf")) == float("inf")  # the sum after overflowed: an absurd update
    assert growth(0.0, 1.0) == float("inf") and growth(0.0, 0.0) == 1.0
    assert growth(float("inf"), float("inf")) == 1.0  # nothing can be said: not a refusal
    assert math.isnan(growth(4.0, float("nan")))  # non-finite weights: the other flag says it


def test_squared_norm_sums_every_tensor_of_every_dtype():
    from megatron_lev.optim import squared_norm

    tensors = [torch.full((3, 2), 2.0), torch.full((5,), 1.0, dtype=torch.bfloat16), torch.zeros(0)]
    assert squared_norm(tensors).item() == pytest.approx(6 * 4.0 + 5 * 1.0)
    assert squared_norm([]).item() == 0.0


def test_exit_kind_says_whether_a_restart_can_cure_the_exit(tmp_path, monkeypatch):
    """The launchers restart a "crash" and never a "fatal" exit: each class of error, and a report
    written where the launcher reads it."""
    import errno

    from megatron_lev.errors import CheckpointDataError, ConfigError, DataError, DistributedError
    from megatron_lev.training.signals import EXIT_DIR_ENV, exit_kind, report_exit_code

    assert exit_kind(0) == "done" and exit_kind(75) == "preempted"
    assert exit_kind(3) == "fatal"  # the run's own health checks stopped it: a restart replays the same
    for exc in (ConfigError("x"), DataError("x"), CheckpointDataError("x"), FileNotFoundError(2, "x", "f")):
        assert exit_kind(1, exc) == "fatal", exc
    assert exit_kind(1, OSError(errno.ENOSPC, "full")) == "fatal"
    assert exit_kind(1, DistributedError("rank 1 stopped answering")) == "crash"
    assert exit_kind(1, RuntimeError("NCCL error: unhandled system error")) == "crash"
    assert exit_kind(1, OSError(errno.ECONNRESET, "reset")) == "crash"
    monkeypatch.setenv(EXIT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    report_exit_code(1, exit_kind(1, RuntimeError("CUDA error")))
    assert (tmp_path / "rank3").read_text() == "1 crash\n"
    report_exit_code(2)
    assert (tmp_path / "rank3").read_text() == "2 fatal\n"
