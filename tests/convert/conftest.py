"""Session fixtures: real DeepSpeed checkpoints (made once, by 4 gloo processes) and held-out text."""

from __future__ import annotations

import io
import json

import pytest
import zstandard

from megatron_lev.testing import run_distributed
from tests.convert.ds_checkpoints import make_checkpoints


def _sample_text(shared_data, n_docs: int = 40) -> str:
    docs = []
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            docs.append(json.loads(line)["text"])
            if len(docs) == n_docs:
                break
    return "\n\n".join(docs)


@pytest.fixture(scope="session")
def tokenizer_path(shared_data):
    return str(shared_data / "tokenizers" / "gpt-neox-20b.json")


@pytest.fixture(scope="session")
def sample_text(shared_data):
    return _sample_text(shared_data)


@pytest.fixture(scope="session")
def ds_checkpoints(tmp_path_factory, tokenizer_path, sample_text):
    """{variant: (save dir, info)} for tied/lev (TP2 x PP2, ZeRO-1) and albert (TP2 x DP2, ZeRO-3, bf16)."""
    root = tmp_path_factory.mktemp("ds_ckpt")
    info = run_distributed(
        make_checkpoints, world_size=4, args=(str(root), tokenizer_path, sample_text), timeout=900
    )[0]
    return {variant: (root / variant, meta) for variant, meta in info.items()}
