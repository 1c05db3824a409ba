"""Exact eps speed: the O(V d^2) Gram identity (the default of `capacity`) and the all-pairs pass.

    python benchmarks/bench_capacity.py                     # Gram: 200,019 x 4096; 50,277 x 1024 vs all pairs
    python benchmarks/bench_capacity.py --no-agreement      # Gram: 200,019 x 4096 only
    python benchmarks/bench_capacity.py --all-pairs         # the all-pairs pass alone (throughput vs matmul)
    python benchmarks/bench_capacity.py --all-pairs --cap 0 # ... with the 200k case in full (2e10 pairs)

Gram cases: wall and CPU time of exact eps as `capacity` computes it by default (Gram pass plus
a 10,000-row histogram sample), and on 50,277 x 1024 the agreement of the Gram eps with the
all-pairs pass (float32 products) and with the Gram eps of rows rounded to float32 first.
All-pairs cases: a capped case runs the first R rows (R(R-1)/2 pairs) and extrapolates the full
time by the pair count (the work is exactly proportional to it); such rows are labelled
"extrapolated". Each case runs in its own process so its peak RSS is its own. Results are
appended to benchmarks/results/capacity.md with the load average before and after each case.
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


def _matrix(rows: int, d: int):
    """Gaussian rows plus a shared direction (anisotropic, like real tables), float32."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=gen)
    return x.add_(0.3 * torch.randn(1, d, generator=gen))


def run_case(vocab: int, d: int, rows: int, block: int, hist_stride: int, threads: int) -> dict:
    import torch

    from megatron_lev.analysis.cosine import _moments, _pair_pass, gram_moments, normalized_rows

    torch.set_num_threads(threads)
    x = _matrix(rows, d)
    mm_wall, mm_cpu = matmul_gflops(min(block, rows), d)
    t0, cpu0 = time.perf_counter(), time.process_time()
    u, _ = normalized_rows(x)
    s1, s2, _, _ = _pair_pass(u, block, 2000, hist_stride, torch.device("cpu"), True)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    pairs = rows * (rows - 1) // 2
    mu, sigma = _moments(s1, s2, pairs)
    gram_mu, gram_sigma = gram_moments(x)
    useful = pairs * 2 * d / 1e9  # GFLOP, 2d flops per pair
    full_pairs = vocab * (vocab - 1) // 2
    return {
        "vocab": vocab,
        "d": d,
        "rows": rows,
        "block": block,
        "hist_stride": hist_stride,
        "threads": threads,
        "seconds": seconds,
        "pairs": pairs,
        "full_seconds": seconds * full_pairs / pairs,
        "extrapolated": rows < vocab,
        "cpu_seconds": cpu_seconds,
        "gflops": useful / seconds,
        "matmul_gflops": mm_wall,
        "fraction": useful / seconds / mm_wall,
        "cpu_fraction": useful / cpu_seconds / mm_cpu,
        "eps": mu + 2 * sigma,
        "eps_gram_diff": abs(mu + 2 * sigma - gram_mu - 2 * gram_sigma),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "matrix_gib": rows * d * 4 / 2**30,
    }


def run_gram_case(vocab: int, d: int, block: int, threads: int, all_pairs: bool) -> dict:
    """Exact eps as `capacity` computes it by default; with all_pairs, also the all-pairs pass and the
    Gram eps of float32-rounded rows, for agreement."""
    import torch

    from megatron_lev.analysis.cosine import cosine_stats, gram_moments

    torch.set_num_threads(threads)
    x = _matrix(vocab, d)
    load0 = os.getloadavg()[0]
    cpu0 = time.process_time()
    stats = cosine_stats(x, block=block, progress=True)  # the default: Gram + histogram sample
    cpu_seconds = time.process_time() - cpu0
    out = {
        "vocab": vocab,
        "d": d,
        "threads": threads,
        "seconds": stats.seconds,
        "cpu_seconds": cpu_seconds,
        "gram_seconds": stats.gram_seconds,
        "hist_seconds": stats.hist_seconds,
        "hist_rows": stats.hist_rows,
        "hist_seed": stats.hist_seed,
        "pairs": stats.pairs,
        "eps": stats.eps,
        "load_before": load0,
    }
    if all_pairs:
        mu32, sd32 = gram_moments(x, rows_dtype=torch.float32)
        full = cosine_stats(x, block=block, histogram="full", progress=True)
        out.update(
            eps_f32_rows_diff=abs(mu32 + 2 * sd32 - stats.eps),
            pairs_seconds=full.hist_seconds,
            eps_pairs=full.eps_pairs,
            eps_pairs_diff=abs(full.eps_pairs - stats.eps),
            eps_rerun_diff=abs(full.eps - stats.eps),
        )
    out.update(
        load_after=os.getloadavg()[0],
        peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        matrix_gib=vocab * d * 4 / 2**30,
    )
    return out


