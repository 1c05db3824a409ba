"""The training loop over real DeepSpeed engines (ZeRO 0-3, 2 gloo ranks) with a toy model.

Skipped non-finite steps leave weights and Adam moments untouched; a preemption signal
on one rank stops both at the same step with a checkpoint; resuming from it gives the
uninterrupted run's losses.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
import torch.distributed as dist

from megatron_lev.config import RunConfig
from megatron_lev.parallel import state
from megatron_lev.testing.distributed import run_distributed
from megatron_lev.training.ds_config import batch_layout, build_ds_config
from megatron_lev.training.engine import build_engine, disable_cpu_shm_comm
from megatron_lev.training.metrics import MetricsWriter
from megatron_lev.training.schedule import Budget
from megatron_lev.training.signals import PREEMPTED_EXIT_CODE
from megatron_lev.training.trainer import Trainer
from tests.training.toy import ToyLM, toy_batches

SEQ = 8


def _config(stage: int, iters: int) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.zero_stage = stage
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 8  # DP 2 x accumulation 2
    cfg.train.train_iters, cfg.train.lr, cfg.train.min_lr, cfg.train.lr_warmup_iters = iters, 1e-2, 1e-3, 2
    cfg.logging.log_interval, cfg.logging.progress_bar, cfg.logging.tensorboard = 1, False, False
    return cfg


def _trainer(cfg: RunConfig, out: str, init_seed: int, nan_steps=(), signal_at: int | None = None) -> Trainer:
    disable_cpu_shm_comm()
    world, rank = dist.get_world_size(), dist.get_rank()
    if not state.is_initialized():
        state.initialize_model_parallel(1, 1)
    torch.manual_seed(init_seed)
    engine, optimizer = build_engine(cfg, ToyLM(), build_ds_config(cfg, world), pipeline=False)
    micro, gas, global_batch = batch_layout(cfg, world)

    def batches(consumed: int):
        for k, b in enumerate(toy_batches(100 + rank, micro, SEQ, start=consumed // (micro * world))):
            # micro-batch k (0-based, this rank) belongs to iteration consumed/global + k // gas + 1
            if signal_at is not None and rank == 1 and consumed // global_batch + k // gas + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            yield b

    return Trainer(cfg, engine, optimizer, Budget(cfg.train.train_iters, global_batch * SEQ, "test"),
                   pipeline=False, world_size=world, device=torch.device("cpu"), train_batches=batches,
                   valid_batches=None, flops_per_token=None, writer=MetricsWriter(out, rank == 0, False), gas=gas,
                   global_batch=global_batch, save_dir=os.path.join(out, "ckpt"), load_dir=os.path.join(out, "ckpt"),
                   nan_steps=set(nan_steps))


def _snapshot(optimizer) -> list[torch.Tensor]:
    """This rank's master weights and Adam moments (the ZeRO partitions for stages 1-3)."""
    out = []
    for p, st in optimizer.state.items():
        out.append(p.detach().clone())
        out += [v.detach().clone() for v in st.values() if torch.is_tensor(v)]
    assert out, "no optimizer state yet"
    return out


def _skip_and_resume(stage: int, out: str) -> dict:
    # 1. an injected NaN at iteration 2 changes nothing and is counted
    cfg = _config(stage, iters=4)
    tr = _trainer(cfg, os.path.join(out, "nan"), init_seed=0, nan_steps={2})
    batches = tr.make_train_batches(0)
    loss1, _, skipped1 = tr.train_step(batches)
    tr.state.iteration = 1
    before = _snapshot(tr.optimizer)
    loss2, _, skipped2 = tr.train_step(batches)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _snapshot(tr.optimizer)))
    tr.state.iteration = 2
    loss3, _, skipped3 = tr.train_step(batches)
    changed_after = not all(torch.equal(a, b) for a, b in zip(before, _snapshot(tr.optimizer)))

    # 2. uninterrupted 6 iterations vs. preempted at 3 (signal on rank 1 only) and resumed
    cfg = _config(stage, iters=6)
    full = _trainer(cfg, os.path.join(out, "full"), init_seed=0).train()
    first = _trainer(cfg, os.path.join(out, "resume"), init_seed=0, signal_at=3).train()
    second = _trainer(cfg, os.path.join(out, "resume"), init_seed=999)  # weights must come from the checkpoint
    second.resume()
    resumed_from = second.state.iteration
    rest = second.train()
    return {"skipped": (skipped1, skipped2, skipped3), "losses": (loss1, loss2, loss3), "unchanged": unchanged,
            "changed_after": changed_after, "full": full.losses, "first": (first.exit_code, first.iteration),
            "resumed_from": resumed_from, "rest": rest.losses, "rest_exit": rest.exit_code}


def _all_stages(out: str) -> dict:
    return {stage: _skip_and_resume(stage, os.path.join(out, f"zero{stage}")) for stage in (0, 1, 2, 3)}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_skip_preempt_resume_zero_0_to_3(tmp_path):
    results = run_distributed(_all_stages, world_size=2, args=(str(tmp_path),), timeout=220)
    for stage in (0, 1, 2, 3):
        r0, r1 = results[0][stage], results[1][stage]
        for r in (r0, r1):
            assert r["skipped"] == (False, True, False), (stage, r["skipped"])
            assert math.isfinite(r["losses"][0]) and math.isnan(r["losses"][1]) and math.isfinite(r["losses"][2])
            assert r["unchanged"] and r["changed_after"], stage
            assert r["first"] == (PREEMPTED_EXIT_CODE, 3), (stage, r["first"])  # both ranks stop at 3
            assert r["resumed_from"] == 3 and r["rest_exit"] == 0
            for it in (4, 5, 6):
                assert r["rest"][it] == pytest.approx(r["full"][it], abs=1e-6), (stage, it)
        assert r0["full"] == r1["full"]  # the logged loss is the mean over ranks
