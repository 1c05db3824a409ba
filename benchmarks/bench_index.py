"""Time and peak memory of building GPT sample indices for a Pile-sized corpus (synthetic sizes).

    python benchmarks/bench_index.py            # 210M documents, 300B tokens, S = 2048
    python benchmarks/bench_index.py --scale 0.1
    python benchmarks/bench_index.py --scale 0.0953 --compare --megatron-helpers DIR  # 20M docs, 28.6B tokens

Appends a row to benchmarks/results/index.md (targets here: < 2 minutes, < 8 GB). With
--compare, `sample_idx` is instead timed side by side, in interleaved rounds on the same
input, against the previous numpy build (a cumulative sum over the whole stream and one
binary search per sample, kept below) and against Megatron-LM's C++ helper when
`helpers_cpp` imports (from megatron-core, or the folder given by --megatron-helpers);
the outputs must be equal, and the row goes to the comparison table of the same file.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lev.data import indices as ix  # noqa: E402

BUILD_HEADING = (
    "# GPT sample index build (bench_index.py)\n\n"
    "Synthetic document sizes (uniform, the Pile's mean of ~1,430 tokens); one epoch; "
    "numpy only, single process. Peak RSS includes the synthetic sizes array.\n\n"
)
BUILD_HEADER = (
    "| date | machine | scale | documents | tokens | samples | doc_idx s | sample_idx s | "
    "shuffle_idx s | total s | peak RSS GB | load avg |"
)
COMPARE_HEADER = (
    "| date | machine | documents | tokens | samples | rounds | this build s | "
    "previous numpy s | Megatron C++ s | previous / this | Megatron / this | "
    "this peak temp MB | previous peak temp MB | load avg |"
)


def sample_idx_searchsorted(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_samples: int, block: int = 1 << 24
) -> np.ndarray:
    """The previous build, for comparison: cumulative ends of the whole stream, a binary search per sample."""
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)
    out = np.empty((num_samples + 1, 2), dtype=np.int32)
    for start in range(0, num_samples + 1, block):
        pos = np.arange(start, min(start + block, num_samples + 1), dtype=np.int64) * seq_length
        doc = np.searchsorted(ends, pos, side="right")
        before = np.where(doc > 0, ends[np.maximum(doc - 1, 0)], 0)
        out[start : start + len(pos), 0] = doc
        out[start : start + len(pos), 1] = pos - before
    return out


def megatron_helper(folder: str | None):
    """Megatron-LM's compiled `helpers_cpp` module, or None when it cannot be imported."""
    if folder:
        sys.path.insert(0, folder)
    for name in ("megatron.core.datasets.helpers_cpp", "helpers_cpp"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def peak_temporary_mb(fn) -> float:
    """Peak memory numpy allocates while fn runs (tracemalloc sees numpy's buffers), in MB."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def compare(args, sizes: np.ndarray, doc_idx: np.ndarray, num_samples: int) -> None:
    """Interleaved rounds of each sample_idx build on the same input; equal outputs; a row in the table."""
    S, total = args.seq_length, int(sizes.sum(dtype=np.int64))
    builds = {
        "this": lambda: ix.build_sample_idx(sizes, doc_idx, S, num_samples),
        "previous": lambda: sample_idx_searchsorted(sizes, doc_idx, S, num_samples),
    }
    helper = megatron_helper(args.megatron_helpers)
    if helper is not None:  # one epoch: Megatron sizes the output from the epoch's tokens, the same N here
        builds["megatron"] = lambda: helper.build_sample_idx_int32(sizes, doc_idx, S, 1, total, True, 1)
    else:
        print("Megatron's helpers_cpp is not importable: comparing the numpy builds only")
    reference = builds["this"]()
    for name, fn in builds.items():
        assert np.array_equal(fn()[: num_samples + 1], reference), f"{name} differs from this build"
    wall = {name: [] for name in builds}
    cpu = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, fn in builds.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    cell, ratio = {}, {}
    for name in builds:
        best, median, best_cpu = min(wall[name]), statistics.median(wall[name]), min(cpu[name])
        cell[name] = f"{best:.2f} / {median:.2f} / {best_cpu:.2f}"
        ratio[name] = f"{best / min(wall['this']):.2f} ({best_cpu / min(cpu['this']):.2f})"
        print(
            f"{name:9s} wall best {best:6.2f} s  median {median:6.2f} s  CPU best {best_cpu:6.2f} s  "
            f"{ratio[name]}x this build"
        )
    peaks = {name: peak_temporary_mb(builds[name]) for name in ("this", "previous")}
    print(
        f"peak temporaries: this {peaks['this']:.0f} MB, previous {peaks['previous']:.0f} MB "
        f"(the output is {reference.nbytes / 1e6:.0f} MB of it)"
    )
    row = (
        f"| {datetime.date.today()} | {platform.machine()} {os.cpu_count()} cores | {len(sizes):,} | "
        f"{total:,} | {num_samples:,} | {args.rounds} | {cell['this']} | {cell['previous']} | "
        f"{cell.get('megatron', 'n/a')} | {ratio['previous']} | {ratio.get('megatron', 'n/a')} | "
        f"{peaks['this']:.0f} | {peaks['previous']:.0f} | {os.getloadavg()[0]:.1f} |"
    )
    heading = (
        "## sample_idx side by side (`--compare`)\n\n"
        "Interleaved rounds on the same input, outputs checked equal. Each time cell is best wall / "
        "median wall / best CPU seconds; the ratios are best wall (best CPU) over this build's.\n\n"
    )
    add_row(Path(args.results), heading, COMPARE_HEADER, row)


def add_row(path: Path, heading: str, header: str, row: str) -> None:
    """Add `row` after the last row of the table under `header` (before the next heading), or start
    that table, under `heading`, at the end of the file."""
    lines = path.read_text().splitlines() if path.exists() else []
    if header in lines:
        top = lines.index(header)
        end = next((i for i in range(top, len(lines)) if lines[i].startswith("#")), len(lines))
        last = max(i for i in range(top, end) if lines[i].startswith("|"))
        lines.insert(last + 1, row)
    else:
        sep = "|" + "---|" * (header.count("|") - 1)
        lines += ([""] if lines else []) + heading.rstrip("\n").split("\n") + ["", header, sep, row]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"recorded in {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the Pile's documents and tokens")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "index.md"))
    p.add_argument(
        "--compare",
        action="store_true",
        help="time sample_idx against the previous numpy build and Megatron's C++ helper",
    )
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds with --compare")
    p.add_argument(
        "--megatron-helpers",
        default=None,
        help="folder holding Megatron-LM's compiled helpers_cpp module (with --compare)",
    )
    args = p.parse_args()
    docs, tokens = int(210e6 * args.scale), int(300e9 * args.scale)
    mean = tokens / docs
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, int(2 * mean), size=docs, dtype=np.int32)  # uniform sizes with the Pile's mean
    total = int(sizes.sum(dtype=np.int64))
    num_samples = (total - 1) // args.seq_length  # one full epoch
    t_sizes = time.perf_counter() - t0
    print(
        f"{docs:,} documents, {total:,} tokens, {num_samples:,} samples of {args.seq_length}+1 "
        f"(synthetic sizes in {t_sizes:.1f} s)",
        flush=True,
    )

    timings = {}
    t = time.perf_counter()
    doc_idx = ix.build_doc_idx(np.arange(docs, dtype=np.int32), 1, np.random.default_rng(args.seed))
    timings["doc_idx"] = time.perf_counter() - t
    print(f"doc_idx     {timings['doc_idx']:7.1f} s", flush=True)
    if args.compare:
        compare(args, sizes, doc_idx, num_samples)
        return
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
    print(
        f"total {build:.1f} s (target 120 s: {build / 120:.2f}x of it), peak RSS {peak_gb:.2f} GB "
        f"(target 8 GB: {peak_gb / 8:.2f}x), index files {sized:.2f} GB"
    )
    # spot check: the last sample ends inside the stream
    assert sample_idx[-1, 0] < docs and sample_idx[-1, 1] < sizes[doc_idx[sample_idx[-1, 0]]]

    row = (
        f"| {datetime.date.today()} | {platform.machine()} {os.cpu_count()} cores | {args.scale:g} | "
        f"{docs:,} | {total:,} | {num_samples:,} | {timings['doc_idx']:.1f} | {timings['sample_idx']:.1f} | "
        f"{timings['shuffle_idx']:.1f} | {build:.1f} | {peak_gb:.2f} | {os.getloadavg()[0]:.1f} |"
    )
    add_row(Path(args.results), BUILD_HEADING, BUILD_HEADER, row)


if __name__ == "__main__":
    main()
