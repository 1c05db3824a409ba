"""Host syncs per training step, counted on CPU by patching the tensor-to-Python reads.

A real step (GPTModel, DeepSpeed ZeRO-1, the guarded AdamW, 2 micro-batches) on one gloo
rank. On a GPU each counted read waits for the device; the project's own code may read
only the guard's flag (one per `optimizer.step()` call) in a step, also in a step whose norms the
engine measures for the training dynamics, and the losses and the dynamics once each per log
line. Clipping (`engine.clipping`, here also by clip group: LEV's seed side and the head) reads
nothing: its norms and factors stay on the device and are read with the losses.
DeepSpeed's ZeRO optimizer reads its norm-validity check itself (listed, not ours).
`torch.unique`'s size is a sync in C++ and is counted on the GPU only
(benchmarks/gpu_acceptance.py).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from megatron_lev.testing.syncs import HostReads

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

VOCAB, SEQ, MICRO, STEPS, LOG_INTERVAL = 500, 16, 2, 7, 3
VARIANTS = {
    "lev": ["model.embedding=lev"],
    "tied": ["model.embedding=tied"],
    "lev-clipgroups": [
        "model.embedding=lev",
        "model.lev.seed_clip_grad=0.01",
        "train.clip_groups=[{name: head, patterns: [output_head.*], max_norm: 0.1}]",
    ],
}
OURS = os.sep + "megatron_lev" + os.sep


def _tiny(variant: str):
    from megatron_lev.config import load_config
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_plan
    from megatron_lev.training.metrics import MetricsWriter
    from megatron_lev.training.run import default_callbacks
    from megatron_lev.training.schedule import Budget
    from megatron_lev.training.trainer import TrainData, Trainer
    from tests.training.conftest import TINY

    cfg = load_config(
        [TINY],
        [
            *VARIANTS[variant],
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.num_attention_heads=2",
            f"model.seq_length={SEQ}",
            "model.lev.d_seed=8",
            "model.lev.heads=2",
            "model.lev.rank=4",
            "model.lev.kappa=4",
            f"train.micro_batch_size={MICRO}",
            f"train.global_batch_size={2 * MICRO}",
            f"train.train_iters={STEPS}",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            f"logging.log_interval={LOG_INTERVAL}",
        ],
    )
    plan = model_plan(cfg, 1, VOCAB)
    engine = build_engine(plan, build_model(plan.model_spec, SINGLE), SINGLE)
    gen = torch.Generator().manual_seed(0)

    def batches(consumed: int = 0):
        while True:
            tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen)
            yield tokens[:, :-1], tokens[:, 1:]

    writer = MetricsWriter(tempfile.mkdtemp(), True, False)
    return Trainer(
        cfg,
        engine,
        Budget(STEPS, 2 * MICRO * SEQ, "test"),
        TrainData(batches, None, 2 * MICRO),
        default_callbacks(cfg, writer, None, flops_per_token=1e6),
        world_size=1,
        device=torch.device("cpu"),
    )


def count_reads() -> dict:
    """Runs in a spawned gloo process: reads per step and over a whole `train()`, by origin."""
    from megatron_lev.engine.deepspeed_engine import disable_cpu_shm_comm

    disable_cpu_shm_comm()  # one process: the single layout needs no process groups
    out = {}
    for embedding in VARIANTS:
        tr = _tiny(embedding)
        batches = tr.data.train(0)
        tr.device_step(batches)  # the first step creates the optimizer state
        steps = []
        for _ in range(3):
            with HostReads() as reads:
                tr.device_step(batches)
            steps.append(
                {
                    "ours": reads.count(OURS),
                    "deepspeed": reads.count(os.sep + "deepspeed" + os.sep),
                    "total": reads.total,
                    "guard_calls": tr.engine.optimizer.calls,
                    "sites": reads.summary(),
                }
            )
        tr.engine.measure_next_step(("embedding.",))
        with HostReads() as reads:
            tr.device_step(batches)
        measured = {
            "ours": reads.count(OURS),
            "guard_calls": tr.engine.optimizer.calls,
            "sites": reads.summary(),
        }
        measured["taken"] = tr.engine.step_measurement() is not None
        loop = _tiny(embedding)
        with HostReads() as reads:
            result = loop.train()
        out[embedding] = {
            "steps": steps,
            "measured": measured,
            "loop_ours": reads.count(OURS),
            "loop_dynamics": reads.count(os.sep + "training" + os.sep + "dynamics.py"),
            "loop_sites": reads.summary(),
            "loop_guard_calls": loop.engine.optimizer.calls,
            "losses": sorted(result.losses),
            "exit": result.exit_code,
        }
    return out


@pytest.fixture(scope="module")
def reads():
    from megatron_lev.testing.distributed import run_distributed

    (res,) = run_distributed(count_reads, world_size=1, timeout=240)
    return res


@pytest.mark.parametrize("embedding", list(VARIANTS))
def test_a_step_reads_only_the_guard_flag(reads, embedding):
    for step in reads[embedding]["steps"]:
        assert step["guard_calls"] >= 1
        assert step["ours"] == step["guard_calls"], step[
            "sites"
        ]  # one flag per optimizer.step(), nothing else
        assert step["total"] == step["ours"] + step["deepspeed"], step["sites"]  # no other library reads


@pytest.mark.parametrize("embedding", list(VARIANTS))
def test_a_measured_step_reads_nothing_more(reads, embedding):
    m = reads[embedding]["measured"]
    assert m["taken"] and m["guard_calls"] >= 1
    assert m["ours"] == m["guard_calls"], m["sites"]


@pytest.mark.parametrize("embedding", list(VARIANTS))
def test_the_loop_reads_losses_once_per_log_line(reads, embedding):
    r = reads[embedding]
    assert r["exit"] == 0 and r["losses"] == list(range(1, STEPS + 1))  # every loss still recorded
    log_lines = len({*range(LOG_INTERVAL, STEPS + 1, LOG_INTERVAL), STEPS})
    weight_check = 1  # the finiteness of the weights before the first step
    dynamics = 1  # training.dynamics: the measured step's norms and the table statistics, one read
    assert r["loop_ours"] == r["loop_guard_calls"] * STEPS + log_lines * (1 + dynamics) + weight_check, r[
        "loop_sites"
    ]
    assert r["loop_dynamics"] == log_lines, r["loop_sites"]  # none between log lines


def test_host_reads_counts_and_restores():
    t = torch.tensor([1.5])
    with HostReads() as reads:
        float(t), t.item(), bool(t > 0), t.tolist(), int(t)
        t.numpy()  # host memory only: never a device sync, not counted
    assert reads.total == 5 and reads.count("test_host_syncs") == 5
    with HostReads() as again:
        pass
    float(t)
    assert again.total == 0 and "Tensor" in type(t).__name__


def test_the_loader_checks_token_ids_on_the_host():
    from megatron_lev.data.batches import token_batches

    loader = [{"tokens": torch.tensor([[1, 2, 3], [4, 5, 9]])}]
    ((x, y),) = token_batches(loader, torch.device("cpu"), vocab_size=10)
    assert x.shape == (2, 2) and y.tolist() == [[2, 3], [5, 9]]
    with pytest.raises(IndexError, match="token id 9 is outside the vocabulary"):
        list(token_batches(loader, torch.device("cpu"), vocab_size=9))
