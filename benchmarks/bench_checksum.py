"""Start-up cost of checking a large shard set, cold: the chunk sample against the whole-file sha256.

    python benchmarks/bench_checksum.py --gb 8          # writes an 8 GB shard under a temp directory

Writes one shard of random tokens (`IndexedDatasetBuilder`, uint16) and its manifest with chunk
digests (`preprocess`'s `write_manifest`), then times, each after dropping the page cache (root on
Linux; otherwise the run says the cache was warm): `verify_shard_set` as a start runs it (size checks
and a random sample of chunks, at most `SAMPLE_BYTES`), and the whole-file sha256 that a start did
before (and still does for a manifest without chunk digests, once per file version). Both are
extrapolated to a 600 GB shard: the whole-file time in proportion to the bytes, the sample's as it
is (the sample does not grow with the file). Appends to benchmarks/results/checksum.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "checksum.md"
PILE_BIN = 600e9


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def write_shard(prefix: Path, gb: float) -> int:
    import numpy as np

    from megatron_lev.data.indexed import IndexedDatasetBuilder
    from megatron_lev.data.manifest import write_manifest

    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, np.uint16)
    doc = 1 << 20  # tokens per document (2 MiB)
    block = rng.integers(0, 50000, size=doc * 16, dtype=np.uint16)
    written = 0
    while written < gb * 1e9:
        builder.add_raw(block.tobytes(), np.full(16, doc, dtype=np.int32))
        written += block.nbytes
    builder.finalize()
    fp = {
        "type": "hf",
        "name": "bench",
        "file": "bench.json",
        "sha256": "0" * 64,
        "vocab_size": 50304,
        "eod": 0,
    }
    write_manifest(prefix, [str(prefix)], fp, 49999, known_sha256=builder.sha256)
    return Path(f"{prefix}.bin").stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="size of the shard to write (GB)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write it (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("MEGATRON_LEV_CACHE_DIR", tempfile.mkdtemp(prefix="bench-checksum-cache-"))
    from megatron_lev.data import manifest as mf

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        prefix = Path(tmp) / "big"
        start = time.perf_counter()
        size = write_shard(prefix, args.gb)
        written = time.perf_counter() - start
        mf._memory.clear()
        cold = drop_page_cache()
        start = time.perf_counter()
        mf.verify_shard_set(prefix)
        sampled = time.perf_counter() - start
        cold = drop_page_cache() and cold
        start = time.perf_counter()
        mf.sha256_file(f"{prefix}.bin")
        whole = time.perf_counter() - start
    rate = size / whole
    print(
        f"{size / 1e9:.2f} GB shard (written with its manifest in {written:.0f} s); "
        f"{'cold' if cold else 'WARM (could not drop the page cache)'}: start-up check {sampled:.2f} s "
        f"(sample of at most {mf.SAMPLE_BYTES >> 20} MiB), whole-file sha256 {whole:.1f} s "
        f"({rate / 1e9:.2f} GB/s); "
        f"at 600 GB: {sampled:.2f} s against {PILE_BIN / rate:.0f} s",
        flush=True,
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    from results_file import append_section

    append_section(
        RESULTS,
        "# Start-up checksum cost (benchmarks/bench_checksum.py)\n\nOne large shard with its manifest; "
        "the check a start runs (a sample of chunk digests) against the whole-file sha256 a start "
        "ran before, each with a cold page cache.\n",
        f"\n## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"load {load:.1f}, page cache {'dropped' if cold else 'warm'}\n\n"
        "| shard | start-up check (s) | whole-file sha256 (s) | sha256 GB/s | at 600 GB: start-up (s) "
        "| at 600 GB: whole file (s) |\n|---|---|---|---|---|---|\n"
        f"| {size / 1e9:.2f} GB | {sampled:.2f} | {whole:.1f} | {rate / 1e9:.2f} | {sampled:.2f} "
        f"| {PILE_BIN / rate:.0f} |\n",
    )


if __name__ == "__main__":
    main()
