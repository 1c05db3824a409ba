"""Runs of the real trainer on synthetic batches, in any layout, for the layout-equality tests.

`synthetic_batches(dp, dp_rank, ...)` deals the same global batches to every layout (micro-batch k
goes to data-parallel rank k % dp); `train_synthetic(cfg, out, ...)` builds the model and engine as
`megatron-lev train` does and runs `Trainer` with the run's default callbacks on the calling ranks
(already joined by `run_distributed`); rank 0 returns its `train` lines.
"""

from __future__ import annotations

from pathlib import Path

import torch


def synthetic_batches(dp: int, dp_rank: int, vocab: int, micro: int, seq: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = 0
    while True:
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        if k % dp == dp_rank:
            yield tokens[:, :-1], tokens[:, 1:]
        k += 1


def train_synthetic(cfg, out: str, vocab: int) -> list[dict] | None:
    """Train `cfg` (its `train_iters`, micro-batch, global batch and sequence) on synthetic batches."""
    import torch.distributed as dist

    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine, disable_cpu_shm_comm
    from megatron_lev.parallel import state
    from megatron_lev.plan import validate_run
    from megatron_lev.training.metrics import MetricsWriter, read_metrics
    from megatron_lev.training.run import default_callbacks
    from megatron_lev.training.schedule import Budget
    from megatron_lev.training.trainer import TrainData, Trainer

    disable_cpu_shm_comm()
    world, rank = dist.get_world_size(), dist.get_rank()
    p, t, seq = cfg.parallel, cfg.train, cfg.model.seq_length
    layout = state.initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    plan = validate_run(cfg, world, cuda=False).with_vocab(vocab)
    engine = build_engine(plan, build_model(plan.model_spec, layout), layout)
    data = synthetic_batches(layout.dp, layout.dp_rank, vocab, t.micro_batch_size, seq)
    global_batch = plan.global_batch
    writer = MetricsWriter(out, rank == 0, cfg.logging.tensorboard)
    trainer = Trainer(
        cfg,
        engine,
        Budget(t.train_iters, global_batch * seq, "test"),
        TrainData(lambda consumed: data, None, global_batch),
        default_callbacks(cfg, writer, None, vocab_size=vocab, layout=layout),
        world_size=world,
        device=torch.device("cpu"),
    )
    try:
        result = trainer.train()
    finally:
        writer.close()
    assert result.exit_code == 0
    return read_metrics(Path(out) / "metrics.jsonl", "train") if rank == 0 else None
