"""Preprocessing throughput against the bare tokenizer, and memory as the input grows 10x.

    python benchmarks/bench_preprocess.py [--data ../shared/data/minipile] [--max-mb 4]

Runs in child processes (each configuration `--repeats` times, the fastest counts): the bare
`encode_batch` of the same documents (the ceiling), `preprocess` with 1 and 2 workers (ratios to
the bare speed), and 2 workers on the input repeated 10x (peak RSS, ru_maxrss of the child and
its workers, should stay flat).
Appends the results to benchmarks/results/preprocess.md.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sample_input(data_dir: Path, max_mb: float, out: Path) -> int:
    """An equal share of ~max_mb of text from every subset of `data_dir`, into one jsonl; returns docs."""
    import zstandard

    paths = sorted(data_dir.glob("*.jsonl.zst"))
    if not paths:
        raise SystemExit(f"no *.jsonl.zst files in {data_dir}")
    share, docs = int(max_mb * 1e6 / len(paths)), 0
    with open(out, "w") as w:
        for path in paths:
            used = 0
            with open(path, "rb") as f:
                for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
                    w.write(line)
                    used += len(json.loads(line)["text"].encode())
                    docs += 1
                    if used >= share:
                        break
    return docs


def run_child(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB the child reports for itself and its workers, stdout)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err}")
    peak = float(out.strip().splitlines()[-1].split("peak_mb=")[1]) if "peak_mb=" in out else float("nan")
    return wall, peak, out


CHILD_BARE = """
import json, resource, sys, time
from megatron_lev.data.tokenizers import build_tokenizer
tok = build_tokenizer("hf", sys.argv[1])
texts = [json.loads(l)["text"] for l in open(sys.argv[2])]
tok.encode_batch(texts[:50])
t, c = time.perf_counter(), time.process_time()
n = 0
for i in range(0, len(texts), 512):
    n += sum(len(x) + 1 for x in tok.encode_batch(texts[i:i + 512]))
dt, cpu = time.perf_counter() - t, time.process_time() - c
print(json.dumps({"tokens": n, "seconds": dt, "cpu_seconds": cpu}))
print("peak_mb=%.1f" % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
"""

CHILD_PREPROCESS = """
import json, resource, sys
from megatron_lev.data.preprocess import PreprocessOptions, preprocess
def cpu():
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
c = cpu()
s = preprocess(PreprocessOptions([sys.argv[2]], sys.argv[3], "hf", sys.argv[1], workers=int(sys.argv[4]),
                                 progress=False))
print(json.dumps({"tokens": s["tokens"], "seconds": s["seconds"], "cpu_seconds": cpu() - c}))
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
           resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print("peak_mb=%.1f" % (peak / 1024))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "minipile"))
    p.add_argument(
        "--tokenizer", default=str(ROOT.parent / "shared" / "data" / "tokenizers" / "gpt-neox-20b.json")
    )
    p.add_argument("--max-mb", type=float, default=4.0, help="text per run (the memory run uses 10x this)")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration; the fastest counts")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "preprocess.md"))
    args = p.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = sample_input(Path(args.data), args.max_mb, tmp / "in.jsonl")
        big = tmp / "big.jsonl"
        with open(big, "wb") as w:
            for _ in range(10):
                w.write((tmp / "in.jsonl").read_bytes())
        print(f"input: {docs:,} documents, {args.max_mb:g} MB of text (memory run: 10x)", flush=True)
        rows = {}
        for label, threads in (
            ("bare encode_batch, 1 thread", "1"),
            ("bare encode_batch, all threads", None),
        ):
            env = {"RAYON_NUM_THREADS": threads} if threads else {}
            for _ in range(args.repeats):
                _, peak, out = run_child([py, "-c", CHILD_BARE, args.tokenizer, str(tmp / "in.jsonl")], env)
                r = json.loads(out.splitlines()[0])
                rows[label] = max(
                    rows.get(label, (0, 0, 0)),
                    (r["tokens"] / r["seconds"], peak, r["tokens"] / r["cpu_seconds"]),
                )
            print(
                f"{label:34s} {rows[label][0] / 1e3:8.0f}k tok/s  {rows[label][2] / 1e3:6.0f}k tok/CPU-s  "
                f"peak {rows[label][1]:6.0f} MB",
                flush=True,
            )
        for workers, src, label in (
            (1, "in.jsonl", "preprocess, 1 worker"),
            (2, "in.jsonl", "preprocess, 2 workers"),
            (2, "big.jsonl", "preprocess, 2 workers, 10x input"),
        ):
            for _ in range(args.repeats if src == "in.jsonl" else 1):
                _, peak, out = run_child(
                    [
                        py,
                        "-c",
                        CHILD_PREPROCESS,
                        args.tokenizer,
                        str(tmp / src),
                        str(tmp / "out"),
                        str(workers),
                    ],
                    {"RAYON_NUM_THREADS": "1"} if workers == 1 else {},
                )
                r = json.loads(out.splitlines()[0])
                rows[label] = max(
                    rows.get(label, (0, 0, 0)),
                    (r["tokens"] / r["seconds"], peak, r["tokens"] / r["cpu_seconds"]),
                )
            print(
                f"{label:34s} {rows[label][0] / 1e3:8.0f}k tok/s  {rows[label][2] / 1e3:6.0f}k tok/CPU-s  "
                f"peak {rows[label][1]:6.0f} MB",
                flush=True,
            )
    bare1, bare1_cpu = rows["bare encode_batch, 1 thread"][0], rows["bare encode_batch, 1 thread"][2]
    (one, _, one_cpu), (two, _, two_cpu) = rows["preprocess, 1 worker"], rows["preprocess, 2 workers"]
    mem1, mem10 = rows["preprocess, 2 workers"][1], rows["preprocess, 2 workers, 10x input"][1]
    summary = (
        f"wall clock: 1 worker / bare (1 thread) = {one / bare1:.2f} (target >= 0.85), "
        f"2 workers / 1 worker = "
        f"{two / one:.2f} (target >= 1.7). Per CPU-second (robust to other load): 1 worker / bare = "
        f"{one_cpu / bare1_cpu:.2f}, 2 workers / 1 worker = {two_cpu / one_cpu:.2f} (2 workers on 2 free "
        f"cores would reach ~2x this). Peak RSS 10x input / 1x = {mem10 / mem1:.2f} (flat = 1.0)"
    )
    print(summary)
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        out.write_text(
            "# Preprocessing throughput (bench_preprocess.py)\n\nGPT-NeoX-20B tokenizer on minipile "
            "documents drawn round-robin from every subset. Tokens include the EOD per document. "
            "Peak RSS is ru_maxrss of the child process and the workers it waited for.\n"
        )
    with open(out, "a") as f:
        f.write(
            f"\n## {datetime.datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.1f}, {args.max_mb:g} MB input ({docs:,} documents)\n\n"
            "| run | tokens/s (wall) | tokens per CPU-second | peak RSS MB |\n|---|---|---|---|\n"
        )
        for label, (tps, peak, tpc) in rows.items():
            f.write(f"| {label} | {tps:,.0f} | {tpc:,.0f} | {peak:,.0f} |\n")
        f.write(f"\n{summary}\n")
    print(f"recorded in {out}")


if __name__ == "__main__":
    main()
