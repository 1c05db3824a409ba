"""Benchmark the LEV input layer against a dense table, one transformer block, and a naive LEV.

    python benchmarks/bench_lev.py            # micro-batch 8 x 2048, V = 50,277, D = 1024
    python benchmarks/bench_lev.py --quick    # 2 x 2048, fewer repeats, materialize extrapolated
    python benchmarks/bench_lev.py --text     # tokens from minipile text instead of a Zipf draw

Each case runs in its own subprocess so its peak memory can be read cleanly (CUDA:
max_memory_allocated; CPU: ru_maxrss minus the resident size before the timed step).
Prints ratios and appends a table to benchmarks/results/lev.md.
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
sys.path.insert(0, str(ROOT))

V_PILE, V_O200K, D = 50_277, 200_019, 1024


def _tokens(args, count: int):
    import torch

    if args.text:
        import io

        import zstandard
        from tokenizers import Tokenizer

        data = Path(args.data)
        tok = Tokenizer.from_file(str(data / "tokenizers" / "gpt-neox-20b.json"))
        ids: list[int] = []
        for path in sorted((data / "minipile").glob("*.jsonl.zst")):
            with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
                for line in io.TextIOWrapper(r, encoding="utf-8"):
                    ids.extend(tok.encode(json.loads(line)["text"]).ids)
                    if len(ids) >= count:
                        return torch.tensor(ids[:count])
        raise SystemExit(f"not enough text under {data / 'minipile'} for {count} tokens")
    gen = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, V_PILE + 1, dtype=torch.float64)
    order = torch.randperm(V_PILE, generator=gen)  # Zipf(1.0) frequencies on shuffled ids
    return order[torch.multinomial(1.0 / ranks, count, replacement=True, generator=gen)]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _naive_lev(emb, ids):
    """A direct port: every token, dense kappa-wide basis, stores [tokens, h, d_seed, r]."""
    import torch
    import torch.nn.functional as F

    from megatron_lev.model.embeddings.spline import spline_basis

    z = emb.codebooks(ids.reshape(-1))  # (N, d)
    y = torch.einsum("nd,hed->nhe", z, emb.proj)
    u = torch.sigmoid(F.layer_norm(y, (y.shape[-1],), eps=1e-5) * emb.norm_weight + emb.norm_bias).clamp(0, 1)
    phi = torch.einsum("nhjm,hjmr->nhjr", spline_basis(u, emb.lev.kappa), 1 + emb.delta)  # (N, h, d, r)
    sign = 1.0 - 2.0 * ((phi < 0).sum(2) % 2).to(phi.dtype)
    modes = sign * torch.exp(torch.log(phi.abs() + 1e-9).sum(2))  # (N, h, r)
    return (modes.flatten(1) @ emb.out_proj.flatten(0, 1)).view(*ids.shape, -1)


def _lev_module(ref: str | None):
    """The LEV module of this tree, or of git revision `ref` (its lev.py and spline.py), for A/B in one
    run."""
    if not ref:
        from megatron_lev.model.embeddings import lev

        return lev
    import types

    def source(name):
        path = f"{ref}:megatron_lev/model/embeddings/{name}.py"
        res = subprocess.run(["git", "show", path], cwd=ROOT, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"--ref {ref}: cannot read {path}: {res.stderr.strip()}")
        return res.stdout

    spline, lev = types.ModuleType("spline_ref"), types.ModuleType("lev_ref")
    exec(compile(source("spline"), f"{ref}/spline.py", "exec"), spline.__dict__)
    exec(compile(source("lev"), f"{ref}/lev.py", "exec"), lev.__dict__)
    lev.active_basis = spline.active_basis
    return lev


def run_case(args) -> dict:
    """One case in this process: time `--repeats` fwd+bwd steps after a warm-up; measure peak memory."""
    import torch

    from megatron_lev.config import LevConfig, ModelConfig

    torch.manual_seed(0)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    ref = args.case.endswith("_ref")
    if args.case == "lev_torch":  # the PyTorch path: the spawner switched the CPU kernel off
        args.case = "lev"
    lev_module = _lev_module(args.ref if ref else None)
    args.case = args.case.removesuffix("_ref")
    if args.case == "materialize":  # rows 0..tokens-1: no token draw
        ids = None
        info = {"case": args.case, "tokens": args.tokens, "unique": args.tokens}
    else:
        ids = _tokens(args, args.tokens).view(-1, min(args.tokens, 2048)).to(dev)
        info = {"case": args.case, "tokens": args.tokens, "unique": int(ids.unique().numel())}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if args.case == "materialize":
        emb = lev_module.LevEmbedding(V_O200K, D, LevConfig()).to(dev)
        rows = args.tokens
        step = lambda: emb.embed_ids(torch.arange(rows, device=dev)) if rows < V_O200K else emb.materialize()  # noqa: E731
        with torch.no_grad():
            emb.embed_ids(torch.arange(min(rows, 512), device=dev))  # warm-up on a slice
            sync()
            t0 = time.perf_counter()
            step()
            sync()
        elapsed = time.perf_counter() - t0
        info.update(seconds=elapsed, rows=rows, full_seconds=elapsed * V_O200K / rows)
        return info

    if args.case in ("lev", "lev_norecompute", "naive"):
        model = lev_module.LevEmbedding(V_PILE, D, LevConfig(recompute=args.case != "lev_norecompute")).to(
            dev
        )
        forward = (lambda x: _naive_lev(model, x)) if args.case == "naive" else model
        inputs = ids
    elif args.case == "dense":
        model = torch.nn.Embedding(V_PILE, D).to(dev)
        forward, inputs = model, ids
    elif args.case == "block":
        from megatron_lev.model.block import TransformerBlock

        cfg = ModelConfig(hidden_size=D, num_attention_heads=16, num_layers=1, seq_length=ids.shape[1])
        model = TransformerBlock(cfg, 0, seed=0).to(dev)
        forward = model
        inputs = torch.randn(*ids.shape, D, device=dev, requires_grad=True)
    else:
        raise SystemExit(f"unknown case {args.case}")

    def step():
        out = forward(inputs)
        out.float().square().mean().backward()

    warm = inputs if args.case == "block" else inputs[:, :256]
    out = forward(warm)  # warm-up (lazy imports, allocator) on a slice
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    info.update(seconds=min(times), peak_mb=max(0, peak - base) / 2**20)
    return info


def _spawn(args, case: str, tokens: int, repeats: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--case",
        case,
        "--tokens",
        str(tokens),
        "--repeats",
        str(repeats),
        "--device",
        args.device,
        "--data",
        args.data,
    ] + (["--text"] if args.text else [])
    cmd += ["--ref", args.ref] if args.ref else []
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    if case == "lev_torch":
        env["MEGATRON_LEV_CPU_KERNEL"] = "0"
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode:
        raise SystemExit(f"case {case} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(
        f"  {case:12s} tokens={tokens:6d} unique={out['unique']:6d} {out['seconds']:8.3f} s"
        + (f"  peak +{out['peak_mb']:.0f} MB" if "peak_mb" in out else "")
        + f"   (case wall {time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="2 x 2048 tokens, one repeat, extrapolated materialize"
    )
    p.add_argument("--text", action="store_true", help="tokenise minipile text instead of drawing Zipf ids")
    p.add_argument(
        "--data",
        default=str(Path("..") / "shared" / "data"),
        help="shared data folder (tokenizer + minipile), relative to the repository root",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--naive-tokens", type=int, default=None, help="tokens for the naive LEV (memory-bound)")
    p.add_argument(
        "--materialize-rows",
        type=int,
        default=None,
        help=f"rows timed for materialize (default: all {V_O200K:,}; --quick on CPU: 8192, extrapolated)",
    )
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "lev.md"))
    p.add_argument(
        "--ref", default=None, help="git revision whose LEV code is timed in the same run (A/B), e.g. HEAD~3"
    )
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not Path(args.data).is_absolute():
        args.data = str((ROOT / args.data).resolve())
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.case:
        print(json.dumps(run_case(args)))
        return 0

    tokens = (2 if args.quick else 8) * 2048
    repeats = 1 if args.quick else 2
    cuda = args.device == "cuda"
    # naive LEV holds several [tokens, h, d_seed, r] fp32 tensors (256 KB per token each)
    naive_tokens = args.naive_tokens or (tokens if cuda else (512 if args.quick else 1024))
    mat_rows = min(V_O200K, args.materialize_rows or (V_O200K if (cuda or not args.quick) else 8192))
    print(
        f"LEV benchmark on {args.device}: {tokens} tokens, D={D}, V={V_PILE}, "
        f"{'minipile text' if args.text else 'Zipf ids'}",
        flush=True,
    )
    names = ("lev", "lev_norecompute", "dense", "block") + (("lev_torch",) if args.device == "cpu" else ())
    r = {name: _spawn(args, name, tokens, repeats) for name in names}
    r["lev_small"] = _spawn(args, "lev", naive_tokens, repeats)
    r["naive"] = _spawn(args, "naive", naive_tokens, repeats)
    r["materialize"] = _spawn(args, "materialize", mat_rows, 1)
    if args.ref:  # the same cases with the reference revision's LEV code, right after
        r["lev_ref"] = _spawn(args, "lev_ref", tokens, repeats)
        r["materialize_ref"] = _spawn(args, "materialize_ref", min(mat_rows, 4096), 1)

    lev, block, dense = r["lev"]["seconds"], r["block"]["seconds"], r["dense"]["seconds"]
    speedup = r["naive"]["seconds"] / r["lev_small"]["seconds"]
    mat = r["materialize"]["full_seconds"]
    print(f"LEV / block time      {lev / block:7.3f}   (target <= 0.10)")
    print(f"LEV / dense time      {lev / dense:7.1f}")
    print(f"LEV peak memory       {r['lev']['peak_mb']:7.0f} MB (target <= 1024)")
    norec = r["lev_norecompute"]
    print(f"recompute off         {norec['seconds'] / lev:7.3f}x the time, peak {norec['peak_mb']:.0f} MB")
    print(
        f"speed-up over naive   {speedup:7.1f}x at {naive_tokens} tokens "
        f"(naive peak {r['naive']['peak_mb']:.0f} MB vs LEV {r['lev_small']['peak_mb']:.0f} MB)"
    )
    print(
        f"materialize V={V_O200K}  {mat:7.1f} s"
        + ("" if mat_rows == V_O200K else f" (extrapolated from {mat_rows} rows)")
    )
    if "lev_torch" in r:
        print(
            f"CPU kernel speed-up   {r['lev_torch']['seconds'] / lev:7.2f}x over the PyTorch path "
            f"({r['lev_torch']['seconds']:.3f} s, LEV/block {r['lev_torch']['seconds'] / block:.3f})"
        )
    if args.ref:
        print(
            f"vs --ref {args.ref}: LEV fwd+bwd {r['lev_ref']['seconds'] / lev:.2f}x faster, materialize "
            f"{r['materialize_ref']['full_seconds'] / mat:.2f}x faster"
        )
    _record(args, r, tokens, naive_tokens, mat_rows)
    return 0


def _record(args, r, tokens, naive_tokens, mat_rows) -> None:
    import torch

    from megatron_lev.config import LevConfig
    from megatron_lev.model.embeddings.lev import default_phi_mode
    from megatron_lev.utils.io import atomic_write_text

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} at the end"
    )
    lev, block = r["lev"], r["block"]
    rows = [
        f"\n## {when} — {machine}{' (--quick)' if args.quick else ''}\n",
        f"{tokens} tokens ({'minipile text' if args.text else 'Zipf(1.0) ids'}, {lev['unique']} unique), "
        f"V={V_PILE}, D={D}, LEV defaults (k=3, d_seed=128, h=8, kappa=16, r=64, "
        f"recompute {'on' if LevConfig().recompute else 'off'}), "
        f"phi built by {default_phi_mode(torch.device(args.device))}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', os.cpu_count())}.\n",
        "| case | tokens | fwd+bwd s | peak MB above set-up | ratio |",
        "|---|---|---|---|---|",
        f"| LEV | {tokens} | {lev['seconds']:.3f} | {lev['peak_mb']:.0f} | "
        f"LEV/block {lev['seconds'] / block['seconds']:.3f} |",
        f"| LEV, recompute off | {tokens} | {r['lev_norecompute']['seconds']:.3f} | "
        f"{r['lev_norecompute']['peak_mb']:.0f} | "
        f"LEV/block {r['lev_norecompute']['seconds'] / block['seconds']:.3f} |",
    ]
    if "lev_torch" in r:
        torch_path = r["lev_torch"]
        rows.append(
            f"| LEV, PyTorch path (CPU kernel off) | {tokens} | {torch_path['seconds']:.3f} | "
            f"{torch_path['peak_mb']:.0f} | LEV/block {torch_path['seconds'] / block['seconds']:.3f}; kernel "
            f"{torch_path['seconds'] / lev['seconds']:.2f}x faster |"
        )
    rows += [
        f"| dense nn.Embedding | {tokens} | {r['dense']['seconds']:.3f} | {r['dense']['peak_mb']:.0f} | "
        f"LEV/dense {lev['seconds'] / r['dense']['seconds']:.1f} |",
        f"| one Llama block (D=1024) | {tokens} | {block['seconds']:.3f} | {block['peak_mb']:.0f} | |",
        f"| LEV | {naive_tokens} | {r['lev_small']['seconds']:.3f} | {r['lev_small']['peak_mb']:.0f} | |",
        f"| naive LEV (no unique, dense basis) | {naive_tokens} | {r['naive']['seconds']:.3f} | "
        f"{r['naive']['peak_mb']:.0f} | speed-up {r['naive']['seconds'] / r['lev_small']['seconds']:.1f}x |",
        f"| materialize V={V_O200K} (no grad) | {mat_rows} rows | {r['materialize']['full_seconds']:.1f} "
        f"{'' if mat_rows == V_O200K else '(extrapolated)'} | | |",
    ]
    if args.ref:
        ref_lev, ref_mat = r["lev_ref"], r["materialize_ref"]
        rows += [
            f"| LEV at `--ref {args.ref}` (same run) | {tokens} | {ref_lev['seconds']:.3f} | "
            f"{ref_lev['peak_mb']:.0f} | "
            f"now {ref_lev['seconds'] / lev['seconds']:.2f}x faster |",
            f"| materialize at `--ref {args.ref}` | {ref_mat['rows']} rows | "
            f"{ref_mat['full_seconds']:.1f} (extrapolated) | | "
            f"now {ref_mat['full_seconds'] / r['materialize']['full_seconds']:.2f}x faster |",
        ]
    rows.append("")
    out = Path(args.output)
    head = out.read_text() if out.exists() else "# LEV layer benchmark (`benchmarks/bench_lev.py`)\n"
    atomic_write_text(out, head + "\n".join(rows) + "\n")
    print(f"recorded in {out}")


if __name__ == "__main__":
    raise SystemExit(main())
