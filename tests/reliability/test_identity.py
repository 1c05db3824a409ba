"""Identity by content, not by names, paths or timestamps.

- The sample-index cache is keyed by the shard's content: re-preprocessing other documents with the
  same counts (documents, tokens) into the same prefix must not meet the old index (it gave samples
  of the wrong length, or a raw traceback in the sampler). The same content under another directory
  reuses its index.
- A shard rewritten at the same size with its mtime restored (what `rsync -a`, `tar x` or `cp -p` of a
  same-size file do) is refused, with the manifest's chunk digests and with an older manifest's
  whole-file sums (the checksum cache no longer trusts (path, size, mtime)); the same bytes copied
  elsewhere with `cp -p` pass.
- A cold check of a large shard never runs inside a collective bounded by the collective timeout:
  with a hash slowed past the timeout (a 600 GB shard at 0.9 GB/s is 11 minutes), two ranks start.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_lev.data import manifest as mf
from megatron_lev.data.gpt_dataset import GPTDataset, open_shards
from megatron_lev.data.indexed import IndexedDatasetBuilder
from megatron_lev.data.manifest import ShardSetError, verify_shard_set, write_manifest
from megatron_lev.testing.distributed import run_distributed

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


# ---------------------------------------------------------------- checksums


def _legacy(prefix: Path) -> None:
    """The manifest as versions before chunk digests wrote it."""
    path = mf.manifest_path(prefix)
    manifest = mf.read_manifest(path)
    for entry in manifest["files"].values():
        entry.pop("chunks", None)
        entry.pop("chunk_bytes", None)
    mf.atomic_write_json(path, manifest)


def _rewrite_keeping_size_and_mtime(path: Path) -> None:
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2 :] = bytes(b ^ 0x5A for b in raw[len(raw) // 2 :])  # other tokens, same size
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime put back, as rsync -a does
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("legacy", [False, True], ids=["chunk-digests", "older-manifest"])
def test_a_rewrite_with_size_and_mtime_restored_is_refused(tmp_path, monkeypatch, legacy):
    monkeypatch.setenv(mf.CACHE_ENV, str(tmp_path / "cache"))
    prefix = tmp_path / "data" / "corpus"
    _shard(prefix, [300, 500, 200], seed=0)
    if legacy:
        _legacy(prefix)
    verify_shard_set(prefix)  # checked (and, for the older manifest, its sums cached)
    _rewrite_keeping_size_and_mtime(Path(f"{prefix}.bin"))
    with pytest.raises(ShardSetError, match=r"corpus\.bin: .*differs"):
        verify_shard_set(prefix)


def test_the_same_bytes_copied_with_their_times_pass(tmp_path, monkeypatch):
    monkeypatch.setenv(mf.CACHE_ENV, str(tmp_path / "cache"))
    _shard(tmp_path / "a" / "corpus", [300, 500, 200], seed=0)
    verify_shard_set(tmp_path / "a" / "corpus")
    shutil.copytree(tmp_path / "a", tmp_path / "b", copy_function=shutil.copy2)  # cp -p
    verify_shard_set(tmp_path / "b" / "corpus")
    _legacy(tmp_path / "b" / "corpus")
    verify_shard_set(tmp_path / "b" / "corpus")


SLOW_HASH_S, TIMEOUT_S = 8.0, 3.0


def _start_with_a_slow_hash(root: str, legacy: bool) -> bool:
    """On two ranks: the collective timeout at TIMEOUT_S, rank 0's whole-file hashing slowed past it."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    c10d._set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S), dist.group.WORLD)
    prefix = Path(root) / ("legacy" if legacy else "chunked") / "corpus"
    real = mf.sha256_file

    def slow(path, *args, **kwargs):
        time.sleep(SLOW_HASH_S)
        return real(path, *args, **kwargs)

    mf.sha256_file = slow
    mf._memory.clear()  # a cold start: nothing hashed in this process either (forked ranks inherit it)
    try:
        verify_shard_set(prefix)
        dist.barrier()
    finally:
        mf.sha256_file = real
    return True


