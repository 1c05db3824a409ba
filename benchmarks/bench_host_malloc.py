"""A CPU training step under three host-allocation settings: the defaults, torch's transparent huge
pages, glibc's mmap off.

    python benchmarks/bench_host_malloc.py                       # the regime experiment's model shape
    python benchmarks/bench_host_malloc.py --embeddings tied --steps 5 --repeats 1

The model is `pretrain/configs/tiny.yaml` at the given width, depth, heads, sequence, micro-batch and
vocabulary (LEV keeps tiny.yaml's own hyperparameters). Each measurement is a fresh process running
the bare step (forward, backward, clip, AdamW) of one
model for --steps steps after --warmup, on random token ids; the settings alternate (off, thp,
heap, off, ...) so that other load on the machine falls on all of them. Reported per step: wall
time, user and system CPU time and minor page faults (`getrusage`); the peak RSS and the RSS after
the last step; the wall-time ratio against the defaults; and whether every process logged the same
losses. Appended to benchmarks/results/host_malloc.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "host_malloc.md"
SETTINGS = ("off", "thp", "heap")  # glibc's and torch's defaults; torch's THP allocation; glibc's mmap off


def _bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", HERE / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(args) -> None:
    if args.child == "heap":
        from megatron_lev.utils.host_malloc import keep_freed_memory

        if not keep_freed_memory(force=True):
            raise SystemExit("keep_freed_memory() did not apply (not glibc?)")
    import torch

    from megatron_lev.engine.build import build_model

    bt = _bench_train()
    cfg = bt._config(args, args.embedding)
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_spec

    model = build_model(model_spec(cfg, args.vocab), SINGLE)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    step = bt.bare_step(model, opt, bt._batches(args, args.vocab, torch.device("cpu")), cfg.train.clip_grad)

    for _ in range(args.warmup):
        step()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    n = args.steps
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    print(
        json.dumps(
            {
                "wall": (t1 - t0) / n,
                "user": (r1.ru_utime - r0.ru_utime) / n,
                "sys": (r1.ru_stime - r0.ru_stime) / n,
                "minflt": (r1.ru_minflt - r0.ru_minflt) / n,
                "peak_rss": r1.ru_maxrss / 2**20,  # KiB on Linux
                "rss": rss,
                "losses": losses,
            }
        )
    )


def measure(args, embedding: str, setting: str) -> dict:
    cmd = [sys.executable, __file__, "--child", setting, "--embeddings", embedding]
    for key in ("hidden", "layers", "heads", "seq", "micro_batch", "vocab", "steps", "warmup"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "DS_ACCELERATOR": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("GLIBC_TUNABLES", None)  # the settings differ by the call or THP_MEM_ALLOC_ENABLE alone
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    env.pop("MEGATRON_LEV_HOST_MALLOC", None)
    if setting == "thp":
        env["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch at its first allocation
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{embedding}/{setting} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=SETTINGS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--embeddings", nargs="+", default=["tied", "lev"])
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="processes per setting and embedding")
    p.add_argument("--note", default="", help="what else ran on the machine, written into the record")
    args = p.parse_args()
    args.zero, args.precision = 0, "fp32"  # read by bench_train._config
    if args.child:
        args.embedding = args.embeddings[0]
        child(args)
        return

    import torch

    keys = ("wall", "user", "sys", "minflt", "peak_rss", "rss")
    rows = []
    for emb in args.embeddings:
        got = {s: [] for s in SETTINGS}
        for _ in range(args.repeats):
            for setting in SETTINGS:
                got[setting].append(measure(args, emb, setting))
                m = got[setting][-1]
                print(
                    f"{emb:5s} {setting:4s} {1e3 * m['wall']:8.1f} ms/step  user {1e3 * m['user']:7.1f}  "
                    f"sys {1e3 * m['sys']:7.1f}  minflt {m['minflt']:9.0f}  "
                    f"peak RSS {m['peak_rss']:.2f} GiB  RSS {m['rss']:.2f} GiB",
                    flush=True,
                )
        same = all(r["losses"] == got["off"][0]["losses"] for runs in got.values() for r in runs)
        med = {s: {k: statistics.median(r[k] for r in got[s]) for k in keys} for s in SETTINGS}
        rows.append((emb, med, same))
        print(
            f"{emb}: wall off / thp {med['off']['wall'] / med['thp']['wall']:.2f}, off / heap "
            f"{med['off']['wall'] / med['heap']['wall']:.2f}, losses identical: {same}"
        )
    tokens = args.micro_batch * args.seq
    head = (
        f"\n## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, cpu, "
        f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}\n\n"
        f"`python benchmarks/bench_host_malloc.py` with hidden {args.hidden}, layers {args.layers}, seq "
        f"{args.seq}, micro-batch {args.micro_batch} ({tokens} tokens/step), vocab {args.vocab}, fp32, "
        f"{args.steps} timed steps after {args.warmup}; median of {args.repeats} processes per setting, "
        "the settings alternated." + (f" {args.note}" if args.note else "") + "\n\n"
        "| embedding | setting | ms/step | user ms | sys ms | page faults/step | peak RSS GiB "
        "| RSS after GiB | off / setting (wall) | off / setting (CPU) | losses identical |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = "".join(
        f"| {e} | {s} | {1e3 * m[s]['wall']:.1f} | {1e3 * m[s]['user']:.1f} | {1e3 * m[s]['sys']:.1f} | "
        f"{m[s]['minflt']:.0f} | {m[s]['peak_rss']:.2f} | {m[s]['rss']:.2f} | "
        f"{m['off']['wall'] / m[s]['wall']:.2f} | "
        f"{(m['off']['user'] + m['off']['sys']) / (m[s]['user'] + m[s]['sys']):.2f} | "
        f"{'yes' if same else 'NO'} |\n"
        for e, m, same in rows
        for s in SETTINGS
    )
    from results_file import append_section

    append_section(
        RESULTS,
        "# Host memory allocation in a CPU training step (benchmarks/bench_host_malloc.py)\n\n"
        "`off`: glibc's and torch's defaults; `thp`: `THP_MEM_ALLOC_ENABLE=1` (torch page-aligns its "
        "CPU allocations and asks for transparent huge pages on those of 2 MiB and more); `heap`: "
        "glibc's mmap off and its trimming off (freed memory stays in the heap). "
        "off / setting > 1: the setting saves that factor.\n",
        head + lines,
    )


if __name__ == "__main__":
    main()
