"""Cost of the training machinery: the Trainer on a DeepSpeed engine vs a bare PyTorch loop.

    python benchmarks/bench_train.py                                  # tiny model, every embedding
    python benchmarks/bench_train.py --hidden 256 --layers 4 --embeddings lev tied --steps 20

Same model, same micro-batches, same AdamW: the bare loop is forward, backward,
`clip_grad_norm_`, `step`; the Trainer adds DeepSpeed (ZeRO stage `--zero`), the
non-finite guard (an all-grad isfinite check), the LR schedule and per-step logging.
Reported per step as wall time and this process's CPU time (robust to other load on
the machine), and the ratio trainer / bare. Results are appended to benchmarks/results/train.md.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import platform
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "train.md"


def _config(args, embedding: str):
    from megatron_lev.config import load_config

    over = [
        f"model.embedding={embedding}",
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        f"model.num_attention_heads={args.heads}",
        f"model.seq_length={args.seq}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.train_iters={args.steps + args.warmup}",
        f"parallel.zero_stage={args.zero}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.log_interval=1",
        f"train.precision={args.precision}",
    ]
    return load_config([Path(__file__).resolve().parents[1] / "pretrain" / "configs" / "tiny.yaml"], over)


def _batches(args, vocab: int, device):
    import torch

    g = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), generator=g).to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def _timed(step, n: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        step()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def bare_loop(args, cfg, vocab: int, device) -> tuple[float, float]:
    import torch

    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.recompute import apply_activation_checkpointing
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_spec

    # checkpointed as the engine would (build_engine applies it), so both loops run the same model
    model = build_model(model_spec(cfg, vocab), SINGLE)
    model = apply_activation_checkpointing(model, cfg.model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    return _timed(
        bare_step(model, opt, _batches(args, vocab, device), cfg.train.clip_grad), args.steps, args.warmup
    )


def bare_step(model, opt, batches, clip: float):
    """One plain PyTorch training step per call (forward, backward, clip, AdamW); returns the loss."""
    import torch

    def step() -> float:
        input_ids, labels = next(batches)
        loss = model(input_ids, labels=labels).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def trainer_loop(args, cfg, vocab: int, device, out: str) -> tuple[float, float]:
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_plan
    from megatron_lev.training.metrics import MetricsWriter
    from megatron_lev.training.schedule import Budget
    from megatron_lev.training.trainer import TrainData, Trainer

    plan = model_plan(cfg, 1, vocab, cuda=device.type == "cuda")
    engine = build_engine(plan, build_model(plan.model_spec, SINGLE), SINGLE)
    tokens = args.micro_batch * args.seq
    trainer = Trainer(
        cfg,
        engine,
        Budget(args.steps + args.warmup, tokens, "bench"),
        TrainData(None, None, args.micro_batch),
        world_size=1,
        device=device,
    )
    writer = MetricsWriter(out, True, False)
    batches = _batches(args, vocab, device)

    def step():
        loss, norm, skipped = trainer.train_step(batches)
        trainer.state.iteration += 1
        writer.record("train", trainer.state.iteration, {"loss": loss, "grad_norm": norm, "skipped": skipped})

    return _timed(step, args.steps, args.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--embeddings", nargs="+", default=["tied", "untied", "albert", "flat_mlp", "factorized_mlp", "lev"]
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=50277)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from megatron_lev.engine.deepspeed_engine import disable_cpu_shm_comm
    from megatron_lev.training.rendezvous import device as current_device
    from megatron_lev.training.rendezvous import init_distributed, shutdown_distributed

    disable_cpu_shm_comm()
    init_distributed()
    atexit.register(shutdown_distributed)  # leave the group before the interpreter tears down
    from megatron_lev.parallel import state

    state.initialize_model_parallel(1, 1)
    device = current_device()
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for emb in args.embeddings:
            cfg = _config(args, emb)
            bare_wall, bare_cpu = bare_loop(args, cfg, args.vocab, device)
            tr_wall, tr_cpu = trainer_loop(args, cfg, args.vocab, device, out)
            rows.append((emb, bare_wall, tr_wall, bare_cpu, tr_cpu))
            print(
                f"{emb:15s} bare {1e3 * bare_wall:8.1f} ms/step (cpu {1e3 * bare_cpu:8.1f})  trainer "
                f"{1e3 * tr_wall:8.1f} ms/step (cpu {1e3 * tr_cpu:8.1f})  "
                f"ratio wall {tr_wall / bare_wall:.2f} "
                f"cpu {tr_cpu / bare_cpu:.2f}",
                flush=True,
            )
    tokens = args.micro_batch * args.seq
    head = (
        f"\n## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads\n\n"
        f"hidden {args.hidden}, layers {args.layers}, seq {args.seq}, micro-batch {args.micro_batch} "
        f"({tokens} tokens/step), vocab {args.vocab}, ZeRO-{args.zero}, {args.precision}, "
        f"{args.steps} timed steps after {args.warmup}\n\n"
        "| embedding | bare ms/step | trainer ms/step | bare CPU ms | trainer CPU ms "
        "| ratio (wall) | ratio (CPU) |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    lines = "".join(
        f"| {e} | {1e3 * bw:.1f} | {1e3 * tw:.1f} | {1e3 * bc:.1f} | {1e3 * tc:.1f} | {tw / bw:.2f} | "
        f"{tc / bc:.2f} |\n"
        for e, bw, tw, bc, tc in rows
    )
    from results_file import append_section

    append_section(
        RESULTS,
        "# Trainer overhead (benchmarks/bench_train.py)\n\nTrainer on a DeepSpeed engine vs a "
        "bare PyTorch loop, same model and batches. Ratio > 1: the machinery costs that factor.\n",
        head + lines,
    )


if __name__ == "__main__":
    main()
