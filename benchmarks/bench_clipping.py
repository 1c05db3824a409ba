"""Step time with the project's clipping (`engine.clipping`) against DeepSpeed's own, same run.

    python benchmarks/bench_clipping.py                                     # tiny config, LEV and TIED
    python benchmarks/bench_clipping.py --config pretrain/configs/experiments/regime/regime.yaml --vocab 50277

Two engines over the same model (the config's ZeRO stage and precision, one process): one as every
run builds it (DeepSpeed's `gradient_clipping` 0; the clipper computes the full norm by clip group
with one all-reduce and the optimizer scales the gradients), one switched back to DeepSpeed's own
clipping (the clipper unhooked, `gradient_clipping` set to `train.clip_grad` in DeepSpeed's config
and optimizer). Steps of the two alternate (`Trainer.device_step`, synthetic batches), so load on
the machine hits both alike; medians of wall and CPU time per step, and the clipper's own work timed
directly. Results are appended to benchmarks/results/clipping.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "clipping.md"


def _trainer(cfg, vocab: int, steps: int, deepspeed_clips: bool):
    import torch

    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_plan
    from megatron_lev.training.schedule import Budget
    from megatron_lev.training.trainer import TrainData, Trainer

    plan = model_plan(cfg, 1, vocab)
    engine = build_engine(plan, build_model(plan.model_spec, SINGLE), SINGLE)
    if deepspeed_clips:  # unhook the project's clipper; DeepSpeed clips as it did before it
        ds = engine.ds_engine
        ds._take_model_step = type(ds)._take_model_step.__get__(ds)
        engine.optimizer.grad_factors, engine.clipper = None, None
        ds._config.gradient_clipping = cfg.train.clip_grad
        if hasattr(ds.optimizer, "clip_grad"):
            ds.optimizer.clip_grad = cfg.train.clip_grad
    t, seq = cfg.train, cfg.model.seq_length
    gen = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, vocab, (t.micro_batch_size, seq + 1), generator=gen)
            yield tokens[:, :-1], tokens[:, 1:]

    trainer = Trainer(
        cfg,
        engine,
        Budget(2 * steps + 2, t.micro_batch_size * seq, "bench"),
        TrainData(None, None, t.micro_batch_size),
        world_size=1,
        device=torch.device("cpu"),
    )
    return trainer, batches()


def measure(config: Path, embedding: str, vocab: int, steps: int, zero: int) -> dict:
    from megatron_lev.config import load_config

    over = [
        f"model.embedding={embedding}",
        f"parallel.zero_stage={zero}",
        "train.train_tokens=null",
        "train.chinchilla=false",
        f"train.train_iters={steps + 2}",
        "train.lr_warmup_iters=1",
        "train.clip_grad=0.5",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    cfg = load_config([config], over)
    ours, theirs = _trainer(cfg, vocab, steps, False), _trainer(cfg, vocab, steps, True)
    clipper = ours[0].engine.clipper
    own: list[float] = []
    measure_norms = clipper._measure

    def timed_measure():
        start = time.process_time()
        measure_norms()
        own.append(time.process_time() - start)

    clipper._measure = timed_measure
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "deepspeed": []}
    for i in range(steps + 1):
        for name, (trainer, batches) in (("ours", ours), ("deepspeed", theirs)):
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.device_step(batches)
            trainer.pending = []
            elapsed = (time.perf_counter() - wall, time.process_time() - cpu)
            if i >= 1:  # the first step creates the optimizer state
                times[name].append(elapsed)
    params = sum(p.numel() for p in ours[0].engine.module.parameters())
    return {
        "embedding": embedding,
        "params": params,
        "tokens": cfg.train.micro_batch_size * cfg.model.seq_length,
        "zero": zero,
        "ours_wall": statistics.median(w for w, _ in times["ours"]),
        "ours_cpu": statistics.median(c for _, c in times["ours"]),
        "ds_wall": statistics.median(w for w, _ in times["deepspeed"]),
        "ds_cpu": statistics.median(c for _, c in times["deepspeed"]),
        "own_cpu": statistics.median(own[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "pretrain" / "configs" / "tiny.yaml")
    parser.add_argument("--embeddings", nargs="+", default=["lev", "tied"])
    parser.add_argument("--zero", nargs="+", type=int, default=[0, 1], help="ZeRO stages to time")
    parser.add_argument(
        "--vocab", type=int, default=None, help="default: the config's model.vocab_size, else 50277"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each kind")
    args = parser.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from megatron_lev.config import load_config
    from megatron_lev.engine.deepspeed_engine import disable_cpu_shm_comm
    from megatron_lev.training.rendezvous import init_distributed

    disable_cpu_shm_comm()
    init_distributed()
    from megatron_lev.parallel import state

    state.initialize_model_parallel(1, 1)
    vocab = args.vocab or load_config([args.config], validate=False).model.vocab_size or 50277
    rows = []
    for zero in args.zero:
        for emb in args.embeddings:
            r = measure(args.config, emb, vocab, args.steps, zero)
            rows.append(r)
            print(
                f"ZeRO-{zero} {emb:6s} project's clipping {1e3 * r['ours_wall']:8.1f} ms "
                f"(cpu {1e3 * r['ours_cpu']:8.1f})  DeepSpeed's {1e3 * r['ds_wall']:8.1f} ms "
                f"(cpu {1e3 * r['ds_cpu']:8.1f})  ratio {r['ours_wall'] / r['ds_wall']:.3f}; the clipper's "
                f"own work {1e3 * r['own_cpu']:.1f} ms cpu",
                flush=True,
            )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    config = args.config.resolve()
    shown = config.relative_to(ROOT) if config.is_relative_to(ROOT) else args.config
    head = (
        f"\n## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"cpu, torch {torch.__version__}, {torch.get_num_threads()} threads, load {load:.1f}\n\n"
        f"`{shown}`, vocab {vocab}, `train.clip_grad=0.5`, {args.steps} steps of each kind "
        "alternated (medians)\n\n"
        "| embedding | parameters | tokens/step | ZeRO | project's ms | DeepSpeed's ms | ratio (wall) "
        "| project's CPU ms | DeepSpeed's CPU ms | ratio (CPU) | clipper's own CPU ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = "".join(
        f"| {r['embedding']} | {r['params']:,} | {r['tokens']:,} | {r['zero']} "
        f"| {1e3 * r['ours_wall']:.1f} | {1e3 * r['ds_wall']:.1f} | {r['ours_wall'] / r['ds_wall']:.3f} "
        f"| {1e3 * r['ours_cpu']:.1f} | {1e3 * r['ds_cpu']:.1f} | {r['ours_cpu'] / r['ds_cpu']:.3f} "
        f"| {1e3 * r['own_cpu']:.1f} |\n"
        for r in rows
    )
    from results_file import append_section

    append_section(
        RESULTS,
        "# Clipping: the project's against DeepSpeed's (benchmarks/bench_clipping.py)\n\nThe same "
        "run's step with the project's clipper (every layout's true norm, by clip group) and with "
        "DeepSpeed's own clipping, alternated in one process.\n",
        head + lines,
    )


if __name__ == "__main__":
    main()
