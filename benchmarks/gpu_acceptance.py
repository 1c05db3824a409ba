"""GPU acceptance in one command: correctness, throughput, MFU and host syncs, written to results/gpu.md.

    python benchmarks/gpu_acceptance.py                          # one GPU, at most --budget-s (480 s)
    python benchmarks/gpu_acceptance.py --peak-tflops 989        # override the peak used for MFU
    python benchmarks/gpu_acceptance.py --device cpu --tiny --out /tmp/gpu.md   # the same code paths, seconds

Correctness: LEV's Triton kernel and gather path against the fp64 spec formula (values and
gradients); flash-attn against `scaled_dot_product_attention` (forward and backward);
30 bf16 training steps against the same steps in fp32; the fused head + loss against the logits path
at the paper's vocabulary (200,064 rows, 8 x 2048 tokens: loss, peak memory, time); a 2-process
data-parallel run
(NCCL with 2 GPUs; gloo in the tiny CPU mode). Throughput: the 200M and 1.2B configs at
sequence 2048, bf16, ZeRO-1, activation checkpointing off and on, LEV and TIED, and at the first size
LEV with selective recompute and with compiled blocks: tokens/s, TFLOP/s, MFU against the stated
peak, peak memory, and the host syncs of one step
(`torch.cuda.set_sync_debug_mode("warn")` on CUDA; Python-side reads everywhere).
Each section records PASSED / FAILED (with the error) / SKIPPED (with the reason) and
the run goes on; the exit status is 1 when a correctness check failed. Cases that do
not fit in the remaining time budget are skipped with that reason.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from megatron_lev.resources import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu.md"
MODELS = CONFIG_DIR / "models"
MICRO = CONFIG_DIR / "micro.yaml"  # the smallest model: the --tiny mode's, and the layout tests'
VOCAB = 50277  # GPT-NeoX-20B tokenizer
# dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets, without sparsity)
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "V100": 125.0,
}
TARGET_MFU_1B, TARGET_LEV_RATIO = 0.45, 1.03
LEV_TOL = {"values": 1e-4, "grads": 1e-3}  # max |x - ref| / max |ref|, fp32 against fp64
BF16_LOSS_TOL = 0.1  # max |loss_bf16 - loss_fp32| over the 30 steps, nats
ATTN_TOL_FACTOR = 2.0  # flash-attn's error vs fp32 at most this times SDPA's own bf16 error (+ 1e-3)


def _early_args(argv):
    """Triton's interpreter must be chosen before triton is first imported (CPU tiny mode)."""
    if (
        "--device" in argv
        and argv[argv.index("--device") + 1 :][:1] == ["cpu"]
        and "triton" not in sys.modules
    ):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


_early_args(sys.argv)

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Report:
    """Sections of the markdown report; `run` records PASSED/FAILED/SKIPPED and never raises."""

    def __init__(self) -> None:
        self.sections: list[tuple[str, str, list[str]]] = []
        self.correctness_failed = False

    def run(self, title: str, fn, *args, correctness: bool = False) -> None:
        start = time.perf_counter()
        try:
            status, lines = fn(*args)
        except Exception as exc:  # noqa: BLE001 - recorded in the report, the run goes on
            status = "FAILED"
            lines = [
                f"error: `{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}`",
                "",
                "```",
                *traceback.format_exc().rstrip().splitlines()[-12:],
                "```",
            ]
        if status == "FAILED" and correctness:
            self.correctness_failed = True
        lines = [*lines, "", f"({time.perf_counter() - start:.1f} s)"]
        self.sections.append((title, status, lines))
        print(f"[{status}] {title} ({time.perf_counter() - start:.1f} s)", flush=True)

    def markdown(self, header: list[str]) -> str:
        out = [*header, ""]
        for title, status, lines in self.sections:
            out += [f"## {title}: {status}", "", *lines, ""]
        return "\n".join(out)


# ---------------------------------------------------------------- set-up