@pytest.mark.multiprocess
@pytest.mark.parametrize("legacy", [False, True], ids=["chunk-digests", "older-manifest"])
def test_a_cold_check_slower_than_the_collective_timeout_starts(tmp_path, legacy):
    sub = tmp_path / ("legacy" if legacy else "chunked")
    _shard(sub / "corpus", [300, 500, 200], seed=0)
    if legacy:
        _legacy(sub / "corpus")
    env = {mf.CACHE_ENV: str(tmp_path / "cold-cache")}  # nothing hashed before: a cold start
    assert run_distributed(
        _start_with_a_slow_hash, 2, args=(str(tmp_path), legacy), timeout=120, env=env
    ) == [
        True,
        True,
    ]


def test_the_full_check_adds_chunk_digests_to_an_older_manifest_and_names_damage(tmp_path, monkeypatch):
    monkeypatch.setenv(mf.CACHE_ENV, str(tmp_path / "cache"))
    prefix = tmp_path / "data" / "corpus"
    _shard(prefix, [300, 500, 200], seed=0)
    want = mf.read_manifest(mf.manifest_path(prefix))["files"]
    _legacy(prefix)
    r = mf.verify_every_byte(prefix)
    assert r["added_chunks"] and r["files"] == len(want)
    assert mf.read_manifest(mf.manifest_path(prefix))["files"] == want  # the chunks preprocess writes
    _rewrite_keeping_size_and_mtime(Path(f"{prefix}.idx"))
    with pytest.raises(ShardSetError, match=r"corpus\.idx: sha256 .* differs"):
        mf.verify_every_byte(prefix)


# ---------------------------------------------------------------- resume, convert: content, not paths

from tests.reliability.harness import expect_error, expect_ok, run_cli_process  # noqa: E402
from tests.reliability.test_checkpoint import (  # noqa: E402, F401 - the shared tiny run and its data
    ENV,
    data,
    overrides,
    run_copy,
    train,
    trained,
)


def _resaved(tokenizer: str, out: Path, edit=None) -> str:
    """The tokenizer loaded and saved again (other bytes, the same tokenizer), or edited by `edit`."""
    import json

    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    Tokenizer.from_file(tokenizer).save(str(path), pretty=False)
    if edit is not None:
        spec = json.loads(path.read_text())
        edit(spec)
        path.write_text(json.dumps(spec))
    assert path.read_bytes() != Path(tokenizer).read_bytes()
    return str(path)


def test_shards_copied_to_another_directory_resume_exactly(run_copy, data, tmp_path):  # noqa: F811
    moved = tmp_path / "moved"
    shutil.copytree(Path(data["prefix"]).parent, moved)  # byte-identical, as a cluster move leaves it
    elsewhere = {**data, "prefix": str(moved / Path(data["prefix"]).name)}
    res = train(overrides(elsewhere, run_copy, **{"train.train_iters": 6}))
    expect_ok(res)
    assert "resumed from" in res.err and "compared by content" in res.err, res.err[-3000:]


def test_a_tokenizer_saved_again_resumes_and_converts(run_copy, data, tmp_path):  # noqa: F811
    again = {**data, "tokenizer": _resaved(data["tokenizer"], tmp_path / "tok")}
    res = train(overrides(again, run_copy, **{"train.train_iters": 6}))
    expect_ok(res)
    assert "resumed from" in res.err, res.err[-3000:]
    out = run_cli_process(
        [
            "convert",
            str(run_copy / "ckpt"),
            str(tmp_path / "hf"),
            "--tokenizer",
            again["tokenizer"],
            "--no-progress",
        ],
        timeout=240,
        env=ENV,
    )
    expect_ok(out)


def _toggle_special(spec: dict) -> None:
    spec["added_tokens"][0]["special"] = not spec["added_tokens"][0]["special"]


