"""Everything the training tests run inside spawned gloo processes, grouped so each world starts once.

Start-up (importing torch, DeepSpeed, dynamo) costs far more than these tiny runs, so
the 1-rank and the 2-rank work each run in one group (session fixtures in conftest.py)
and the test modules assert on the returned results.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_lev.ckpt.layout import verify_checkpoint
from megatron_lev.config import load_config
from megatron_lev.model.embeddings import REGISTRY
from megatron_lev.testing.faults import FaultInjection
from megatron_lev.training.hooks import Control
from megatron_lev.training.metrics import read_metrics
from megatron_lev.training.signals import PreemptionWatcher
from tests.training.conftest import TINY, tiny_overrides, train_losses
from tests.training.toy import optimizer_snapshot, resume, toy_config, toy_trainer

NAN_STAGES = ("0", "1", "2", "3", "3-offload")
LAYOUTS = {
    "zero1": {"parallel.zero_stage": 1},
    "zero2": {"parallel.zero_stage": 2},
    "zero3": {"parallel.zero_stage": 3},
    "zero1_async": {"parallel.zero_stage": 1, "train.async_save": True},  # saves completed on threads
    "pp2_bf16": {
        "parallel.pipeline_model_parallel_size": 2,
        "parallel.zero_stage": 1,
        "train.precision": "bf16",
    },
}


def _pretrain(overrides: list[str]):
    return pretrain_config(load_config([TINY], overrides))


def pretrain_config(cfg, **kwargs):
    """`pretrain` as `megatron-lev train` runs it: the plan validated for the launcher's world first."""
    from megatron_lev.plan import validate_run
    from megatron_lev.training.rendezvous import read_dist_env
    from megatron_lev.training.run import pretrain

    return pretrain(validate_run(cfg, read_dist_env().world_size, cuda=False), **kwargs)


# ---------------------------------------------------------------- one rank


def single_rank_suite(prefix: str, tok: str, out: str, reference_overrides: list[str]) -> dict:
    variants = {}
    for emb in tuple(REGISTRY):
        res = _pretrain(
            tiny_overrides(
                prefix,
                tok,
                Path(out) / emb,
                **{
                    "model.embedding": emb,
                    "train.train_iters": 10,
                    "train.lr": 1e-2,
                    "train.lr_warmup_iters": 1,
                },
            )
        )
        variants[emb] = (res.exit_code, res.losses)
    reference = _pretrain(reference_overrides)
    return {"variants": variants, "reference": reference.losses}


# ---------------------------------------------------------------- two ranks


def _nan_step_leaves_state_untouched(stage: str, out: str) -> dict:
    cfg = toy_config(int(stage[0]), iters=4)
    cfg.parallel.cpu_offload = stage.endswith("offload")
    tr = toy_trainer(cfg, out, init_seed=0, nan_steps={2})
    faults = tr.callback(FaultInjection)
    faults.on_train_begin(tr, Control())
    batches = tr.data.train(0)

    def step(iteration: int):
        faults.on_step_begin(tr, iteration)
        out = tr.train_step(batches)
        faults.on_step_end(tr, iteration, out[2], Control())
        tr.state.iteration = iteration
        return out

    first = step(1)
    before = optimizer_snapshot(tr.engine.optimizer)
    second = step(2)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, optimizer_snapshot(tr.engine.optimizer)))
    third = step(3)
    changed = not all(torch.equal(a, b) for a, b in zip(before, optimizer_snapshot(tr.engine.optimizer)))
    return {
        "steps": [(loss, skipped) for loss, _, skipped in (first, second, third)],
        "unchanged": unchanged,
        "changed_after": changed,
    }


def _preempt_one_rank_and_resume(out: str) -> dict:
    cfg = toy_config(1, iters=6)
    full = toy_trainer(cfg, os.path.join(out, "full"), init_seed=0).train()
    first = toy_trainer(cfg, os.path.join(out, "resume"), init_seed=0, signal_at=3).train()
    second = toy_trainer(
        cfg, os.path.join(out, "resume"), init_seed=999
    )  # weights must come from the checkpoint
    resume(second)
    resumed_from = second.state.iteration
    rest = second.train()
    return {
        "full": full.losses,
        "first": (first.exit_code, first.iteration),
        "resumed_from": resumed_from,
        "rest": rest.losses,
        "rest_exit": rest.exit_code,
    }


def _preempted_during_startup(out: str) -> tuple[int, int]:
    watcher = PreemptionWatcher()  # installed by pretrain() before start-up in real runs
    if dist.get_rank() == 1:
        watcher.received = signal.SIGUSR1  # the notice reached rank 1 while it was still building
    res = toy_trainer(toy_config(1, iters=4), out, init_seed=0, watcher=watcher).train()
    return res.exit_code, res.iteration


def _skip_limit(out: str) -> dict:
    cfg = toy_config(1, iters=6)
    cfg.train.max_consecutive_skips = 2
    res = toy_trainer(cfg, out, init_seed=0, nan_steps={2, 3}).train()
    ckpt = Path(out) / "ckpt"
    return {
        "exit": res.exit_code,
        "iteration": res.iteration,
        "skipped": res.skipped_steps,
        "latest": (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None,
    }


def _save_and_resume(prefix: str, tok: str, out: Path, extra: dict) -> dict:
    over = tiny_overrides(
        prefix,
        tok,
        out,
        **{
            "train.train_iters": 4,
            "train.save_interval": 2,
            "train.global_batch_size": 8,
            "train.eval_interval": 2,
            "train.eval_iters": 1,
            **extra,
        },
    )
    full = _pretrain(over)
    if dist.get_rank() == 0:  # pretend the save at iteration 4 was killed half-way: no completion marker
        (out / "ckpt" / "iter_0000004" / "complete").unlink()
    dist.barrier()
    resumed = _pretrain(over)
    result = {
        "full": full.losses,
        "resumed": resumed.losses,
        "codes": (full.exit_code, resumed.exit_code),
        "latest": (out / "ckpt" / "latest").read_text().strip(),
        # collective: the ranks share the checksums
        "verified": {p.name: verify_checkpoint(p) for p in sorted((out / "ckpt").glob("iter_*"))},
    }
    if dist.get_rank() == 0:
        result["logged"] = train_losses(out)
        result["valid"] = read_metrics(out / "metrics.jsonl", kind="valid")
    return result


def two_rank_suite(prefix: str, tok: str, out: str) -> dict:
    out = Path(out)
    return {
        "nan": {
            stage: _nan_step_leaves_state_untouched(stage, str(out / f"nan{stage}")) for stage in NAN_STAGES
        },
        "preempt": _preempt_one_rank_and_resume(str(out / "preempt")),
        "skip_limit": _skip_limit(str(out / "skip_limit")),
        "early_signal": _preempted_during_startup(str(out / "early")),
        "layouts": {
            name: _save_and_resume(prefix, tok, out / name, extra) for name, extra in LAYOUTS.items()
        },
    }
