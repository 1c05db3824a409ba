"""Cost of the training dynamics (`training.dynamics`): a measured log step vs a plain step.

    python benchmarks/bench_dynamics.py                                    # tiny config, LEV and TIED
    python benchmarks/bench_dynamics.py --config pretrain/configs/experiments/small/study.yaml

A Trainer on a DeepSpeed engine (the config's ZeRO stage and precision, one process) alternates a
plain step (`device_step`: what a step between log lines costs) and a measured one: the
`TrainingDynamics` callback's work on a log step (the sample rows before the step, the engine's
step probe inside it: gradient and weight norms, the weight snapshot, the update norms; then the
table statistics and the one host read). Both see the same kind of synthetic batches; the two
kinds of step are interleaved so that load on the machine hits both alike. Reported per step as
wall time and this process's CPU time, the difference, and (robust to noise in the step itself)
the CPU time of the dynamics' own work timed directly: the callback's calls and the probe's work
inside the step. Results are appended to benchmarks/results/dynamics.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "dynamics.md"


def _trainer(config: Path, embedding: str, vocab: int, steps: int, out: str):
    import torch

    from megatron_lev.config import load_config
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine
    from megatron_lev.training.dynamics import TrainingDynamics
    from megatron_lev.training.hooks import Control
    from megatron_lev.training.schedule import Budget
    from megatron_lev.training.trainer import TrainData, Trainer

    over = [
        f"model.embedding={embedding}",
        "train.train_tokens=null",
        "train.chinchilla=false",
        f"train.train_iters={2 * steps + 2}",
        "train.lr_warmup_iters=2",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    cfg = load_config([config], over)
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_plan

    plan = model_plan(cfg, 1, vocab)
    engine = build_engine(plan, build_model(plan.model_spec, SINGLE), SINGLE)
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
    dynamics = TrainingDynamics(1, cfg.logging.dynamics_sample_ids, vocab)
    dynamics.on_train_begin(trainer, Control())
    return cfg, trainer, dynamics, batches()


def measure(config: Path, embedding: str, vocab: int, steps: int) -> dict:
    """`steps` plain and `steps` measured steps, interleaved, after one of each to warm up."""
    with tempfile.TemporaryDirectory() as out:
        cfg, trainer, dynamics, batches = _trainer(config, embedding, vocab, steps, out)
        times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        own: list[float] = []  # CPU seconds of the dynamics' own work per measured step
        keys = 0

        def timed(fn):
            def call(*args, **kwargs):
                start = time.process_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    own[-1] += time.process_time() - start

            return call

        for i in range(2 * steps + 2):
            measured = i % 2 == 1
            it = trainer.state.iteration + 1
            wall, cpu = time.perf_counter(), time.process_time()
            if measured:
                own.append(0.0)
                timed(dynamics.on_step_begin)(trainer, it)
                probe = trainer.engine._probe  # built at the first measured step's arming
                if not hasattr(probe, "timed"):
                    probe._before, probe._after, probe.timed = timed(probe._before), timed(probe._after), True
            trainer.device_step(batches)
            trainer.state.iteration = it
            if measured:
                keys = len(timed(dynamics.metrics)(trainer, it))
            elapsed = (time.perf_counter() - wall, time.process_time() - cpu)
            if i >= 2:
                times[measured].append(elapsed)
        params = sum(p.numel() for p in trainer.engine.module.parameters())
    plain, logged = times[False], times[True]
    return {
        "embedding": embedding,
        "params": params,
        "tokens": cfg.train.micro_batch_size * cfg.model.seq_length,
        "zero": cfg.parallel.zero_stage,
        "sample": min(cfg.logging.dynamics_sample_ids, vocab),
        "keys": keys,
        "plain_wall": statistics.median(w for w, _ in plain),
        "plain_cpu": statistics.median(c for _, c in plain),
        "logged_wall": statistics.median(w for w, _ in logged),
        "logged_cpu": statistics.median(c for _, c in logged),
        "own_cpu": statistics.median(own[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "pretrain" / "configs" / "tiny.yaml")
    parser.add_argument("--embeddings", nargs="+", default=["lev", "tied"])
    parser.add_argument(
        "--vocab", type=int, default=None, help="default: the config's model.vocab_size, else 50277"
    )
    parser.add_argument("--steps", type=int, default=10, help="plain and measured steps each")
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
    for emb in args.embeddings:
        r = measure(args.config, emb, vocab, args.steps)
        rows.append(r)
        print(
            f"{emb:8s} plain {1e3 * r['plain_wall']:8.1f} ms (cpu {1e3 * r['plain_cpu']:8.1f})  measured "
            f"{1e3 * r['logged_wall']:8.1f} ms (cpu {1e3 * r['logged_cpu']:8.1f})  "
            f"extra cpu {r['logged_cpu'] / r['plain_cpu'] - 1:+.1%}; dynamics' own work "
            f"{1e3 * r['own_cpu']:.1f} ms cpu ({r['own_cpu'] / r['plain_cpu']:.1%} of a plain step)",
            flush=True,
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    config = args.config.resolve()
    shown = config.relative_to(ROOT) if config.is_relative_to(ROOT) else args.config
    head = (
        f"\n## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"cpu, torch {torch.__version__}, {torch.get_num_threads()} threads, load {load:.1f}\n\n"
        f"`{shown}`"
        f", vocab {vocab}, {args.steps} plain and {args.steps} measured steps interleaved (medians)\n\n"
        "| embedding | parameters | tokens/step | ZeRO | sample ids | logged keys | plain ms | measured ms "
        "| plain CPU ms | measured CPU ms | extra (wall) | extra (CPU) | own work CPU ms | own / plain |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = "".join(
        f"| {r['embedding']} | {r['params']:,} | {r['tokens']:,} | {r['zero']} | {r['sample']:,} "
        f"| {r['keys']} "
        f"| {1e3 * r['plain_wall']:.1f} | {1e3 * r['logged_wall']:.1f} | {1e3 * r['plain_cpu']:.1f} "
        f"| {1e3 * r['logged_cpu']:.1f} | {r['logged_wall'] / r['plain_wall'] - 1:+.1%} "
        f"| {r['logged_cpu'] / r['plain_cpu'] - 1:+.1%} | {1e3 * r['own_cpu']:.1f} "
        f"| {r['own_cpu'] / r['plain_cpu']:.1%} |\n"
        for r in rows
    )
    from results_file import append_section

    append_section(
        RESULTS,
        "# Training dynamics overhead (benchmarks/bench_dynamics.py)\n\nA log step that measures the "
        "training dynamics vs a plain step, same trainer, interleaved. Steps between log lines "
        "do none of this work.\n",
        head + lines,
    )


if __name__ == "__main__":
    main()
