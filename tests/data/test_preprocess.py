"""Preprocessing: worker-count independence, subsets and shards, bad input, stats and counts."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import zstandard

from megatron_lev.data.indexed import IndexedDataset
from megatron_lev.data.preprocess import PreprocessOptions, preprocess
from megatron_lev.data.tokenizers import build_tokenizer


def _run(inputs, prefix, neox_path, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("chunk_bytes", 32 << 10)
    return preprocess(PreprocessOptions([str(i) for i in inputs], str(prefix), "hf", neox_path, **kw))


def test_two_workers_equal_one_worker(tmp_path, pile_jsonl, pile_shard, neox_path):
    stats = _run([pile_jsonl], tmp_path / "w2", neox_path, workers=2, chunk_bytes=64 << 10)
    for ext in ("bin", "idx", "counts.npy"):
        assert (tmp_path / f"w2.{ext}").read_bytes() == open(f"{pile_shard}.{ext}", "rb").read()
    assert stats["documents"] == 300 and stats["workers"] == 2
    assert not list(tmp_path.glob(".*parts*")), "partial shards must be cleaned up"


def test_stats_and_counts(pile_shard, pile_docs, neox_path):
    stats = json.loads(open(f"{pile_shard}.stats.json").read())
    counts = np.load(f"{pile_shard}.counts.npy")
    ds = IndexedDataset(pile_shard)
    tok = build_tokenizer("hf", neox_path)
    assert counts.dtype == np.int64 and len(counts) == tok.vocab_size
    assert (
        counts.tolist()
        == np.bincount(
            np.concatenate([ds[i] for i in range(len(ds))]).astype(np.int64), minlength=tok.vocab_size
        ).tolist()
    )
    assert stats["documents"] == len(pile_docs) and stats["tokens"] == ds.num_tokens == counts.sum()
    assert counts[tok.eod] == len(pile_docs)
    assert {k: v["documents"] for k, v in stats["subsets"].items()} == {
        "Wikipedia (en)": 150,
        "Fortunes": 135,
        "Github": 15,
    }
    assert stats["errors"] == {} and stats["dtype"] == "uint16"


def test_split_by_subset_and_shards(tmp_path, pile_jsonl, pile_shard, neox_path):
    stats = _run([pile_jsonl], tmp_path / "s", neox_path, workers=1, split_by_subset=True, shard_size_mb=0.05)
    whole = IndexedDataset(pile_shard)
    by_subset: dict[str, list] = {}
    for prefix in stats["outputs"]:
        ds = IndexedDataset(prefix)
        assert (
            ds.num_tokens * 2 <= 0.05e6 or len(ds) == 1
        )  # a shard exceeds the size only for one big document
        subset = prefix.split("/s_")[1].rsplit("_", 1)[0]
        by_subset.setdefault(subset, []).extend(ds[i].tolist() for i in range(len(ds)))
    assert sorted(by_subset) == ["Fortunes", "Github", "Wikipedia (en)"]
    assert len(stats["outputs"]) > 3
    # subsets were contiguous in the input, so concatenating them in input order gives the whole shard
    order = by_subset["Wikipedia (en)"] + by_subset["Fortunes"] + by_subset["Github"]
    assert order == [whole[i].tolist() for i in range(len(whole))]


def test_bad_input_is_counted_by_file_and_line(tmp_path, pile_docs, neox_path):
    good = [json.dumps(d).encode() for d in pile_docs[:5]]
    lines = [
        good[0],
        b"{not json",
        json.dumps({"content": "x"}).encode(),
        good[1],
        b'{"text": "caf\xff"}',
        json.dumps({"text": "   "}).encode(),
        json.dumps({"text": ""}).encode(),
        b'{"text": "lone \\ud800 surrogate"}',
        b"[1, 2]",
        good[2],
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    stats = _run([path], tmp_path / "out", neox_path, workers=1)
    assert stats["documents"] == 3
    assert stats["errors"] == {"malformed_json": 1, "missing_key": 2, "invalid_utf8": 2, "empty_document": 2}
    where = {(p["line"], p["kind"]) for p in stats["problems"]}
    assert where == {
        (2, "malformed_json"),
        (3, "missing_key"),
        (5, "invalid_utf8"),
        (6, "empty_document"),
        (7, "empty_document"),
        (8, "invalid_utf8"),
        (9, "missing_key"),
    }
    assert all(p["file"] == str(path) for p in stats["problems"])
    assert len(IndexedDataset(tmp_path / "out")) == 3


def test_truncated_zst_and_gz_are_reported_not_fatal(tmp_path, pile_docs, neox_path):
    raw = b"".join(json.dumps(d).encode() + b"\n" for d in pile_docs)  # ~0.5 MB: several zstd blocks
    (tmp_path / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw)[:-3000])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(raw)[:-3000])
    (tmp_path / "ok.jsonl.gz").write_bytes(
        gzip.compress(b"".join(json.dumps(d).encode() + b"\n" for d in pile_docs[:10]))
    )
    stats = _run([tmp_path / "*.jsonl.*"], tmp_path / "out", neox_path, workers=1)
    truncated = sorted(
        p["file"].rsplit("/", 1)[1] for p in stats["problems"] if p["kind"] == "truncated_file"
    )
    assert truncated == ["cut.jsonl.gz", "cut.jsonl.zst"]
    # everything before the cut is kept; the partial last line is dropped with the file's problem
    assert stats["documents"] > 10 + 300 and "malformed_json" not in stats["errors"]
    assert all(
        "partial last line" in p["message"] for p in stats["problems"] if p["kind"] == "truncated_file"
    )
    ds = IndexedDataset(tmp_path / "out")  # the output is complete and consistent
    assert len(ds) == stats["documents"] and ds.num_tokens == stats["tokens"]


def test_hf_datasets_input(tmp_path, pile_docs, pile_shard, neox_path):
    import datasets

    d = datasets.Dataset.from_list([{"text": x["text"], "meta": x["meta"]} for x in pile_docs])
    d.save_to_disk(str(tmp_path / "hf"))
    stats = _run([tmp_path / "hf"], tmp_path / "a", neox_path, workers=1)
    assert stats["subsets"]["Github"]["documents"] == 15
    assert (tmp_path / "a.bin").read_bytes() == open(f"{pile_shard}.bin", "rb").read()


def test_missing_input_is_a_clear_error(tmp_path, neox_path):
    from megatron_lev.data.readers import InputError

    with pytest.raises(InputError, match="no such file"):
        _run([tmp_path / "nope.jsonl"], tmp_path / "o", neox_path)
    with pytest.raises(InputError, match="no file matches"):
        _run([str(tmp_path / "*.zst")], tmp_path / "o", neox_path)


def test_directory_input_takes_line_files_not_metadata(tmp_path):
    from megatron_lev.data.readers import find_inputs

    (tmp_path / "a.jsonl.zst").write_bytes(b"")
    (tmp_path / "b.jsonl").write_text("")
    (tmp_path / "manifest.json").write_text('{"subsets": {}}\n')
    found = [p.rsplit("/", 1)[-1] for p in find_inputs([str(tmp_path)])]
    assert found == ["a.jsonl.zst", "b.jsonl"]
    # an explicitly named .json file is still read as JSON lines
    assert find_inputs([str(tmp_path / "manifest.json")]) == [str(tmp_path / "manifest.json")]
