"""Time and peak memory of building GPT sample indices for a Pile-sized corpus (synthetic sizes).

    python benchmarks/bench_index.py            # 210M documents, 300B tokens, S = 2048
    python benchmarks/bench_index.py --scale 0.1

Appends a row to benchmarks/results/index.md (targets here: < 2 minutes, < 8 GB).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lev.data import indices as ix  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the Pile's documents and tokens")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "index.md"))
    args = p.parse_args()
    docs, tokens = int(210e6 * args.scale), int(300e9 * args.scale)
    mean = tokens / docs
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, int(2 * mean), size=docs, dtype=np.int32)  # uniform sizes with the Pile's mean
    total = int(sizes.sum(dtype=np.int64))
    num_samples = (total - 1) // args.seq_length  # one full epoch
    t_sizes = time.perf_counter() - t0
    print(f"{docs:,} documents, {total:,} tokens, {num_samples:,} samples of {args.seq_length}+1 "
          f"(synthetic sizes in {t_sizes:.1f} s)", flush=True)

    timings = {}
    t = time.perf_counter()
    doc_idx = ix.build_doc_idx(np.arange(docs, dtype=np.int32), 1, np.random.default_rng(args.seed))
    timings["doc_idx"] = time.perf_counter() - t
    print(f"doc_idx     {timings['doc_idx']:7.1f} s", flush=True)
    t = time.perf_counter()
    sample_idx = ix.build_sample_idx(sizes, doc_idx, args.seq_length, num_samples)
    timings["sample_idx"] = time.perf_counter() - t
    print(f"sample_idx  {timings['sample_idx']:7.1f} s", flush=True)
    t = time.perf_counter()
    shuffle_idx = ix.build_shuffle_idx(num_samples, np.random.default_rng(args.seed + 1))
    timings["shuffle_idx"] = time.perf_counter() - t
    print(f"shuffle_idx {timings['shuffle_idx']:7.1f} s", flush=True)
    build = sum(timings.values())
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux
    sized = (doc_idx.nbytes + sample_idx.nbytes + shuffle_idx.nbytes) / 1e9
    print(f"total {build:.1f} s (target 120 s: {build / 120:.2f}x of it), peak RSS {peak_gb:.2f} GB "
          f"(target 8 GB: {peak_gb / 8:.2f}x), index files {sized:.2f} GB")
    # spot check: the last sample ends inside the stream
    assert sample_idx[-1, 0] < docs and sample_idx[-1, 1] < sizes[doc_idx[sample_idx[-1, 0]]]

    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        out.write_text("# GPT sample index build (bench_index.py)\n\n"
                       "Synthetic document sizes (uniform, the Pile's mean of ~1,430 tokens); one epoch; "
                       "numpy only, single process. Peak RSS includes the synthetic sizes array.\n\n"
                       "| date | machine | scale | documents | tokens | samples | doc_idx s | sample_idx s | "
                       "shuffle_idx s | total s | peak RSS GB | load avg |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    with open(out, "a") as f:
        f.write(f"| {datetime.date.today()} | {platform.machine()} {os.cpu_count()} cores | {args.scale:g} | "
                f"{docs:,} | {total:,} | {num_samples:,} | {timings['doc_idx']:.1f} | {timings['sample_idx']:.1f} | "
                f"{timings['shuffle_idx']:.1f} | {build:.1f} | {peak_gb:.2f} | {os.getloadavg()[0]:.1f} |\n")
    print(f"recorded in {out}")


if __name__ == "__main__":
    main()
