"""The output head + cross-entropy, forward and backward: the logits path vs the fused chunked one.

    python benchmarks/bench_loss.py                       # hidden 640, 8 x 2048 tokens, V 50,304 and 200,064
    python benchmarks/bench_loss.py --tokens 4096 --vocabs 50304 --no-record

Each case runs in a fresh process (so its peak resident set is its own): the hidden states
`(tokens, hidden)` and the head `(V, hidden)` in fp32 with gradients, random targets below the real
vocabulary (50,277 of 50,304 rows, GPT-NeoX; 199,999 of 200,064, o200k_base), so the padding rows
are masked as in training. Measured: the peak resident set above what the inputs hold ("peak extra":
the loss's own memory, gradients of the inputs included), and the CPU time of one forward and
backward. The cases alternate old/new, so machine load falls on both alike.

The logits path at 200,064 rows and 8 x 2048 tokens needs about 3 x 13 GB and does not fit a 24 GB
machine: there it runs on `--old-tokens` tokens (default 4,096), the fused path on the same tokens
beside it, and its memory at the full token count is extrapolated linearly (the logits are linear in
tokens) and marked so. Also prints `plan.memory.loss_bytes`, the estimate the run's memory check
uses, against the measured peak of the fused path. Results are appended to results/loss.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "loss.md"
REAL = {50304: 50277, 200064: 199999}  # padded rows -> the tokenizer's vocabulary


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(path: str, rows: int, tokens: int, hidden: int, chunk: int | None) -> dict:
    """One forward + backward of `path` ("old" or "new") in this process: peak extra bytes, CPU s."""
    import torch

    from megatron_lev.model.loss import masked_mean, token_losses
    from megatron_lev.parallel.fused_cross_entropy import chunk_tokens_for, fused_linear_cross_entropy
    from megatron_lev.parallel.layout import SINGLE

    torch.manual_seed(0)
    real = REAL.get(rows, rows)
    h = torch.randn(tokens, hidden).requires_grad_()
    w = (torch.randn(rows, hidden) * 0.02).requires_grad_()
    target = torch.randint(0, real, (tokens,))
    base = _rss()
    start = time.process_time()
    if path == "old":
        loss = masked_mean(token_losses(h @ w.t(), target, real, layout=SINGLE))
    else:
        loss, _ = fused_linear_cross_entropy(h, w, target, real, layout=SINGLE, chunk_tokens=chunk)
    loss.backward()
    cpu = time.process_time() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "peak_extra": peak - base,
        "cpu_s": cpu,
        "loss": loss.item(),
        "chunk": chunk or chunk_tokens_for(rows, tokens),
    }


def run_case(path, rows, tokens, hidden, threads, chunk) -> dict:
    cmd = [sys.executable, __file__, "--one", path, str(rows), str(tokens), str(hidden), str(chunk or 0)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{path} V={rows} tokens={tokens} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def loss_estimate(rows: int, tokens: int, hidden: int, chunk: int | None) -> int:
    from megatron_lev.config import load_config
    from megatron_lev.plan.memory import loss_bytes

    cfg = load_config(
        None,
        [
            f"model.hidden_size={hidden}",
            "model.num_attention_heads=10",
            f"model.seq_length={tokens}",
            "train.micro_batch_size=1",
            f"model.loss_chunk_tokens={chunk or 0}",
        ],
    )
    return loss_bytes(cfg, rows)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--one", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument(
        "--old-tokens", type=int, default=4096, help="tokens of the logits path at 200,064 rows"
    )
    parser.add_argument("--vocabs", type=int, nargs="+", default=[50304, 200064])
    parser.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0: the default, from memory)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if args.one:
        path, rows, tokens, hidden, chunk = args.one
        print(json.dumps(one(path, int(rows), int(tokens), int(hidden), int(chunk) or None)))
        return

    load = os.getloadavg()
    table = []  # (V, tokens, old, new, old memory extrapolated from this many tokens or None)
    for rows in args.vocabs:
        old_tokens = args.tokens if rows < 100_000 else min(args.old_tokens, args.tokens)
        cases = [("old", old_tokens), ("new", old_tokens)]
        if old_tokens != args.tokens:
            cases.append(("new", args.tokens))
        got = {}
        for path, tokens in cases:
            got[(path, tokens)] = r = run_case(path, rows, tokens, args.hidden, args.threads, args.chunk)
            print(
                f"V={rows:,} {path} {tokens:,} tokens: peak extra {gib(r['peak_extra'])}, "
                f"CPU {r['cpu_s']:.1f} s, loss {r['loss']:.4f}",
                flush=True,
            )
        old = got[("old", old_tokens)]
        table.append((rows, old_tokens, old, got[("new", old_tokens)], None))
        if old_tokens != args.tokens:  # the logits are linear in tokens: scale the measured memory
            scaled = {**old, "peak_extra": old["peak_extra"] * args.tokens / old_tokens, "cpu_s": None}
            table.append((rows, args.tokens, scaled, got[("new", args.tokens)], old_tokens))
        estimate = loss_estimate(rows, args.tokens, args.hidden, args.chunk or None)
        new = got[("new", args.tokens)]
        print(f"V={rows:,}: estimate {gib(estimate)} vs measured {gib(new['peak_extra'])}", flush=True)
        table[-1] = (*table[-1], estimate)
    lines = [
        "| V (rows) | tokens | old peak extra | new peak extra | memory old/new | old CPU s | new CPU s "
        "| CPU new/old | chunk | plan.memory estimate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rows, tokens, old, new, scaled_from, *estimate in table:
        old_mem = gib(old["peak_extra"]) + (f" (from {scaled_from:,} tokens)" if scaled_from else "")
        old_cpu = f"{old['cpu_s']:.1f}" if old["cpu_s"] is not None else "-"
        ratio = f"{new['cpu_s'] / old['cpu_s']:.3f}" if old["cpu_s"] is not None else "-"
        lines.append(
            f"| {rows:,} | {tokens:,} | {old_mem} | {gib(new['peak_extra'])} "
            f"| **{old['peak_extra'] / new['peak_extra']:.1f}x** | {old_cpu} | {new['cpu_s']:.1f} | {ratio} "
            f"| {new['chunk']} | {gib(estimate[0]) if estimate else ''} |"
        )
    print("\n".join(lines))
    if args.no_record:
        return
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    head = (
        f"\n## {stamp}\n\n`python benchmarks/bench_loss.py --hidden {args.hidden} --tokens {args.tokens} "
        f"--old-tokens {args.old_tokens} --threads {args.threads}`; {platform.machine()}, {os.cpu_count()} "
        f"cores, load average {load[0]:.1f} / {load[1]:.1f} at the start. Head + loss forward and backward, "
        "fp32; peak extra = peak resident set above the inputs, each case in its own process.\n\n"
    )
    from benchmarks.results_file import append_section

    title = "# Output head + cross-entropy: logits path vs fused (bench_loss.py)\n"
    append_section(RESULTS, title, head + "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
