"""The project's training step against a Hugging Face `LlamaForCausalLM` step of the same shape, on CPU:
eager against eager, and (with --compile) compiled against compiled.

    python benchmarks/bench_hf_step.py                                  # study and regime shapes, eager
    python benchmarks/bench_hf_step.py --compile --steps 6              # also torch.compile'd, both sides

Both models: the same layers, width, heads, SwiGLU width, RoPE, RMSNorm, a tied table of the padded
vocabulary (the shape's `model.vocab_size`, else GPT-NeoX's; TIED, HF `tie_word_embeddings=True`),
fp32, one process, `--threads` threads. A
step is forward + backward + `torch.optim.AdamW` on the same random tokens, the project's model
through its training call (`reduction="mean"`: the fused head + loss by default, `--unfused` for the
logits path). The cases take turns step by step (round-robin) so the machine's load falls on all of
them alike; the figure is the median CPU time per step (process time) after `--warmup` steps, each
compiled case's compile time given apart. Results are appended to results/hf_step.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "hf_step.md"
SHAPES = {
    "study": ROOT / "pretrain" / "configs" / "experiments" / "small" / "study.yaml",
    "regime": ROOT / "pretrain" / "configs" / "experiments" / "regime" / "regime.yaml",
}
NEOX = 50277


def build_cases(shape: str, batch: int, compile_: bool, fused: bool):
    """name -> (model, optimizer, step function) for this shape."""
    from megatron_lev.config import load_config
    from megatron_lev.convert.hf_writer import llama_config
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.compile import apply_compile
    from megatron_lev.model.vocab import padded_vocab_size
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_spec

    cfg = load_config(
        [str(SHAPES[shape])],
        [
            "model.embedding=tied",
            f"model.fused_loss={str(fused).lower()}",
            "model.compile=false",
            "train.eval_interval=0",
        ],
    )
    real = cfg.model.vocab_size or NEOX  # the shape's own vocabulary where it names one
    vocab = padded_vocab_size(real, cfg.model, 1)
    seq = cfg.model.seq_length
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, real, (batch, seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]  # (B, S) each

    def ours():
        return build_model(model_spec(cfg, real), SINGLE)

    def hf():
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(llama_config(cfg.model, vocab, True, torch.float32))
        model.config._attn_implementation = "sdpa"
        return model

    def step_ours(model):
        return model(inputs, labels, reduction="mean")

    def step_hf(model):  # HF's convention: labels are the inputs, shifted inside (S - 1 targets)
        return model(input_ids=inputs, labels=inputs).loss

    cases = {}
    for name, make, step in (("project", ours, step_ours), ("hf-llama", hf, step_hf)):
        variants = [(False, "eager")] + ([(True, "compiled")] if compile_ else [])
        for on, label in variants:
            model = make()
            if on and name == "project":
                model = apply_compile(model, dataclasses.replace(cfg.model, compile=True))
            elif on:
                for layer in model.model.layers:
                    layer.compile(dynamic=False)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            cases[f"{name} {label}"] = (model, opt, step)
    return cases, cfg, vocab


def run_step(model, opt, step) -> float:
    start = time.process_time()
    opt.zero_grad(set_to_none=True)
    loss = step(model)
    loss.backward()
    opt.step()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per case")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="also both sides torch.compile'd, per block")
    parser.add_argument(
        "--unfused", action="store_true", help="the project's logits path, not the fused loss"
    )
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    lines = []
    for shape in args.shapes:
        cases, cfg, vocab = build_cases(shape, args.batch, args.compile, not args.unfused)
        times = {name: [] for name in cases}
        first = {}
        for i in range(args.warmup + args.steps):
            for name, (model, opt, step) in cases.items():
                t = run_step(model, opt, step)
                if i == 0:
                    first[name] = t
                if i >= args.warmup:
                    times[name].append(t)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        m = cfg.model
        desc = (
            f"{shape}: {m.num_layers} x {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, "
            f"batch {args.batch}, V {vocab:,} (tied)"
        )
        print(desc)
        rows = []
        for kind in ("eager", "compiled"):
            ours, theirs = med.get(f"project {kind}"), med.get(f"hf-llama {kind}")
            if ours is None:
                continue
            compile_s = ""
            if kind == "compiled":
                ours_first, theirs_first = first[f"project {kind}"], first[f"hf-llama {kind}"]
                compile_s = f"first step {ours_first:.0f} s / {theirs_first:.0f} s (compile)"
            row = f"| {shape} | {kind} | {ours:.3f} | {theirs:.3f} | **{ours / theirs:.3f}** | {compile_s} |"
            rows.append(row)
            print(f"  {kind}: project {ours:.3f} s, HF {theirs:.3f} s, ratio {ours / theirs:.3f} {compile_s}")
        if args.compile:
            ratio = med["project compiled"] / med["project eager"]
            print(f"  project compiled / eager: {ratio:.3f}")
            rows.append(f"| {shape} | project compiled / eager | | | **{ratio:.3f}** | |")
        lines.append((desc, rows))
        del cases
    if args.no_record:
        return
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    flags = f"{' --compile' if args.compile else ''}{' --unfused' if args.unfused else ''}"
    text = [
        f"\n## {stamp}\n\n`python benchmarks/bench_hf_step.py --steps {args.steps} --warmup {args.warmup} "
        f"--threads {args.threads}{flags}`; "
        f"{platform.machine()}, {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} at the "
        f"start; torch {torch.__version__}. Median CPU seconds per step (forward, backward, AdamW), the "
        "cases round-robin.\n",
    ]
    for desc, rows in lines:
        text += [
            f"\n{desc}\n\n| shape | case | project s | HF Llama s | project / HF | note |",
            "|---|---|---|---|---|---|",
        ]
        text += rows
    sys.path.insert(0, str(ROOT))
    from benchmarks.results_file import append_section

    append_section(
        RESULTS,
        "# Training step: the project vs Hugging Face Llama (bench_hf_step.py)\n",
        "\n".join(text) + "\n",
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
