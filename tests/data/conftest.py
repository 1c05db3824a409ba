"""Fixtures for the data tests: a few hundred real minipile documents and their shard."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import zstandard

SUBSETS = ("Wikipedia_en", "Fortunes", "Github")


def read_docs(path: Path, n: int) -> list[dict]:
    """The first n records of a Pile-format .jsonl.zst file."""
    out = []
    with open(path, "rb") as f:
        reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8")
        for line in reader:
            out.append(json.loads(line))
            if len(out) == n:
                break
    return out


@pytest.fixture(scope="session")
def neox_path(shared_data) -> str:
    return str(shared_data / "tokenizers" / "gpt-neox-20b.json")


@pytest.fixture(scope="session")
def pile_docs(shared_data) -> list[dict]:
    """300 documents: 150 Wikipedia, 135 Fortunes, 15 Github (~0.5 MB), in that order."""
    counts = {"Wikipedia_en": 150, "Fortunes": 135, "Github": 15}
    return [d for s in SUBSETS for d in read_docs(shared_data / "minipile" / f"{s}.jsonl.zst", counts[s])]


@pytest.fixture(scope="session")
def pile_jsonl(tmp_path_factory, pile_docs) -> Path:
    path = tmp_path_factory.mktemp("pile") / "sample.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in pile_docs))
    return path


@pytest.fixture(scope="session")
def pile_shard(tmp_path_factory, pile_jsonl, neox_path) -> str:
    """The 300 documents preprocessed with the GPT-NeoX tokenizer (1 worker): the shard prefix."""
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    prefix = tmp_path_factory.mktemp("shard") / "sample"
    preprocess(
        PreprocessOptions(
            [str(pile_jsonl)], str(prefix), "hf", neox_path, workers=1, progress=False, chunk_bytes=64 << 10
        )
    )
    return str(prefix)
