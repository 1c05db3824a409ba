"""What a checkpoint save costs the step loop, saving synchronously and with `train.async_save` (the
checksums, the `complete` marker, `latest` and pruning on a background thread). Measured on one
process (ZeRO-1, fp32, CPU) at the tiny and the regime shapes, the two ways side by side in one run.

    python benchmarks/bench_save.py                 # 3 saves per shape and way, median
    python benchmarks/bench_save.py --saves 5 --no-record

For each shape: one training step's time (forward, backward, AdamW through the DeepSpeed engine,
for scale); a synchronous save's time split into DeepSpeed's own write (`Engine.save`: the model and
the optimizer's partitions, through `torch.save`) and the rest of `ckpt.io.save_checkpoint` (the RNG
file, the config and provenance records, the SHA-256 of every file into the completion marker,
`latest`, pruning); and with `async_save`, what the loop still waits for per save (`begin_save`, plus
waiting for the previous save's completion at the next one) and the step that runs beside the
completion (on a CPU the checksums take a core from it; on a GPU node the step runs on the device).
Each save is followed by one step. The save directory is on this machine's disk (page cache warm).
Results are appended to results/save.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "save.md"
SHAPES = {
    "tiny": ROOT / "pretrain" / "configs" / "tiny.yaml",
    "regime": ROOT / "pretrain" / "configs" / "experiments" / "regime" / "regime.yaml",
}
NEOX = 50277


def measure(shape: str, saves: int) -> dict:
    import torch

    from megatron_lev.ckpt import io as ckio
    from megatron_lev.config import load_config
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import build_engine
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_plan

    cfg = load_config([str(SHAPES[shape])], ["train.eval_interval=0", "model.embedding=lev"])
    plan = model_plan(cfg, 1, NEOX)
    engine = build_engine(plan, build_model(plan.model_spec, SINGLE), SINGLE)
    gen = torch.Generator().manual_seed(0)
    seq, micro = cfg.model.seq_length, plan.micro_batch

    def batches():
        while True:
            t = torch.randint(0, NEOX, (micro, seq + 1), generator=gen)
            yield t[:, :-1], t[:, 1:]

    data = batches()
    engine.train_batch(data)  # warm-up
    start = time.perf_counter()
    engine.train_batch(data)
    step_s = time.perf_counter() - start

    inner = engine.save
    timing = {"engine": 0.0}

    def timed_save(root, tag, client_state):
        t0 = time.perf_counter()
        inner(root, tag, client_state)
        timing["engine"] = time.perf_counter() - t0

    def timed(fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        return out, time.perf_counter() - t0

    engine.save = timed_save
    root = Path(tempfile.mkdtemp(prefix=f"bench-save-{shape}-"))
    sync, engines, sizes, sync_steps = [], [], [], []
    blocked, async_steps = [], []
    try:
        for i in range(1, saves + 1):  # synchronous: the save, then a step
            path, seconds = timed(ckio.save_checkpoint, engine, root / "sync", i, _client(i), keep_last=1)
            sync.append(seconds)
            engines.append(timing["engine"])
            sizes.append(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()))
            sync_steps.append(timed(engine.train_batch, data)[1])
        pending = None  # async_save: the loop waits for less
        for i in range(1, saves + 1):
            waited = timed(pending.wait)[1] if pending is not None else 0.0
            pending, seconds = timed(
                ckio.begin_save, engine, root / "async", i, _client(i), keep_last=1, background=True
            )
            blocked.append(waited + seconds)
            async_steps.append(timed(engine.train_batch, data)[1])  # beside the completion
        blocked[-1] += timed(pending.wait)[1]  # what the end of training waits for
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = statistics.median
    return {
        "step_s": step_s,
        "total_s": median(sync),
        "engine_s": median(engines),
        "rest_s": median(sync) - median(engines),
        "bytes": sizes[-1],
        "async_s": median(blocked),
        "sync_step_s": median(sync_steps),
        "async_step_s": median(async_steps),
    }


def _client(iteration: int) -> dict:
    return {"train_state": {"iteration": iteration}}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    from megatron_lev.engine.deepspeed_engine import disable_cpu_shm_comm
    from megatron_lev.parallel import state
    from megatron_lev.training.rendezvous import init_distributed

    disable_cpu_shm_comm()
    init_distributed("gloo")
    state.initialize_model_parallel(1, 1)
    load = os.getloadavg()
    rows = [
        "| shape | checkpoint | one step | sync save (blocks the loop) | DeepSpeed's write "
        "| checksums, records, latest, prune | async_save: the loop waits | sync / async "
        "| step after a sync save | step beside the completion |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape in args.shapes:
        r = measure(shape, args.saves)
        rows.append(
            f"| {shape} | {r['bytes'] / 2**20:,.0f} MiB | {r['step_s']:.2f} s | **{r['total_s']:.2f} s** | "
            f"{r['engine_s']:.2f} s | {r['rest_s']:.2f} s | **{r['async_s']:.2f} s** | "
            f"{r['total_s'] / r['async_s']:.1f}x | {r['sync_step_s']:.2f} s | {r['async_step_s']:.2f} s |"
        )
        print(rows[-1], flush=True)
    if args.no_record:
        return
    from benchmarks.results_file import append_section

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    head = (
        f"\n## {stamp}\n\n`python benchmarks/bench_save.py --saves {args.saves}`; {platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f}; one process, ZeRO-1, fp32, "
        "LEV, median of the saves (the first included); each save followed by one step.\n\n"
    )
    append_section(RESULTS, "# Checkpoint save cost (bench_save.py)\n", head + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
