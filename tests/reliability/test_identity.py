"""Identity by content, not by names, paths or timestamps.

- The sample-index cache is keyed by the shard's content: re-preprocessing other documents with the
  same counts (documents, tokens) into the same prefix must not meet the old index (it gave samples
  of the wrong length, or a raw traceback in the sampler). The same content under another directory
  reuses its index.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_lev.data.gpt_dataset import GPTDataset, open_shards
from megatron_lev.data.indexed import IndexedDatasetBuilder
from megatron_lev.data.manifest import write_manifest

pytestmark = pytest.mark.timeout(300)

SEQ = 33
FINGERPRINT = {"type": "hf", "name": "t", "file": "t.json", "sha256": "0" * 64, "vocab_size": 1000, "eod": 0}


class _Data:
    tokenizer_path = None


def _shard(prefix: Path, lengths: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix, np.uint16)
    for n in lengths:
        b.add_document(rng.integers(1, 1000, n))
    b.finalize()
    write_manifest(prefix, [str(prefix)], FINGERPRINT, 999, known_sha256=b.sha256)


def _dataset(prefix: Path, cache: Path) -> GPTDataset:
    ((_, ds),) = open_shards(_Data(), [str(prefix)])
    return GPTDataset("train", ds, (0, ds.num_documents), 12, SEQ, 1234, cache)


def test_another_content_with_the_same_counts_never_meets_the_old_index(tmp_path):
    prefix, cache = tmp_path / "data" / "corpus", tmp_path / "cache"
    _shard(prefix, [10, 150, 40], seed=0)
    _dataset(prefix, cache)  # caches the index of the first content
    shutil.rmtree(prefix.parent)
    _shard(prefix, [140, 10, 50], seed=1)  # re-preprocessed: 3 documents, 200 tokens again
    ds = _dataset(prefix, cache)
    fresh = _dataset(prefix, tmp_path / "fresh-cache")
    for i in range(len(ds)):
        assert len(ds[i]["tokens"]) == SEQ + 1
        assert np.array_equal(ds[i]["tokens"], fresh[i]["tokens"])


def test_the_same_content_elsewhere_reuses_its_index(tmp_path):
    prefix, cache = tmp_path / "a" / "corpus", tmp_path / "cache"
    _shard(prefix, [10, 150, 40], seed=0)
    _dataset(prefix, cache)
    built = sorted(p.name for p in cache.iterdir())
    shutil.copytree(prefix.parent, tmp_path / "b")  # the same shards, copied to another directory
    _dataset(tmp_path / "b" / "corpus", cache)
    assert sorted(p.name for p in cache.iterdir()) == built  # nothing built again
