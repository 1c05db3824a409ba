"""GPT samples: an epoch walks the shuffled documents exactly; seeds, splits, blends, caches."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from megatron_lev.config import DataConfig
from megatron_lev.data import indices as ix
from megatron_lev.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from megatron_lev.data.indexed import IndexedDataset

S = 32


def _stream(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.indexed[int(d)] for d in ds.doc_idx]).astype(np.int64)


def test_one_epoch_walks_every_document_once(pile_shard, tmp_path):
    indexed = IndexedDataset(pile_shard)
    n = (indexed.num_tokens - 1) // S  # every sample one epoch holds
    ds = GPTDataset("train", indexed, (0, indexed.num_documents), n, S, seed=7, cache_dir=tmp_path)
    assert ds.epochs == 1 and sorted(ds.doc_idx.tolist()) == list(range(len(indexed)))
    samples = [ds.sample(j) for j in range(n)]
    assert all(s.shape == (S + 1,) and s.dtype == np.int64 for s in samples)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]  # consecutive samples share only their boundary token
    walked = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])
    stream = _stream(ds)
    assert walked.tolist() == stream[: n * S + 1].tolist()  # no gap, no repeat, in the shuffled order
    assert len(stream) - len(walked) < S + 1  # only the tail that cannot fill a sample is unused
    eod_inside = [s for s in samples if (s[1:-1] == 0).any()]
    assert eod_inside, "some samples must cross a document boundary (EOD id 0 inside)"
    assert sorted(int(i) for i in ds.shuffle_idx) == list(range(n))
    for i in (0, 5, n - 1):
        assert ds[i]["tokens"].tolist() == ds.sample(int(ds.shuffle_idx[i])).tolist()


def test_several_epochs_tile_documents(pile_shard, tmp_path):
    indexed = IndexedDataset(pile_shard)
    n = 3 * indexed.num_tokens // S
    ds = GPTDataset("train", indexed, (0, indexed.num_documents), n, S, seed=1, cache_dir=tmp_path)
    assert ds.epochs == ix.num_epochs(indexed.num_tokens, S, n) == 3
    assert np.bincount(ds.doc_idx).tolist() == [3] * len(indexed)
    assert ds.sample(n - 1).shape == (S + 1,)


def test_deterministic_for_a_seed_and_different_across_seeds(pile_shard, tmp_path):
    indexed = IndexedDataset(pile_shard)
    docs = (0, indexed.num_documents)
    a = GPTDataset("train", indexed, docs, 500, S, seed=3, cache_dir=tmp_path / "a")
    b = GPTDataset("train", indexed, docs, 500, S, seed=3, cache_dir=tmp_path / "b")
    c = GPTDataset("train", indexed, docs, 500, S, seed=4, cache_dir=tmp_path / "a")
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.doc_idx, c.doc_idx) and not np.array_equal(a.shuffle_idx, c.shuffle_idx)
    assert [a[i]["tokens"].tolist() for i in range(20)] != [c[i]["tokens"].tolist() for i in range(20)]


def test_cache_is_reused(pile_shard, tmp_path, monkeypatch):
    indexed = IndexedDataset(pile_shard)
    first = GPTDataset("train", indexed, (0, 100), 200, S, seed=5, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npy"))) == 3 and len(list(tmp_path.glob("*description.json"))) == 1

    def refuse(*a, **k):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(ix, "build_doc_idx", refuse)
    again = GPTDataset("train", indexed, (0, 100), 200, S, seed=5, cache_dir=tmp_path)
    assert np.array_equal(first.sample_idx, again.sample_idx)
    with pytest.raises(AssertionError, match="rebuilt"):  # a different definition is a different key
        GPTDataset("train", indexed, (0, 100), 201, S, seed=5, cache_dir=tmp_path)


def test_splits_by_document(pile_shard, tmp_path):
    cfg = DataConfig(data_path=[pile_shard], split="80,15,5", cache_dir=str(tmp_path))
    train, valid, test = build_train_valid_test_datasets(cfg, S, (300, 40, 10))
    assert (len(train), len(valid), len(test)) == (300, 40, 10)
    assert set(train.doc_idx.tolist()) == set(range(0, 240))
    assert set(valid.doc_idx.tolist()) == set(range(240, 285))
    assert set(test.doc_idx.tolist()) == set(range(285, 300))
    assert ix.split_documents(300, "969,30,1") == [(0, 291), (291, 300), (300, 300)]
    cfg = DataConfig(data_path=[pile_shard], split="1,0,0", cache_dir=str(tmp_path))
    train, valid, test = build_train_valid_test_datasets(cfg, S, (10, 10, 10))
    assert train is not None and valid is None and test is None


def test_blend_proportions_and_items(pile_shard, neox_path, tmp_path):
    from megatron_lev.data.manifest import write_manifest_for

    other = str(tmp_path / "copy")
    for ext in ("bin", "idx"):
        shutil.copyfile(f"{pile_shard}.{ext}", f"{other}.{ext}")
    write_manifest_for(other, "hf", neox_path)  # a copy without a manifest is refused until it has one
    cfg = DataConfig(data_path=["0.3", pile_shard, "0.7", other], split="90,10,0", cache_dir=str(tmp_path))
    train, valid, test = build_train_valid_test_datasets(cfg, S, (3000, 200, 0))
    assert test is None and len(train) == 3000 and len(valid) == 200
    for ds, n in ((train, 3000), (valid, 200)):
        share = np.bincount(ds.dataset_index, minlength=2) / n
        assert abs(share[0] - 0.3) < 0.01 and abs(share[1] - 0.7) < 0.01
    prefix_share = np.cumsum(train.dataset_index[:1000] == 0) / np.arange(1, 1001)
    assert np.abs(prefix_share[99:] - 0.3).max() < 0.01  # proportions hold along the way, not only at the end
    for i in (0, 1, 2, 999):
        d, j = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        assert train[i]["tokens"].tolist() == train.datasets[d][j]["tokens"].tolist()
    assert [len(c) for c in train.datasets] == np.bincount(train.dataset_index).tolist()


def test_megatron_blend_rule():
    which, within = ix.build_blending_indices([1, 3], 8)
    # for sample i pick argmax(w * max(i, 1) - drawn): the rule written out by hand
    drawn, expect = [0, 0], []
    for i in range(8):
        err = [w * max(i, 1) - c for w, c in zip([0.25, 0.75], drawn)]
        expect.append(int(np.argmax(err)))
        drawn[expect[-1]] += 1
    assert which.tolist() == expect and within.tolist()[:3] == [0, 0, 1]


def test_valid_data_path(pile_shard, tmp_path):
    cfg = DataConfig(data_path=[pile_shard], valid_data_path=[pile_shard], cache_dir=str(tmp_path))
    train, valid, test = build_train_valid_test_datasets(cfg, S, (100, 20, 5))
    assert len(train) == 100 and len(valid) == 20 and test is None
    assert set(valid.doc_idx.tolist()) == set(range(300))


def _build_in_group(prefix, cache):
    import torch.distributed as dist

    cfg = DataConfig(data_path=[prefix], split="90,10,0", cache_dir=cache)
    train, valid, _ = build_train_valid_test_datasets(cfg, S, (400, 40, 0))
    return dist.get_rank(), train.shuffle_idx.tolist(), [train[i]["tokens"].tolist() for i in range(5)]


@pytest.mark.multiprocess
def test_ranks_share_one_cache(pile_shard, tmp_path):
    from megatron_lev.testing.distributed import run_distributed

    results = run_distributed(_build_in_group, 2, args=(pile_shard, str(tmp_path)), timeout=120)
    assert results[0][1:] == results[1][1:]
    assert len(list(tmp_path.glob("*description.json"))) == 2  # train and valid, built once
    assert not list(tmp_path.glob(".*tmp*"))