def _ctx(args) -> dict:
    from megatron_lev.engine.deepspeed_engine import disable_cpu_shm_comm
    from megatron_lev.parallel import state
    from megatron_lev.training.rendezvous import init_distributed

    dev = torch.device(args.device)
    if dev.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    disable_cpu_shm_comm()
    init_distributed("gloo" if dev.type == "cpu" else "nccl")
    state.initialize_model_parallel(1, 1)  # one process: the trainer's layout is the sizes-only one
    name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name.upper()), None)
    return {
        "device": torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" else dev,
        "name": name,
        "peak": peak,
        "tiny": args.tiny,
        "args": args,
    }


def _zipf_batches(vocab: int, micro: int, seq: int, device, seed: int = 0):
    """Token ids with a Zipf-like frequency (learnable), drawn on the host like the real loader."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    while True:
        tokens = torch.multinomial(weights, micro * (seq + 1), replacement=True, generator=gen)
        tokens = tokens.view(micro, seq + 1).to(device, non_blocking=True)
        yield tokens[:, :-1], tokens[:, 1:]


def _config(model_file: Path, overrides: list[str]):
    from megatron_lev.config import load_config

    base = [
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.log_interval=1000000",
        "parallel.zero_stage=1",
    ]
    return load_config([model_file], base + overrides)


def _trainer(cfg, vocab: int, device, micro: int, steps: int, world: int = 1, layout=None):
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_plan
    from megatron_lev.training.schedule import Budget as StepBudget
    from megatron_lev.training.trainer import TrainData, Trainer

    layout = layout or SINGLE
    plan = model_plan(cfg, world, vocab, cuda=device.type == "cuda")
    engine = build_engine(plan, build_model(plan.model_spec, layout), layout)
    return Trainer(
        cfg,
        engine,
        StepBudget(steps, micro * world * cfg.model.seq_length, "acceptance"),
        TrainData(None, None, micro * world),
        world_size=world,
        device=device,
    )


def _free(*objs) -> None:
    for o in objs:
        del o
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- correctness


def _spec(u, delta):
    """LEV.md steps 4-6 in fp64: dense basis, phi = B (1 + delta), M = sign * exp(sum log(|phi| + 1e-9))."""
    from megatron_lev.model.embeddings.spline import spline_basis

    basis = spline_basis(u.double(), delta.shape[2])  # (N, h, d, kappa)
    phi = torch.einsum("nhjm,hjmr->nhjr", basis, 1 + delta.double())
    sign = 1.0 - 2.0 * ((phi < 0).sum(2) % 2).double()
    return sign * torch.exp(torch.log(phi.abs() + 1e-9).sum(2))


def _value_and_grads(fn, u, delta, probe):
    a, b = u.clone().requires_grad_(), delta.clone().requires_grad_()
    out = fn(a, b)
    (out * probe.to(out.dtype)).sum().backward()
    return out.detach().double().cpu(), a.grad.double().cpu(), b.grad.double().cpu()


def _rel(x, ref) -> float:
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check_lev(ctx):
    from megatron_lev.model.embeddings import triton_kernel
    from megatron_lev.model.embeddings.lev import spline_product

    dev = ctx["device"]
    n, h, d, kappa, r = (21, 1, 20, 6, 3) if ctx["tiny"] else (2048, 8, 128, 16, 64)
    modes = ["gather"]
    notes = []
    if not triton_kernel.available():
        notes.append("triton kernel unavailable (triton not importable or switched off)")
    elif dev.type == "cpu" and not triton_kernel.interpreted():
        notes.append("triton kernel skipped on CPU: triton was imported without TRITON_INTERPRET=1")
    else:
        modes.append("triton")
    lines = [
        f"N={n} ids, h={h}, d_seed={d}, kappa={kappa}, r={r}; fp32 on {dev.type} against the fp64 spec "
        f"formula; error = max|x - ref| / max|ref|, tolerance {LEV_TOL['values']:g} (values), "
        f"{LEV_TOL['grads']:g} (gradients)",
        "",
        "| mode | delta std | values | grad u | grad delta |",
        "|---|---|---|---|---|",
    ]
    ok = True
    for spread in (0.1, 1.5):  # the init scale, and factors of both signs
        gen = torch.Generator().manual_seed(7)
        u = torch.rand(n, h, d, generator=gen, dtype=torch.float64)
        delta = spread * torch.randn(h, d, kappa, r, generator=gen, dtype=torch.float64)
        probe = torch.randn(n, h, r, generator=gen, dtype=torch.float64)
        ref = _value_and_grads(_spec, u, delta, probe)
        for mode in modes:
            got = _value_and_grads(
                lambda a, b, m=mode: spline_product(a, b, kappa, m),
                u.float().to(dev),
                delta.float().to(dev),
                probe.to(dev),
            )
            errs = [_rel(g, rf) for g, rf in zip(got, ref)]
            good = errs[0] <= LEV_TOL["values"] and max(errs[1:]) <= LEV_TOL["grads"]
            ok &= good
            lines.append(
                f"| {mode} | {spread} | {errs[0]:.2e} | {errs[1]:.2e} | {errs[2]:.2e} |"
                + ("" if good else " **over tolerance**")
            )
    lines += [f"- {x}" for x in notes]
    return ("PASSED" if ok else "FAILED"), lines


def check_attention(ctx):
    from megatron_lev.model import attention

    dev = ctx["device"]
    if dev.type != "cuda":
        return "SKIPPED", ["flash-attn runs on CUDA only"]
    if attention.flash_attn_func is None:
        return "SKIPPED", ["flash_attn is not importable: the model uses scaled_dot_product_attention"]
    import torch.nn.functional as F

    b, s, nh, hd = 2, 1024, 16, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, s, nh, hd, device=dev, generator=gen) for _ in range(3))
    grad = torch.randn(b, s, nh, hd, device=dev, generator=gen)

    def run(fn, dtype):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*xs)
        out.backward(grad.to(dtype))
        return [out.float()] + [x.grad.float() for x in xs]

    def sdpa(q_, k_, v_):
        return F.scaled_dot_product_attention(
            q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=True
        ).transpose(1, 2)

    ref = run(sdpa, torch.float32)
    flash = run(lambda *x: attention.flash_attn_func(*x, causal=True), torch.bfloat16)
    low = run(sdpa, torch.bfloat16)
    lines = [
        f"B={b}, S={s}, heads={nh}, head dim {hd}, causal, bf16; max abs error against fp32 SDPA; "
        f"flash-attn must stay within {ATTN_TOL_FACTOR}x SDPA's own bf16 error + 1e-3",
        "",
        "| tensor | flash-attn | SDPA bf16 |",
        "|---|---|---|",
    ]
    ok = True
    for name, f, lo, rf in zip(("output", "grad q", "grad k", "grad v"), flash, low, ref):
        ef, el = float((f - rf).abs().max()), float((lo - rf).abs().max())
        good = ef <= ATTN_TOL_FACTOR * el + 1e-3
        ok &= good
        lines.append(f"| {name} | {ef:.2e} | {el:.2e} |" + ("" if good else " **over tolerance**"))
    return ("PASSED" if ok else "FAILED"), lines


def _head_loss_case(fused: bool, rows: int, real: int, tokens: int, hidden: int, dev, dtype):
    """One forward + backward of the head and its loss: (loss, peak extra bytes or None, seconds)."""
    from megatron_lev.model.loss import masked_mean, token_losses
    from megatron_lev.parallel.fused_cross_entropy import fused_linear_cross_entropy
    from megatron_lev.parallel.layout import SINGLE

    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(tokens, hidden, device=dev, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(rows, hidden, device=dev, generator=gen) * 0.02).to(dtype).requires_grad_()
    target = torch.randint(0, real, (tokens,), device=dev, generator=gen)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    if fused:
        loss, _ = fused_linear_cross_entropy(h, w, target, real, layout=SINGLE)
    else:
        loss = masked_mean(token_losses(h @ w.t(), target, real, layout=SINGLE))
    loss.backward()
    _sync(dev)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    value = float(loss)
    _free(h, w, target, loss)
    return value, peak, seconds


def check_fused_loss(ctx):
    """The output head + cross-entropy at the paper's vocabulary: the fused chunked path against the
    logits path, bf16, 8 x 2048 tokens, hidden 640 (the 200m shape): the same loss, peak memory and time."""
    dev = ctx["device"]
    if ctx["tiny"]:
        rows, real, tokens, hidden = 520, 500, 256, 64
    else:
        rows, real, tokens, hidden = 200_064, 199_999, 8 * 2048, 640
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lines = [
        f"V = {rows:,} rows ({real:,} real), {tokens:,} tokens, hidden {hidden}, {str(dtype)[6:]}; "
        "one forward + backward after one warm-up each; peak = peak allocated above the inputs",
        "",
        "| path | loss | peak extra | time |",
        "|---|---|---|---|",
    ]
    results = {}
    for fused in (False, True, False, True):  # warm-up pass, then the measured one
        try:
            results[fused] = _head_loss_case(fused, rows, real, tokens, hidden, dev, dtype)
        except torch.cuda.OutOfMemoryError:  # the logits path may not fit: that is the finding
            results[fused] = None
            gc.collect()
            torch.cuda.empty_cache()
    for fused, name in ((False, "logits path"), (True, "fused, chunked")):
        if results[fused] is None:
            lines.append(f"| {name} | out of memory | | |")
            continue
        loss, peak, seconds = results[fused]
        shown = f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a (CPU)"
        lines.append(f"| {name} | {loss:.5f} | {shown} | {seconds * 1e3:.1f} ms |")
    if results[True] is None:
        return "FAILED", [*lines, "**the fused path ran out of memory**"]
    if results[False] is None:
        return "PASSED", [*lines, "", "the logits path does not fit this device at this shape"]
    (old, old_peak, old_s), (new, new_peak, new_s) = results[False], results[True]
    ratio = f"memory {old_peak / new_peak:.1f}x lower, " if old_peak and new_peak else ""
    lines += ["", f"fused vs logits path: {ratio}time x{new_s / old_s:.2f}"]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    ok = abs(new - old) <= tol * abs(old)
    if not ok:
        lines.append(f"**loss differs by {abs(new - old):.2e} (tolerance {tol} relative)**")
    return ("PASSED" if ok else "FAILED"), lines


def _losses(cfg, vocab, device, micro, steps, seed=0) -> list[float]:
    torch.manual_seed(1234)
    tr = _trainer(cfg, vocab, device, micro, steps)
    batches = _zipf_batches(vocab, micro, cfg.model.seq_length, device, seed)
    pending = []
    for _ in range(steps):
        pending.append(tr.device_step(batches))
        tr.state.iteration += 1
    from megatron_lev.training.trainer import _read

    losses = [loss for loss, *_ in _read(pending)]
    _free(tr)
    return losses


def _check_model(tiny: bool) -> tuple[Path, list[str]]:
    """The model file and size overrides of the bf16 and data-parallel checks: the packaged micro.yaml
    in the tiny mode (the smallest model, shared with the tests), else tiny.yaml made 4 x 512."""
    if tiny:
        return MICRO, []
    return MODELS / "tiny.yaml", [
        "model.num_layers=4",
        "model.hidden_size=512",
        "model.num_attention_heads=8",
        "model.seq_length=512",
    ]


def _shape(cfg) -> str:
    m = cfg.model
    return (
        f"num_layers={m.num_layers}, hidden_size={m.hidden_size}, "
        f"num_attention_heads={m.num_attention_heads}, seq_length={m.seq_length}"
    )


def check_bf16(ctx):
    dev, steps = ctx["device"], 30
    model_file, size = _check_model(ctx["tiny"])
    micro, vocab = (2, 512) if ctx["tiny"] else (4, VOCAB)
    common = [
        *size,
        "model.embedding=lev",
        "train.lr=1e-3",
        "train.min_lr=1e-4",
        "train.lr_warmup_iters=5",
        f"train.train_iters={steps}",
    ]
    fp32_cfg = _config(model_file, [*common, "train.precision=fp32"])
    fp32 = _losses(fp32_cfg, vocab, dev, micro, steps)
    bf16 = _losses(_config(model_file, [*common, "train.precision=bf16"]), vocab, dev, micro, steps)
    diffs = [abs(a - b) for a, b in zip(bf16, fp32)]
    ok = len(diffs) == steps and max(diffs) <= BF16_LOSS_TOL and all(map(lambda x: x == x, bf16))
    lines = [
        f"LEV model ({_shape(fp32_cfg)}), micro-batch {micro}, {steps} steps "
        f"from the same weights and batches; tolerance: max |loss_bf16 - loss_fp32| <= {BF16_LOSS_TOL}",
        "",
        f"- fp32 loss: first {fp32[0]:.4f}, last {fp32[-1]:.4f}",
        f"- bf16 loss: first {bf16[0]:.4f}, last {bf16[-1]:.4f}",
        f"- max |difference| {max(diffs):.4f} (step {diffs.index(max(diffs)) + 1}), "
        f"mean {sum(diffs) / steps:.4f}",
    ]
    return ("PASSED" if ok else "FAILED"), lines


def _dp_worker(rank: int, world: int, backend: str, port: int, tiny: bool, out: str) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    if backend == "gloo":
        os.environ.update({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    from megatron_lev.engine.deepspeed_engine import disable_cpu_shm_comm
    from megatron_lev.parallel import state
    from megatron_lev.training.rendezvous import distributed_session, init_distributed

    disable_cpu_shm_comm()
    with distributed_session():  # leaves the group cleanly (no joinable C++ thread left at exit)
        init_distributed(backend)
        layout = state.initialize_model_parallel(1, 1)
        _dp_steps(rank, world, tiny, out, layout)


def _dp_steps(rank: int, world: int, tiny: bool, out: str, layout) -> None:
    from megatron_lev.training.rendezvous import device as current_device
    from megatron_lev.training.trainer import _read

    dev = current_device()
    model_file, size = _check_model(tiny)
    steps, micro, vocab = 5, 2, (512 if tiny else VOCAB)
    cfg = _config(
        model_file,
        [
            *size,
            "model.embedding=lev",
            f"train.train_iters={steps}",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={2 * micro}",
            "train.precision=bf16",
        ],
    )
    torch.manual_seed(1234)
    tr = _trainer(cfg, vocab, dev, micro, steps, world=world, layout=layout)
    batches = _zipf_batches(vocab, micro, cfg.model.seq_length, dev, seed=rank)
    pending = []
    for _ in range(steps):
        pending.append(tr.device_step(batches))
        tr.state.iteration += 1
    weights = torch.cat([p.detach().float().reshape(-1)[:64] for p in tr.engine.module.parameters()])
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {"losses": [loss for loss, *_ in _read(pending)], "checksum": float(weights.double().sum())}
        )
    )


def check_data_parallel(ctx):
    import torch.multiprocessing as mp

    from megatron_lev.testing.distributed import find_free_port

    dev = ctx["device"]
    if dev.type == "cuda" and torch.cuda.device_count() < 2:
        return "SKIPPED", [f"one GPU visible ({ctx['name']}): the 2-process NCCL run needs 2"]
    backend = "nccl" if dev.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _dp_worker,
            args=(2, backend, find_free_port(), ctx["tiny"], out),
            nprocs=2,
            start_method="spawn",
            join=True,
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    same_loss = ranks[0]["losses"] == ranks[1]["losses"]
    same_weights = ranks[0]["checksum"] == ranks[1]["checksum"]
    finite = all(x == x and abs(x) != float("inf") for x in ranks[0]["losses"])
    lines = [
        f"2 processes, {backend}, data parallel, ZeRO-1, bf16, 5 steps, each rank its own batches",
        "",
        f"- losses (the mean over ranks) on rank 0: {', '.join(f'{x:.4f}' for x in ranks[0]['losses'])}",
        f"- the same on both ranks: {same_loss}; weight checksums equal after the updates: {same_weights}",
    ]
    return ("PASSED" if same_loss and same_weights and finite else "FAILED"), lines


# ---------------------------------------------------------------- throughput


def _count_syncs(tr, batches, device) -> tuple[int | None, int, str]:
    """One step: CUDA syncs (sync debug mode) and Python-side tensor reads, by site."""
    from megatron_lev.testing.syncs import HostReads

    cuda_syncs = None
    with warnings.catch_warnings(record=True) as caught, HostReads() as reads:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            tr.device_step(batches)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    if device.type == "cuda":
        cuda_syncs = sum("synchroniz" in str(w.message) for w in caught)
    return cuda_syncs, reads.total, reads.summary()


# how a throughput case trains: recomputation (none, the attention core, whole blocks) or compiled blocks
MODES = {
    "none": [],
    "selective": ["model.recompute_attention=true"],
    "full": ["model.activation_checkpointing=true"],
    "compiled": ["model.compile=true"],
}


def measure(ctx, size: str, embedding: str, mode: str) -> dict:
    from megatron_lev.model.flops import flops_per_token
    from megatron_lev.model.vocab import padded_vocab_size

    dev, args = ctx["device"], ctx["args"]
    if ctx["tiny"]:
        model_file, micro, vocab = MODELS / "tiny.yaml", 2, 512
        over = [
            "model.num_layers=2",
            "model.hidden_size=64",
            "model.num_attention_heads=2",
            "model.seq_length=64",
            "model.lev.d_seed=8",
            "model.lev.heads=2",
            "model.lev.rank=4",
            "model.lev.kappa=4",
        ]
        warm, steps = 1, 2
    else:
        model_file, micro, vocab = MODELS / f"{size}.yaml", args.micro_batch[size], VOCAB
        over, warm, steps = ["model.seq_length=2048"], args.warmup, args.steps
    cfg = _config(
        model_file,
        [
            *over,
            f"model.embedding={embedding}",
            "train.precision=bf16",
            *MODES[mode],
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro}",
            f"train.train_iters={warm + steps + 1}",
        ],
    )
    _free()  # the previous case's engine
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(1234)
    tr = _trainer(cfg, vocab, dev, micro, warm + steps + 1)
    draw = _zipf_batches(vocab, micro, cfg.model.seq_length, dev)
    batches = iter([next(draw) for _ in range(warm + steps + 1)])  # drawn before the clock starts
    try:
        for _ in range(warm):
            tr.device_step(batches)
        _sync(dev)
        start = time.perf_counter()
        for _ in range(steps):
            tr.device_step(batches)
        _sync(dev)
        seconds = (time.perf_counter() - start) / steps
        cuda_syncs, reads, sites = _count_syncs(tr, batches, dev)
        peak_mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    finally:
        _free(tr)
    tokens = micro * cfg.model.seq_length
    tflops = tokens / seconds * flops_per_token(cfg.model, padded_vocab_size(vocab, cfg.model, 1)) / 1e12
    return {
        "size": size,
        "embedding": embedding,
        "ckpt": mode,
        "micro": micro,
        "seq": cfg.model.seq_length,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops": tflops,
        "mfu": tflops / ctx["peak"] if ctx["peak"] else None,
        "peak_gib": peak_mem,
        "cuda_syncs": cuda_syncs,
        "reads": reads,
        "sites": sites,
    }


def throughput(ctx, budget: Budget, rows: list, skipped: list):
    sizes = ["tiny"] if ctx["tiny"] else ctx["args"].sizes
    estimate = {"tiny": 5.0, "200m": 40.0, "1.2b": 90.0, "400m": 60.0}
    # none and whole-block recompute for both variants at every size; then, at the first size, LEV
    # with selective recompute and with compiled blocks (the compile counts in its warm-up steps)
    cases = [(mode, size, emb) for mode in ("none", "full") for size in sizes for emb in ("tied", "lev")]
    cases += [(mode, sizes[0], "lev") for mode in ("selective", "compiled")]
    for ckpt, size, emb in cases:
        need = estimate.get(size, 90.0) * (2 if ckpt == "compiled" else 1)
        if budget.left() < need:
            skipped.append(
                f"{size} {emb} {ckpt}: time budget "
                f"({budget.left():.0f} s left, the case needs about {need:.0f} s)"
            )
            continue
        start = time.perf_counter()
        try:
            rows.append(measure(ctx, size, emb, ckpt))
        except Exception as exc:  # noqa: BLE001 - one case (often out of memory) must not stop the rest
            rows.append(
                {
                    "size": size,
                    "embedding": emb,
                    "ckpt": ckpt,
                    "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                }
            )
            _free()
        if ckpt != "compiled":  # a compile's first steps say nothing of the next case's time
            estimate[size] = max(estimate.get(size, 0.0) * 0.5, time.perf_counter() - start)
        print(f"  {size} {emb} ckpt={ckpt}: {time.perf_counter() - start:.1f} s", flush=True)
    failed = [r for r in rows if "error" in r]
    ok_rows = [r for r in rows if "error" not in r]
    peak = ctx["peak"]
    lines = [
        f"bf16, ZeRO-1, one process, micro-batch = global batch, "
        f"sequence {ok_rows[0]['seq'] if ok_rows else '-'}; "
        f"model FLOPs per token from `megatron_lev.model.flops` (recomputation not counted); MFU against "
        + (f"**{peak:g} TFLOP/s** dense bf16 per device" if peak else "no known peak (pass --peak-tflops)"),
        "",
        "| size | embedding | recompute / compile | micro | ms/step | tokens/s | TFLOP/s | MFU | peak GiB | "
        "CUDA syncs/step | Python reads/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['embedding']} | {r['ckpt']} | FAILED: `{r['error']}` |||||||")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        mem = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        syncs = r["cuda_syncs"] if r["cuda_syncs"] is not None else "- (CPU)"
        lines.append(
            f"| {r['size']} | {r['embedding']} | {r['ckpt']} | {r['micro']} | "
            f"{1e3 * r['step_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | {mem} | "
            f"{syncs} | {r['reads']} |"
        )
    lines += ["", "LEV/TIED step time (target <= 1.03):", ""]
    for size in sizes:
        for ckpt in ("none", "full"):
            pair = {r["embedding"]: r for r in ok_rows if r["size"] == size and r["ckpt"] == ckpt}
            if {"lev", "tied"} <= pair.keys():
                ratio = pair["lev"]["step_s"] / pair["tied"]["step_s"]
                verdict = "met" if ratio <= TARGET_LEV_RATIO else "not met"
                lines.append(f"- {size}, recompute {ckpt}: **{ratio:.3f}** ({verdict})")
    lev = {r["ckpt"]: r for r in ok_rows if r["size"] == sizes[0] and r["embedding"] == "lev"}
    if "none" in lev:
        for mode in ("selective", "full", "compiled"):
            if mode in lev:
                r, base = lev[mode], lev["none"]
                mem = (
                    f", peak memory {r['peak_gib']:.1f} vs {base['peak_gib']:.1f} GiB"
                    if r["peak_gib"] is not None and base["peak_gib"] is not None
                    else ""
                )
                times = r["step_s"] / base["step_s"]
                lines.append(f"- {sizes[0]} LEV, {mode} against none: step time x{times:.3f}{mem}")
    best = [r for r in ok_rows if r["size"] == "1.2b" and r["mfu"] is not None]
    if best:
        top = max(best, key=lambda r: r["mfu"])
        lines.append(
            f"- best MFU at 1.2B: **{100 * top['mfu']:.1f}%** ({top['embedding']}, {top['ckpt']}; "
            f"target >= {100 * TARGET_MFU_1B:.0f}%: "
            f"{'met' if top['mfu'] >= TARGET_MFU_1B else 'not met'})"
        )
    sites = next((r["sites"] for r in ok_rows if r["embedding"] == "lev"), None)
    if sites:
        lines += [
            "",
            f"Python-side reads in one LEV step, by site: {sites}. `torch.unique` (LEV's unique ids) "
            "syncs inside C++: it is in the CUDA count, not in the Python one.",
        ]
    lines += [f"- skipped: {s}" for s in skipped]
    return ("FAILED" if failed else "PASSED" if ok_rows else "SKIPPED"), lines


# ---------------------------------------------------------------- main


def _versions() -> str:
    out = [f"torch {torch.__version__}"]
    for mod in ("deepspeed", "triton", "flash_attn"):
        try:
            out.append(f"{mod} {__import__(mod).__version__}")
        except Exception:  # noqa: BLE001 - absent or broken: say so
            out.append(f"{mod} not importable")
    return ", ".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu")
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny models and few steps: the code paths in seconds"
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"report path (default {RESULTS.relative_to(ROOT)}; "
        "with --tiny a file in the temporary directory)",
    )
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for the whole run")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="per-device peak for MFU (default: by name)"
    )
    parser.add_argument("--sizes", nargs="+", default=["200m", "1.2b"])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per throughput case")
    parser.add_argument("--warmup", type=int, default=2)
    # the paper configs' per-GPU micro-batches (pretrain/configs/experiments/paper/)
    parser.add_argument("--micro-batch-200m", type=int, default=32)
    parser.add_argument("--micro-batch-1.2b", dest="micro_batch_12b", type=int, default=8)
    args = parser.parse_args(argv)
    args.micro_batch = {
        "200m": args.micro_batch_200m,
        "400m": args.micro_batch_200m,
        "1.2b": args.micro_batch_12b,
    }
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (use --device cpu --tiny)")
    from megatron_lev.training.rendezvous import distributed_session

    with distributed_session():  # the one-rank group of _ctx, left cleanly on every exit path
        return _run(args, argv)


def _run(args, argv) -> int:
    out = (
        Path(args.out)
        if args.out
        else (Path(tempfile.gettempdir()) / "gpu_acceptance_tiny.md" if args.tiny else RESULTS)
    )
    budget = Budget(args.budget_s)
    started = time.perf_counter()
    report = Report()
    ctx = _ctx(args)
    report.run("LEV kernels: Triton and gather vs the fp64 spec formula", check_lev, ctx, correctness=True)
    report.run("flash-attn vs scaled_dot_product_attention", check_attention, ctx, correctness=True)
    report.run("bf16 training tracks fp32 (30 steps)", check_bf16, ctx, correctness=True)
    report.run("Fused head + loss vs the logits path at V = 200,064", check_fused_loss, ctx, correctness=True)
    if budget.left() > (10 if args.tiny else 120):
        report.run("2-process data-parallel run", check_data_parallel, ctx, correctness=True)
    else:
        report.sections.append(
            ("2-process data-parallel run", "SKIPPED", [f"time budget: {budget.left():.0f} s left"])
        )
    rows, skipped = [], []
    report.run("Throughput, MFU, peak memory and syncs per step", throughput, ctx, budget, rows, skipped)
    command = "python benchmarks/gpu_acceptance.py " + " ".join(argv if argv is not None else sys.argv[1:])
    peak = f"{ctx['peak']:g} TFLOP/s" if ctx["peak"] else "unknown"
    header = [
        f"# GPU acceptance ({'tiny CPU mode' if args.tiny else ctx['name']})",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"device {ctx['name']}, {_versions()}; peak for MFU: {peak}",
        "",
        f"Command: `{command.strip()}`; total {time.perf_counter() - started:.0f} s "
        f"(budget {args.budget_s:.0f} s). Correctness: "
        f"{'FAILED' if report.correctness_failed else 'no failure'}.",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.markdown(header) + "\n")
    print(f"wrote {out}", flush=True)
    return 1 if report.correctness_failed else 0


if __name__ == "__main__":
    sys.exit(main())
