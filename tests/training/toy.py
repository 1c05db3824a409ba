"""A two-layer language model with the GPTModel call signature, and a Trainer around it."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_lev.config import RunConfig
from megatron_lev.engine.deepspeed_engine import build_engine, disable_cpu_shm_comm
from megatron_lev.parallel import state
from megatron_lev.plan import model_plan
from megatron_lev.plan.ds_config import batch_layout
from megatron_lev.testing.faults import FaultInjection
from megatron_lev.training.callbacks import Checkpointer
from megatron_lev.training.metrics import MetricsWriter
from megatron_lev.training.run import default_callbacks
from megatron_lev.training.schedule import Budget
from megatron_lev.training.trainer import TrainData, Trainer

SEQ = 8


class ToyLM(nn.Module):
    """`forward(input_ids, labels)` -> per-token loss `(B, S)` fp32, like `GPTModel`."""

    def __init__(self, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        reduction: str = "none",
    ) -> torch.Tensor:
        """As `GPTModel`: logits, per-token losses, or (`reduction="mean"`) their masked mean."""
        from megatron_lev.model.loss import masked_mean

        logits = self.head(self.norm(self.embed(input_ids)))  # (B, S, V)
        if labels is None:
            return logits
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        losses = losses.view_as(labels)
        return masked_mean(losses, loss_mask) if reduction == "mean" else losses


def toy_batches(seed: int, micro_batch: int, seq: int, vocab: int = 64, start: int = 0):
    """Deterministic `(input_ids, labels)` micro-batches; `start` skips that many."""
    g = torch.Generator().manual_seed(seed)
    i = 0
    while True:
        tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
        if i >= start:
            yield tokens[:, :-1], tokens[:, 1:]
        i += 1


def toy_config(stage: int, iters: int) -> RunConfig:
    cfg = RunConfig()
    cfg.parallel.zero_stage = stage
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 8  # DP 2 x accumulation 2
    cfg.train.train_iters, cfg.train.lr, cfg.train.min_lr, cfg.train.lr_warmup_iters = iters, 1e-2, 1e-3, 2
    cfg.logging.log_interval, cfg.logging.progress_bar, cfg.logging.tensorboard = 1, False, False
    return cfg


def toy_trainer(
    cfg: RunConfig, out: str, init_seed: int, nan_steps=(), signal_at: int | None = None, watcher=None
) -> Trainer:
    """A Trainer (with the run's default callbacks) over a DeepSpeed engine of ToyLM; rank 1 sends
    itself SIGUSR1 during iteration `signal_at`; `nan_steps` get a NaN loss (`FaultInjection`)."""
    disable_cpu_shm_comm()
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = state.initialize_model_parallel(1, 1)
    torch.manual_seed(init_seed)
    engine = build_engine(model_plan(cfg, world, None), ToyLM(), layout)
    micro, gas, global_batch = batch_layout(cfg, world)

    def batches(consumed: int):
        for k, b in enumerate(toy_batches(100 + rank, micro, SEQ, start=consumed // (micro * world))):
            if signal_at is not None and rank == 1 and consumed // global_batch + k // gas + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            yield b

    ckpt = os.path.join(out, "ckpt")
    checkpointer = Checkpointer.from_config(cfg.train, ckpt, ckpt)
    callbacks = default_callbacks(cfg, MetricsWriter(out, rank == 0, False), checkpointer, watcher=watcher)
    if nan_steps:
        callbacks.append(FaultInjection(nan_steps=nan_steps))
    return Trainer(
        cfg,
        engine,
        Budget(cfg.train.train_iters, global_batch * SEQ, "test"),
        TrainData(batches, None, global_batch),
        callbacks,
        world_size=world,
        device=torch.device("cpu"),
        save_dir=ckpt,
        load_dir=ckpt,
    )


def resume(trainer: Trainer) -> None:
    """Load the newest checkpoint into `trainer` through its Checkpointer, chosen as a run's set-up
    chooses it (`choose_start`, then `Checkpointer.resume`, as `pretrain` does)."""
    from megatron_lev.training.resume import choose_start

    checkpointer = trainer.callback(Checkpointer)
    if not checkpointer.load_dir and not checkpointer.save_dir:
        return
    start = choose_start(
        checkpointer.load_dir, checkpointer.save_dir, trainer.cfg, (), trainer.engine.owned_files()
    )
    checkpointer.resume(trainer, start)


def optimizer_snapshot(optimizer) -> list[torch.Tensor]:
    """This rank's master weights and Adam moments (the ZeRO partitions for stages 1-3)."""
    out = []
    for p, st in optimizer.state.items():
        out.append(p.detach().clone())
        out += [v.detach().clone() for v in st.values() if torch.is_tensor(v)]
    assert out, "no optimizer state yet"
    return out
