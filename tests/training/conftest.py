"""A small real corpus (minipile Wikipedia + Fortunes, GPT-NeoX tokenizer) and tiny run configs."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from tests.tiny_run import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "configs" / "tiny.yaml"
DOCS_PER_SUBSET = {"Wikipedia_en": 1500, "Fortunes": 1500}


def _first_docs(path: Path, n: int) -> list[str]:
    out = []
    with open(path, "rb") as f:
        reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8")
        for line in reader:
            out.append(line)
            if len(out) == n:
                break
    return out


@pytest.fixture(scope="session")
def tokenizer_path(shared_data) -> str:
    return str(shared_data / "tokenizers" / "gpt-neox-20b.json")


@pytest.fixture(scope="session")
def minipile_prefix(tmp_path_factory, shared_data, tokenizer_path) -> str:
    """3,000 documents preprocessed into one MMIDIDX shard; returns its prefix."""
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    work = tmp_path_factory.mktemp("minipile")
    jsonl = work / "sample.jsonl"
    lines = [
        line
        for name, n in DOCS_PER_SUBSET.items()
        for line in _first_docs(shared_data / "minipile" / f"{name}.jsonl.zst", n)
    ]
    jsonl.write_text("".join(lines))
    prefix = work / "minipile_text_document"
    preprocess(PreprocessOptions([str(jsonl)], str(prefix), "hf", tokenizer_path, workers=1, progress=False))
    return str(prefix)


def train_command(nproc: int, overrides: list[str]) -> list[str]:
    """`python -m megatron_lev train` (one process) or `torchrun --standalone` (several)."""
    args = ["train", "--config", str(TINY), *overrides]
    if nproc == 1:
        return [sys.executable, "-m", "megatron_lev", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "megatron_lev",
        *args,
    ]


def train_env(**extra) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": str(ROOT),
            **extra,
        }
    )
    return env


def run_train(nproc: int, overrides: list[str], timeout: float = 240, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(nproc, overrides),
        cwd=ROOT,
        env=train_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_losses(out: Path) -> dict[int, float]:
    """iteration -> logged train loss (a resumed run's later lines win)."""
    from megatron_lev.training.metrics import read_metrics

    return {r["iteration"]: r["loss"] for r in read_metrics(out / "metrics.jsonl", kind="train")}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def kill_overrides(prefix: str, tok: str, out: Path) -> list[str]:
    """The run the SIGKILL/SIGTERM test interrupts (and the single-rank suite runs uninterrupted)."""
    return tiny_overrides(prefix, tok, out, **{"train.train_iters": 16, "train.save_interval": 2})


@pytest.fixture(scope="session")
def single_rank_results(minipile_prefix, tokenizer_path, tmp_path_factory) -> dict:
    from megatron_lev.testing.distributed import run_distributed
    from tests.training.suites import single_rank_suite

    out = tmp_path_factory.mktemp("single")
    ref = kill_overrides(minipile_prefix, tokenizer_path, out / "reference")
    (res,) = run_distributed(
        single_rank_suite, world_size=1, args=(minipile_prefix, tokenizer_path, str(out), ref), timeout=240
    )
    res["out"] = out
    return res


@pytest.fixture(scope="session")
def two_rank_results(minipile_prefix, tokenizer_path, tmp_path_factory) -> list[dict]:
    from megatron_lev.testing.distributed import run_distributed
    from tests.training.suites import two_rank_suite

    out = tmp_path_factory.mktemp("two")
    return run_distributed(
        two_rank_suite, world_size=2, args=(minipile_prefix, tokenizer_path, str(out)), timeout=300
    )
