"""Exact eps (all pairs) speed: time, throughput as a fraction of this machine's float32 matmul, peak memory.

    python benchmarks/bench_capacity.py                      # 50,277 x 1024 and 200,019 x 4096 (row-capped)
    python benchmarks/bench_capacity.py --cap 0              # the 200k case in full (2e10 pairs)

A capped case runs the first R rows (R(R-1)/2 pairs) and extrapolates the full time by the pair
count (the work is exactly proportional to it); such rows are labelled "extrapolated".
Each case runs in its own process so its peak RSS is its own. Results are appended to
benchmarks/results/capacity.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "capacity.md"


def matmul_gflops(block: int, d: int, repeats: int = 5) -> tuple[float, float]:
    """Best-of float32 GFLOP/s of the same (block, d) @ (d, block) product the eps pass runs,
    per wall second and per CPU second of this process (the latter is robust to other load)."""
    import torch

    a, b = torch.randn(block, d), torch.randn(d, block)
    out = torch.empty(block, block)
    torch.mm(a, b, out=out)
    wall = cpu = float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        torch.mm(a, b, out=out)
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    flops = 2 * block * block * d / 1e9
    return flops / wall, flops / cpu


def run_case(vocab: int, d: int, rows: int, block: int, hist_stride: int, threads: int) -> dict:
    import torch

    from megatron_lev.analysis.cosine import cosine_stats, gram_moments

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=gen) + 0.3 * torch.randn(1, d, generator=gen)  # anisotropic, like real tables
    mm_wall, mm_cpu = matmul_gflops(min(block, rows), d)
    cpu0 = time.process_time()
    stats = cosine_stats(x, block=block, hist_stride=hist_stride, progress=True)
    cpu_seconds = time.process_time() - cpu0
    useful = stats.pairs * 2 * d / 1e9                               # GFLOP, 2d flops per pair
    gram_mu, gram_sigma = gram_moments(x)
    full_pairs = vocab * (vocab - 1) // 2
    return {"vocab": vocab, "d": d, "rows": rows, "block": block, "hist_stride": hist_stride,
            "threads": threads, "seconds": stats.seconds, "pairs": stats.pairs,
            "full_seconds": stats.seconds * full_pairs / stats.pairs, "extrapolated": rows < vocab,
            "cpu_seconds": cpu_seconds, "gflops": useful / stats.seconds, "matmul_gflops": mm_wall,
            "fraction": useful / stats.seconds / mm_wall,
            "cpu_fraction": useful / cpu_seconds / mm_cpu,
            "eps": stats.eps, "eps_gram_diff": abs(stats.eps - (gram_mu + 2 * gram_sigma)),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "matrix_gib": rows * d * 4 / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap", type=int, default=40_000, help="row cap of the 200,019 x 4096 case (0: none)")
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--hist-stride", type=int, nargs="+", default=[1, 4],
                   help="histogram strides of the 50k case (the 200k case uses the first)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    cases = [(50_277, 1024, 50_277, s) for s in args.hist_stride]
    cases.append((200_019, 4096, min(args.cap or 200_019, 200_019), args.hist_stride[0]))
    lines = []
    for vocab, d, rows, stride in cases:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as ex:
            r = ex.submit(run_case, vocab, d, rows, args.block, stride, args.threads).result()
        full = f"{r['full_seconds']:.0f} s" + (" (extrapolated)" if r["extrapolated"] else "")
        line = (f"| {vocab:,} x {d} | {rows:,} | {r['hist_stride']} | {r['threads']} | {r['seconds']:.1f} | {full} "
                f"| {r['gflops']:.1f} | {r['matmul_gflops']:.1f} | {r['fraction']:.0%} | {r['cpu_fraction']:.0%} "
                f"| {r['eps']:.5f} "
                f"| {r['eps_gram_diff']:.1e} | {r['peak_rss_gib']:.2f} ({r['matrix_gib']:.2f}) |")
        print(line, flush=True)
        lines.append(line)
    if not args.no_record:
        head = ("| matrix | rows run | hist stride | threads | seconds | full matrix | GFLOP/s (2d per pair) "
                "| float32 matmul GFLOP/s | fraction (wall) | fraction (CPU time) | eps | abs(eps - Gram eps) | peak RSS GiB (matrix) |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        text = (f"\n## {when}, {platform.machine()}, {os.cpu_count()} cores, block {args.block}, "
                f"load average {load}\n\n"
                f"{head}\n" + "\n".join(lines) + "\n")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with open(RESULTS, "a") as f:
            f.write(text)
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