def _in_process(fn, *args) -> dict:
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def _header(args: argparse.Namespace, what: str) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return (
        f"\n## {what}: {when}, {platform.machine()}, {os.cpu_count()} cores, block {args.block}, "
        f"load average {load}\n\n"
    )


def gram_cases(args: argparse.Namespace) -> str:
    head = (
        "| matrix | threads | exact eps, wall s (Gram + histogram) | CPU s | Gram pass s "
        "| histogram s (sample rows, seed) | eps (Gram) | all-pairs pass s | abs(eps - all-pairs eps) "
        "| abs(eps - Gram eps, float32 rows) | peak RSS GiB (matrix) | load average (1 min) before, after |\n"
        + "|---" * 12
        + "|"
    )
    lines = []
    cases = [(200_019, 4096, False)] + ([] if args.no_agreement else [(50_277, 1024, True)])
    for vocab, d, all_pairs in cases:
        r = _in_process(run_gram_case, vocab, d, args.block, args.threads, all_pairs)
        pairs = (
            f"{r['pairs_seconds']:.1f} | {r['eps_pairs_diff']:.1e} | {r['eps_f32_rows_diff']:.1e}"
            if all_pairs
            else "- | - | -"
        )
        line = (
            f"| {vocab:,} x {d} | {r['threads']} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} "
            f"| {r['gram_seconds']:.1f} | {r['hist_seconds']:.1f} ({r['hist_rows']:,}, {r['hist_seed']}) "
            f"| {r['eps']:.8f} | {pairs} | {r['peak_rss_gib']:.2f} ({r['matrix_gib']:.2f}) "
            f"| {r['load_before']:.1f}, {r['load_after']:.1f} |"
        )
        print(line, flush=True)
        lines.append(line)
    return _header(args, "exact eps from the Gram matrix") + head + "\n" + "\n".join(lines) + "\n"


def all_pairs_cases(args: argparse.Namespace) -> str:
    cases = [(50_277, 1024, 50_277, s) for s in args.hist_stride]
    cases.append((200_019, 4096, min(args.cap or 200_019, 200_019), args.hist_stride[0]))
    lines = []
    for vocab, d, rows, stride in cases:
        r = _in_process(run_case, vocab, d, rows, args.block, stride, args.threads)
        full = f"{r['full_seconds']:.0f} s" + (" (extrapolated)" if r["extrapolated"] else "")
        line = (
            f"| {vocab:,} x {d} | {rows:,} | {r['hist_stride']} | {r['threads']} | {r['seconds']:.1f} "
            f"| {full} "
            f"| {r['gflops']:.1f} | {r['matmul_gflops']:.1f} | {r['fraction']:.0%} | {r['cpu_fraction']:.0%} "
            f"| {r['eps']:.5f} "
            f"| {r['eps_gram_diff']:.1e} | {r['peak_rss_gib']:.2f} ({r['matrix_gib']:.2f}) |"
        )
        print(line, flush=True)
        lines.append(line)
    head = (
        "| matrix | rows run | hist stride | threads | seconds | full matrix | GFLOP/s (2d per pair) "
        "| float32 matmul GFLOP/s | fraction (wall) | fraction (CPU time) | eps | abs(eps - Gram eps) "
        "| peak RSS GiB (matrix) |\n" + "|---" * 13 + "|"
    )
    return _header(args, "all-pairs pass") + head + "\n" + "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--all-pairs", action="store_true", help="time the all-pairs pass instead of the Gram path"
    )
    p.add_argument(
        "--no-agreement", action="store_true", help="Gram: skip the 50,277 x 1024 all-pairs agreement case"
    )
    p.add_argument(
        "--cap", type=int, default=40_000, help="all-pairs: row cap of the 200,019 x 4096 case (0: none)"
    )
    p.add_argument("--block", type=int, default=4096)
    p.add_argument(
        "--hist-stride",
        type=int,
        nargs="+",
        default=[1, 4],
        help="all-pairs: histogram strides of the 50k case (the 200k case uses the first)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    text = all_pairs_cases(args) if args.all_pairs else gram_cases(args)
    if not args.no_record:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with open(RESULTS, "a") as f:
            f.write(text)
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
