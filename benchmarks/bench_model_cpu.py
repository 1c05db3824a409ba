"""CPU training throughput of the tiny model for every embedding variant, with the MFU formula used on GPUs.

    python benchmarks/bench_model_cpu.py                     # tiny config, NeoX vocabulary, batch 8 x 128
    python benchmarks/bench_model_cpu.py --steps 20 --batch 16

One process, one thread by default (OMP_NUM_THREADS=1 like the tests). Every variant runs the
same steps (forward, backward, AdamW) on the same random tokens, interleaved round-robin so that
machine load affects all variants alike; the reported time is the median step. Prints tokens/s,
the step-time ratio to TIED, and the achieved FLOP/s by the analytic model-FLOPs formula
(`megatron_lev.model.flops`, 3x forward, head and attention included) that `train` uses for MFU on
GPUs. Results are appended to benchmarks/results/model_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.model.embeddings import REGISTRY
from megatron_lev.model.flops import flops_per_token, parameter_count
from megatron_lev.model.vocab import padded_vocab_size
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec
from megatron_lev.utils.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "model_cpu.md"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(ROOT / "pretrain" / "configs" / "tiny.yaml"))
    parser.add_argument("--vocab-size", type=int, default=50277, help="tokenizer vocabulary (NeoX-20B)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per variant (after 2 warm-up)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=list(REGISTRY), choices=list(REGISTRY))
    parser.add_argument("--no-record", action="store_true", help="do not append to the results file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    models, opts, cfgs = {}, {}, {}
    for variant in args.variants:
        cfg = load_config([args.config], [f"model.embedding={variant}"])
        cfgs[variant] = cfg.model
        models[variant] = build_model(model_spec(cfg, args.vocab_size), SINGLE)
        opts[variant] = torch.optim.AdamW(models[variant].parameters(), lr=1e-4)
    seq = next(iter(cfgs.values())).seq_length
    vocab = padded_vocab_size(args.vocab_size, next(iter(cfgs.values())), 1)
    tokens = torch.randint(
        0, args.vocab_size, (args.batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    times = {v: [] for v in args.variants}
    cpu_times = {v: [] for v in args.variants}

    def step(variant: str) -> tuple[float, float]:
        start, cpu_start = time.perf_counter(), time.process_time()
        opts[variant].zero_grad(set_to_none=True)
        models[variant](tokens[:, :-1], tokens[:, 1:]).mean().backward()
        opts[variant].step()
        return time.perf_counter() - start, time.process_time() - cpu_start

    for variant in args.variants:  # warm-up
        step(variant), step(variant)
    from megatron_lev.utils.progress import progress_bar

    for _ in progress_bar(range(args.steps), desc="rounds", unit="round"):
        for variant in args.variants:
            wall, cpu = step(variant)
            times[variant].append(wall)
            cpu_times[variant].append(cpu)

    # CPU time of this process is the load-robust measure on a shared machine; wall time is what a user sees
    tied = statistics.median(cpu_times["tied"]) if "tied" in times else None
    now = datetime.datetime.now(datetime.timezone.utc)
    config = Path(args.config).relative_to(ROOT) if Path(args.config).is_relative_to(ROOT) else args.config
    lines = [
        f"\n## {now:%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
        f"{args.threads} thread(s), torch {torch.__version__}\n",
        f"Config `{config}`, "
        f"vocabulary {args.vocab_size} -> {vocab}, batch {args.batch} x {seq}, median of {args.steps} steps "
        "(forward + backward + AdamW), fp32.\n",
        f"Load average at start: {os.getloadavg()[0]:.1f}. Ratios and tokens/s use the process's CPU time "
        "(robust to other load); wall time is shown beside it.\n",
        "| variant | params | step ms (CPU) | step ms (wall) | tokens/s (CPU) | step time / TIED | "
        "model GFLOP/s (MFU numerator) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant in args.variants:
        med, wall = statistics.median(cpu_times[variant]), statistics.median(times[variant])
        tps = args.batch * seq / med
        gflops = tps * flops_per_token(cfgs[variant], vocab) / 1e9
        ratio = f"{med / tied:.3f}" if tied else "n/a"
        params = parameter_count(cfgs[variant], vocab)["total"]
        lines.append(
            f"| {variant} | {params:,} | {med * 1e3:.1f} | {wall * 1e3:.1f} | {tps:,.0f} | {ratio} "
            f"| {gflops:.2f} |"
        )
    lines.append(
        "\nOn GPUs: MFU = tokens/s x flops_per_token / (devices x peak FLOP/s), "
        f"flops_per_token = {flops_per_token(next(iter(cfgs.values())), vocab) / 1e6:.1f} MFLOP here."
    )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_record:
        head = (
            RESULTS.read_text()
            if RESULTS.exists()
            else (
                "# Tiny model on CPU: training throughput per embedding variant\n\n"
                "`python benchmarks/bench_model_cpu.py` appends a section per run.\n"
            )
        )
        atomic_write_text(RESULTS, head + text)
        print(f"appended to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
