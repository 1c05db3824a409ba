"""Activation memory and step time: no recompute, selective (the attention core) and whole blocks, on CPU.

    python benchmarks/bench_recompute.py                    # 4 x 384, seq 1024, batch 4, documents on
    python benchmarks/bench_recompute.py --no-documents     # causal SDPA (its CPU kernel keeps no scores)

The study's model width (4 layers x 384, 6 heads, TIED, 2,048-piece vocabulary) at a longer sequence,
fp32, one thread. With `--documents` (the default) every row packs documents of 256 tokens and the
attention takes a document mask, so the scaled-dot-product path materialises its `(B, H, S, S)`
scores: what selective recompute saves. Each case runs in its own process: the bytes autograd keeps
for backward in one step (outside the checkpointed regions: the activation memory, exact and
repeatable), the peak resident set above the built model (forward + backward after a warm-up step;
the allocator makes it noisy) and the median CPU time of `--steps` steps. Each case is a separate process.
Results are appended to results/recompute.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "recompute.md"
CASES = {
    "none": [],
    "selective": ["model.recompute_attention=true"],
    "full": ["model.activation_checkpointing=true"],
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(case: str, seq: int, batch: int, steps: int, documents: bool) -> dict:
    import torch

    from megatron_lev.config import load_config
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.recompute import apply_activation_checkpointing
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_spec

    torch.set_num_threads(1)
    over = [
        "model.num_layers=4",
        "model.hidden_size=384",
        "model.num_attention_heads=6",
        f"model.seq_length={seq}",
        "model.embedding=tied",
        "train.eval_interval=0",
        *CASES[case],
    ]
    cfg = load_config(None, over)
    model = apply_activation_checkpointing(build_model(model_spec(cfg, 2048), SINGLE), cfg.model).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (batch, seq + 1), generator=gen)
    extra = {}
    if documents:
        extra = {
            "position_ids": torch.arange(seq).repeat(batch, 1) % 256,
            "document_ids": (torch.arange(seq) // 256).repeat(batch, 1),
        }

    saved = [0]

    def pack(t):  # what autograd keeps for backward outside any checkpointed region
        saved[0] += t.numel() * t.element_size()
        return t

    def step():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids[:, :-1], ids[:, 1:], reduction="mean", **extra)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    loss = step()  # warm-up: allocator and kernels; counts what one step saves for backward
    kept = saved[0]
    base = _rss()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(steps):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "peak_extra": max(peak, peak_before) - base,
        "saved": kept,
        "cpu_s": statistics.median(times),
        "loss": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-documents", action="store_true")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    documents = not args.no_documents
    if args.one:
        case, _ = args.one
        print(json.dumps(one(case, args.seq, args.batch, args.steps, documents)))
        return
    load = os.getloadavg()
    got = {}
    for case in CASES:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            case,
            "x",
            "--seq",
            str(args.seq),
            "--batch",
            str(args.batch),
        ]
        cmd += ["--steps", str(args.steps)] + (["--no-documents"] if args.no_documents else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{case} failed: {out.stderr[-2000:]}")
        got[case] = json.loads(out.stdout.strip().splitlines()[-1])
        r = got[case]
        mib = r["peak_extra"] / 2**20
        print(f"{case}: peak extra {mib:.0f} MiB, CPU {r['cpu_s']:.2f} s/step, loss {r['loss']:.4f}")
    rows = [
        "| recompute | saved for backward | vs none | peak RSS extra (noisy) | CPU s / step | vs none |",
        "|---|---|---|---|---|---|",
    ]
    none = got["none"]
    for case, r in got.items():
        kept, cpu, rss = r["saved"], r["cpu_s"], r["peak_extra"]
        rows.append(
            f"| {case} | {kept / 2**20:,.0f} MiB | {kept / none['saved']:.2f} | {rss / 2**20:,.0f} MiB "
            f"| {cpu:.2f} | {cpu / none['cpu_s']:.2f} |"
        )
    print("\n".join(rows))
    if args.no_record:
        return
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    flag = " --no-documents" if args.no_documents else ""
    attention = (
        "documents of 256 tokens (a document mask: materialised scores)" if documents else "causal SDPA"
    )
    head = (
        f"\n## {stamp}\n\n`python benchmarks/bench_recompute.py --seq {args.seq} --batch {args.batch} "
        f"--steps {args.steps}{flag}`; {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{load[0]:.1f} / {load[1]:.1f}; 4 x 384, 6 heads, TIED, V 2,048, fp32, one thread; {attention}.\n\n"
    )
    sys.path.insert(0, str(ROOT))
    from benchmarks.results_file import append_section

    append_section(
        RESULTS,
        "# Recompute: none, selective, whole blocks (bench_recompute.py)\n",
        head + "\n".join(rows) + "\n",
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
