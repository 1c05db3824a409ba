"""What a checkpoint save costs the step loop: the save is synchronous, so every second of it is a
second the loop waits. Measured on one process (ZeRO-1, fp32, CPU) at the tiny and the regime shapes.

    python benchmarks/bench_save.py                 # 3 saves per shape, median
    python benchmarks/bench_save.py --saves 5 --no-record

For each shape: one training step's time (forward, backward, AdamW through the DeepSpeed engine,
for scale), and a save's time split into DeepSpeed's own write (`Engine.save`: the model and the
optimizer's partitions, through `torch.save`) and the rest of `ckpt.io.save_checkpoint` (the RNG
file, the config and provenance records, the SHA-256 of every file into the completion marker,
`latest`, pruning), with the checkpoint's size. The save directory is on this machine's disk (page
cache warm). Results are appended to results/save.md.
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

    engine.save = timed_save
    root = Path(tempfile.mkdtemp(prefix=f"bench-save-{shape}-"))
    totals, engines, sizes = [], [], []
    try:
        for i in range(1, saves + 1):
            t0 = time.perf_counter()
            path = ckio.save_checkpoint(engine, root, i, {"train_state": {"iteration": i}}, keep_last=1)
            totals.append(time.perf_counter() - t0)
            engines.append(timing["engine"])
            sizes.append(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    total, eng = statistics.median(totals), statistics.median(engines)
    return {"step_s": step_s, "total_s": total, "engine_s": eng, "rest_s": total - eng, "bytes": sizes[-1]}


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
        "| shape | checkpoint | one step | save (blocks the loop) | DeepSpeed's write "
        "| checksums, records, latest, prune | save / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape in args.shapes:
        r = measure(shape, args.saves)
        rows.append(
            f"| {shape} | {r['bytes'] / 2**20:,.0f} MiB | {r['step_s']:.2f} s | **{r['total_s']:.2f} s** | "
            f"{r['engine_s']:.2f} s | {r['rest_s']:.2f} s | {r['total_s'] / r['step_s']:.1f} |"
        )
        print(rows[-1], flush=True)
    if args.no_record:
        return
    from benchmarks.results_file import append_section

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    head = (
        f"\n## {stamp}\n\n`python benchmarks/bench_save.py --saves {args.saves}`; {platform.machine()}, "
        f"{os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f}; one process, ZeRO-1, fp32, "
        "LEV, median of the saves (the first included).\n\n"
    )
    append_section(RESULTS, "# Checkpoint save cost (bench_save.py)\n", head + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