def test_a_tokenizer_that_really_differs_is_refused_and_its_escape_works_end_to_end(
    run_copy,  # noqa: F811
    data,  # noqa: F811
    tmp_path,
):
    other = {**data, "tokenizer": _resaved(data["tokenizer"], tmp_path / "tok", _toggle_special)}
    over = overrides(other, run_copy, **{"train.train_iters": 6})
    expect_error(train(over), "tokenizer", r"--allow-change tokenizer")
    res = train([*over, "--allow-change", "tokenizer"])  # past the resume check and the shards' own
    expect_ok(res)
    assert "resumed from" in res.err, res.err[-3000:]


def _sharded_set(prefix: Path, count: int = 2, lengths=(120, 80), seed: int = 3) -> list[Path]:
    """A set written in `count` shards (`P_00000`, `P_00001`, ...) of documents of `lengths` under one
    manifest `P.manifest.json`, as `preprocess --shard-documents` writes it."""
    shards = [Path(f"{prefix}_{i:05d}") for i in range(count)]
    rng = np.random.default_rng(seed)
    for shard in shards:
        b = IndexedDatasetBuilder(shard, np.uint16)
        for n in lengths:
            b.add_document(rng.integers(1, 1000, n))
        b.finalize()
    write_manifest(prefix, [str(s) for s in shards], FINGERPRINT, 999)
    return shards


def test_the_full_check_takes_a_sharded_set_by_its_prefix_and_needs_no_tokenizer(tmp_path, monkeypatch):
    """`preprocess --verify P` of a healthy set written in shards: before, refused with advice to
    preprocess again (its manifest does not list `P` itself as a shard), and it asked for --tokenizer.
    Now every shard is checked, by the prefix or by one shard's name; damage is still named."""
    monkeypatch.setenv(mf.CACHE_ENV, str(tmp_path / "cache"))
    prefix = tmp_path / "data" / "pile"
    shards = _sharded_set(prefix)
    r = mf.verify_every_byte(prefix)
    assert r["files"] >= 4  # two .bin and two .idx, at least
    assert mf.verify_every_byte(shards[1])["files"] == r["files"]  # one shard names the same set
    res = run_cli_process(["preprocess", "--verify", str(prefix)], env=ENV)
    expect_ok(res)
    assert "match the manifest" in res.out
    _rewrite_keeping_size_and_mtime(Path(f"{shards[1]}.bin"))
    with pytest.raises(ShardSetError, match=r"pile_00001\.bin: sha256 .* differs"):
        mf.verify_every_byte(prefix)
    res = run_cli_process(
        ["preprocess", "--input", "x.jsonl", "--output-prefix", str(tmp_path / "o")], env=ENV
    )
    expect_error(res, r"--tokenizer is required to preprocess")


def test_a_start_samples_each_set_once_however_many_of_its_shards_are_listed(tmp_path, monkeypatch):
    """The start-up sample is `SAMPLE_BYTES` a set: listing each of a set's 12 shards in
    data.data_path used to read up to that much per shard (a Pile set of ~150 shards: ~150 GiB at
    every start). Its healthy twins: the same shards open, and one shard listed alone still gets the
    whole budget for its own chunks."""
    monkeypatch.setattr(mf, "CHUNK_BYTES", 256)  # many chunks per file, so the budget binds
    monkeypatch.setattr(mf, "SAMPLE_BYTES", 256 * 8)  # 8 chunks a set
    shards = _sharded_set(tmp_path / "data" / "pile", count=12, lengths=(700, 500), seed=5)
    read = []
    real = mf.chunk_digest
    monkeypatch.setattr(
        mf, "chunk_digest", lambda path, index, unit: read.append(path) or real(path, index, unit)
    )

    opened = open_shards(_Data(), [x for s in shards for x in ("1", str(s))])  # a blend of all 12
    assert len(opened) == 12
    assert 1 <= len(read) <= 8, f"{len(read)} chunks read for one set of 12 shards (budget 8)"
    assert len({Path(p).name.split(".")[0] for p in read}) > 1  # the sample spans the listed shards

    read.clear()
    open_shards(_Data(), [str(shards[3])])
    assert len(read) == 8 and {Path(p).name for p in read} <= {"pile_00003.bin", "pile_00003.idx"}
