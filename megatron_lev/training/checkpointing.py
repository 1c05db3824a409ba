"""Checkpoint directories: save through DeepSpeed, mark completion, keep the last few, resume safely.

Layout under `train.save`:

    iter_0000100/            DeepSpeed's files + rng_state_rank{R}.pt + config.yaml
    iter_0000100/complete    written by rank 0 after every rank finished saving
    latest                   the newest complete tag (same format as DeepSpeed's `latest`)

A directory without `complete` (a save interrupted by a kill) is never loaded:
resume takes the newest complete checkpoint and says so.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_lev.config import atomic_write_json, atomic_write_text
from megatron_lev.logging import get_logger

COMPLETE_MARKER = "complete"
LATEST_FILE = "latest"
_TAG_RE = re.compile(r"^iter_(\d+)$")

log = get_logger(__name__)


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(tag: str) -> int | None:
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointInfo:
    iteration: int
    tag: str
    path: Path
    complete: bool


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointInfo]:
    """Every `iter_*` directory under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        it = iteration_of(child.name)
        if it is not None and child.is_dir():
            found.append(CheckpointInfo(it, child.name, child, (child / COMPLETE_MARKER).is_file()))
    return sorted(found, key=lambda c: c.iteration)


def find_resume_tag(root: str | os.PathLike) -> str | None:
    """The tag to resume from: `latest` if complete, else the newest complete one (with a warning)."""
    root = Path(root)
    ckpts = list_checkpoints(root)
    complete = [c for c in ckpts if c.complete]
    pointer = root / LATEST_FILE
    wanted = pointer.read_text().strip() if pointer.is_file() else None
    newest_partial = [c for c in ckpts if not c.complete and (not complete or c.iteration > complete[-1].iteration)]
    if newest_partial:
        log.warning("ignoring incomplete checkpoint(s) %s (no '%s' marker: the save was interrupted)",
                    ", ".join(c.tag for c in newest_partial), COMPLETE_MARKER)
    if wanted and any(c.tag == wanted for c in complete):
        return wanted
    if not complete:
        return None
    if wanted:
        log.warning("%s points to %r, which is missing or incomplete; resuming from %s instead",
                    pointer, wanted, complete[-1].tag)
    return complete[-1].tag


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, for this rank."""
    from megatron_lev.parallel.random import get_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": get_rng_tracker().get_states(),
    }


def restore_rng_state(states: dict[str, Any]) -> None:
    from megatron_lev.parallel.random import get_rng_tracker

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if states.get("tracker"):
        get_rng_tracker().set_states(states["tracker"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(engine, root: str | os.PathLike, iteration: int, client_state: dict[str, Any],
                    keep_last: int, config_yaml: str | None = None) -> Path:
    """Collective: save via DeepSpeed, then (after a barrier) mark complete, point `latest`, prune."""
    root = Path(root)
    tag = tag_for(iteration)
    start = time.perf_counter()
    if _rank() == 0:  # re-saving a tag: it is not complete until this save is
        (root / tag / COMPLETE_MARKER).unlink(missing_ok=True)
    _barrier()
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
    rng_path = root / tag / f"rng_state_rank{_rank()}.pt"
    tmp = rng_path.with_name(f".{rng_path.name}.tmp")
    torch.save(capture_rng_state(), tmp)
    os.replace(tmp, rng_path)
    _barrier()  # every rank's files are on disk
    if _rank() == 0:
        if config_yaml is not None:
            atomic_write_text(root / tag / "config.yaml", config_yaml)
        world = dist.get_world_size() if dist.is_initialized() else 1
        atomic_write_json(root / tag / COMPLETE_MARKER, {"iteration": iteration, "world_size": world,
                                                         "time": time.time()})
        atomic_write_text(root / LATEST_FILE, tag + "\n")
        prune_checkpoints(root, keep_last)
    _barrier()
    log.info("saved checkpoint %s in %.1fs", root / tag, time.perf_counter() - start)
    return root / tag


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints, and partial ones older than those."""
    ckpts = list_checkpoints(root)
    complete = [c for c in ckpts if c.complete]
    keep = {c.tag for c in complete[-keep_last:]}
    newest = complete[-1].iteration if complete else -1
    removed = []
    for c in ckpts:
        if c.tag in keep or (not c.complete and c.iteration > newest):
            continue
        shutil.rmtree(c.path, ignore_errors=True)
        removed.append(c.tag)
    return removed


def load_checkpoint(engine, root: str | os.PathLike, tag: str) -> dict[str, Any]:
    """Collective: load model/optimizer through DeepSpeed and this rank's RNG; returns the client state."""
    root = Path(root)
    path, client_state = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    rng_path = root / tag / f"rng_state_rank{_rank()}.pt"
    if rng_path.is_file():
        restore_rng_state(torch.load(rng_path, weights_only=False))
    else:
        log.warning("%s not found (different world size?): RNG streams are not restored", rng_path.name)
    marker = json.loads((root / tag / COMPLETE_MARKER).read_text())
    log.info("resumed from %s (iteration %d)", root / tag, marker["iteration"])
    return client_state or {}
