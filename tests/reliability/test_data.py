"""Bad input and faults for the data commands: preprocess, shard sets and their manifests,
MMIDIDX indices and the sample-index cache.

Each case checks the exit status, the one-line message (it names the file or flag) and
what is left on disk: nothing half-written, earlier output intact, no temp files, no
stray outputs, no leftover processes. A full disk is a real, tiny tmpfs when this
machine allows mounting one (root), else the write call is made to raise ENOSPC.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import zstandard

from megatron_lev.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megatron_lev.data.manifest import ShardSetError, verify_shard_set
from megatron_lev.data.preprocess import set_chunk_hook
from megatron_lev.testing.preprocess_faults import PreprocessFault
from tests.reliability.harness import ROOT, expect_error, expect_ok, run_cli

MARK_ENV = "MEGATRON_LEV_TEST_MARK"
SET_EXTS = (".bin", ".idx", ".stats.json", ".counts.npy", ".manifest.json")


# --------------------------------------------------------------------------- shared inputs


@pytest.fixture(scope="module", autouse=True)
def checksum_cache(tmp_path_factory):
    """Keep the sha256 cache of these tests out of the home directory."""
    old = os.environ.get("MEGATRON_LEV_CACHE_DIR")
    os.environ["MEGATRON_LEV_CACHE_DIR"] = str(tmp_path_factory.mktemp("sha-cache"))
    yield
    if old is None:
        os.environ.pop("MEGATRON_LEV_CACHE_DIR", None)
    else:
        os.environ["MEGATRON_LEV_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def neox(shared_data) -> str:
    return str(shared_data / "tokenizers" / "gpt-neox-20b.json")


@pytest.fixture(scope="module")
def docs(shared_data) -> list[bytes]:
    """80 real documents (Fortunes, then Wikipedia) as JSON lines."""
    out = []
    for name in ("Fortunes", "Wikipedia_en"):
        with open(shared_data / "minipile" / f"{name}.jsonl.zst", "rb") as f:
            text = zstandard.ZstdDecompressor().stream_reader(f).read(400_000)
        out += text.split(b"\n")[:40]
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, docs) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_bytes(b"\n".join(docs) + b"\n")
    return path


@pytest.fixture(scope="module")
def good_set(tmp_path_factory, corpus, neox) -> Path:
    """The corpus preprocessed once (2 shards): the prefix."""
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    prefix = tmp_path_factory.mktemp("good") / "set"
    preprocess(
        PreprocessOptions(
            [str(corpus)], str(prefix), "hf", neox, progress=False, shard_size_mb=0.02, chunk_bytes=16 << 10
        )
    )
    return prefix


def copy_set(src: Path, dst_dir: Path) -> Path:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for p in src.parent.iterdir():
        if p.name.startswith(src.name):
            shutil.copy2(p, dst_dir / p.name)
    return dst_dir / src.name


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def leftovers(directory: Path) -> list[str]:
    """Temp files, staging or part directories left in `directory`."""
    return [
        p.name
        for p in directory.iterdir()
        if ".tmp." in p.name or ".parts." in p.name or ".staging" in p.name
    ]


def outputs_of(prefix: Path) -> list[str]:
    if not prefix.parent.is_dir():
        return []
    return sorted(
        p.name
        for p in prefix.parent.iterdir()
        if p.name.startswith(prefix.name) and p.name.endswith(SET_EXTS)
    )


def preprocess_argv(inputs, prefix, neox, *extra) -> list:
    return [
        "preprocess",
        "--input",
        *inputs,
        "--output-prefix",
        prefix,
        "--tokenizer",
        neox,
        "--workers",
        "1",
        "--no-progress",
        *extra,
    ]


# --------------------------------------------------------------------------- preprocess: bad input and flags


def _write(name: str, data: bytes | str):
    def make(tmp: Path, docs) -> list[str]:
        p = tmp / "in" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
        return [str(p)]

    return make


def _lines(*lines: bytes, name="x.jsonl"):
    return _write(name, b"\n".join(lines) + b"\n")


def _good_and_bad(n_good: int, n_bad: int):
    def make(tmp, docs):
        p = tmp / "in" / "mixed.jsonl"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"\n".join(docs[:n_good] + [b"{oops"] * n_bad) + b"\n")
        return [str(p)]

    return make


def _small_zst_cut(tmp, docs):
    raw = b"\n".join(docs[:5]) + b"\n"
    data = zstandard.ZstdCompressor().compress(raw)
    p = tmp / "in" / "cut.jsonl.zst"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data[: len(data) // 2])  # inside the only zstd block: nothing is decodable
    return [str(p)]


def _empty_dir(tmp, docs):
    d = tmp / "in" / "nothing_here"
    d.mkdir(parents=True)
    (d / "notes.txt").write_text("not a corpus\n")
    (d / "meta.json").write_text("{}\n")
    return [str(d)]


def _hf_without_text(tmp, docs):
    import datasets

    d = tmp / "in" / "hf"
    datasets.Dataset.from_list([{"content": "a"}, {"content": "b"}]).save_to_disk(str(d))
    return [str(d)]


def _missing(tmp, docs):
    return [str(tmp / "in" / "nope.jsonl")]


def _no_match(tmp, docs):
    return [str(tmp / "in" / "*.jsonl.zst")]


def _corpus(tmp, docs):
    return _lines(*docs[:10])(tmp, docs)


PREPROCESS_REFUSALS = [
    pytest.param(_missing, [], 1, [r"nope\.jsonl", "no such file"], id="missing-input"),
    pytest.param(_no_match, [], 1, [r"\*\.jsonl\.zst", "no file matches"], id="glob-matches-nothing"),
    pytest.param(_empty_dir, [], 1, ["nothing_here", r"no \*\.jsonl"], id="directory-without-inputs"),
    pytest.param(
        _write("empty.jsonl", b""),
        [],
        1,
        [r"empty\.jsonl", "no documents", "input is empty"],
        id="empty-file",
    ),
    pytest.param(
        _lines(b"{not json", b"[1, 2", b"plain text"),
        [],
        1,
        [r"x\.jsonl", "no documents", "malformed_json 3", r"x\.jsonl:1"],
        id="non-json-lines",
    ),
    pytest.param(
        _lines(b'{"content": "a"}', b'{"body": "b"}'),
        [],
        1,
        ["no documents", "missing_key 2", "--json-key"],
        id="records-without-text",
    ),
    pytest.param(
        _lines(b'{"text": 3}', b'{"text": null}', b'["text"]'),
        [],
        1,
        ["no documents", "missing_key 3"],
        id="text-not-a-string",
    ),
    pytest.param(
        _lines(b'{"text": "caf\xff\xfe"}', b"\xff\xfe\xfd"),
        [],
        1,
        ["no documents", "invalid_utf8 2"],
        id="non-utf8-bytes",
    ),
    pytest.param(
        _write("random.jsonl", bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8))),
        [],
        1,
        [r"random\.jsonl", "no documents"],
        id="binary-file",
    ),
    pytest.param(
        _lines(b'{"text": "   "}', b'{"text": ""}'),
        [],
        1,
        ["no documents", "empty_document 2"],
        id="only-empty-documents",
    ),
    pytest.param(
        _corpus, ["--json-key", "body"], 1, ["no documents", "missing_key", "'body'"], id="wrong-json-key"
    ),
    pytest.param(
        _write("notes.txt", "hello\n"),
        [],
        1,
        [r"notes\.txt", "unsupported file type"],
        id="unsupported-extension",
    ),
    pytest.param(
        _write("plain.jsonl.zst", b'{"text": "not compressed"}\n'),
        [],
        1,
        [r"plain\.jsonl\.zst", "no documents", "truncated_file"],
        id="zst-that-is-not-zstd",
    ),
    pytest.param(
        _write("plain.jsonl.gz", b'{"text": "not compressed"}\n'),
        [],
        1,
        [r"plain\.jsonl\.gz", "no documents"],
        id="gz-that-is-not-gzip",
    ),
    pytest.param(
        _small_zst_cut,
        [],
        1,
        [r"cut\.jsonl\.zst", "no documents", "truncated_file"],
        id="small-zst-cut-in-half",
    ),
    pytest.param(
        _hf_without_text, [], 1, [r"hf", "no column 'text'", "--json-key"], id="dataset-without-text-column"
    ),
    pytest.param(
        _write("bad.parquet", b"PAR1 this is not parquet"),
        [],
        1,
        [r"bad\.parquet", "not a readable dataset"],
        id="corrupt-parquet",
    ),
    pytest.param(
        _good_and_bad(3, 7),
        ["--max-bad-fraction", "0.5"],
        1,
        ["7 of 10 lines are bad", "--max-bad-fraction", r"mixed\.jsonl:4"],
        id="too-many-bad-lines",
    ),
    pytest.param(_corpus, ["--workers", "0"], 2, ["--workers", ">= 1"], id="workers-zero"),
    pytest.param(_corpus, ["--workers", "-3"], 2, ["--workers", "-3"], id="workers-negative"),
    pytest.param(
        _corpus, ["--shard-size-mb", "-1"], 2, ["--shard-size-mb", "positive"], id="shard-size-negative"
    ),
    pytest.param(_corpus, ["--shard-size-mb", "0"], 2, ["--shard-size-mb"], id="shard-size-zero"),
    pytest.param(_corpus, ["--shard-size-mb", "nan"], 2, ["--shard-size-mb", "nan"], id="shard-size-nan"),
    pytest.param(_corpus, ["--chunk-mb", "0"], 2, ["--chunk-mb"], id="chunk-size-zero"),
    pytest.param(_corpus, ["--chunk-mb", "-2"], 2, ["--chunk-mb"], id="chunk-size-negative"),
    pytest.param(
        _corpus,
        ["--max-bad-fraction", "1.5"],
        2,
        ["--max-bad-fraction", r"\[0, 1\]"],
        id="bad-fraction-above-one",
    ),
    pytest.param(_corpus, ["--json-key", ""], 2, ["--json-key"], id="empty-json-key"),
]


@pytest.mark.parametrize("make, extra, rc, fragments", PREPROCESS_REFUSALS)
def test_preprocess_refuses_bad_input(make, extra, rc, fragments, tmp_path, docs, neox, capsys):
    inputs = make(tmp_path, docs)
    prefix = tmp_path / "out" / "set"
    expect_error(run_cli(preprocess_argv(inputs, prefix, neox, *extra), capsys), *fragments, rc=rc)
    assert outputs_of(prefix) == [], "a refused run must write no output"
    if prefix.parent.is_dir():
        assert leftovers(prefix.parent) == []


def _prefix_is_dir(tmp):
    (tmp / "out").mkdir()
    return tmp / "out"


def _prefix_ends_in_slash(tmp):
    return f"{tmp / 'out'}/"


def _prefix_under_a_file(tmp):
    (tmp / "afile").write_text("x")
    return tmp / "afile" / "set"


def _prefix_unwritable(tmp):
    return Path("/sys/megatron-lev-test") / "set"  # creating anything here is refused, even for root


OUTPUT_REFUSALS = [
    pytest.param(_prefix_is_dir, 2, ["--output-prefix", "is a directory"], id="output-prefix-is-directory"),
    pytest.param(
        _prefix_ends_in_slash, 2, ["--output-prefix", "file name prefix"], id="output-prefix-ends-in-slash"
    ),
    pytest.param(
        _prefix_under_a_file, 1, ["afile", "cannot create|not a directory"], id="output-under-a-file"
    ),
    pytest.param(
        _prefix_unwritable,
        1,
        ["megatron-lev-test", "cannot create|not writable|permission"],
        id="output-directory-unwritable",
    ),
]


@pytest.mark.parametrize("make, rc, fragments", OUTPUT_REFUSALS)
def test_preprocess_refuses_bad_output_prefix(make, rc, fragments, tmp_path, corpus, neox, capsys):
    prefix = make(tmp_path)
    expect_error(run_cli(preprocess_argv([corpus], prefix, neox), capsys), *fragments, rc=rc)
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob("*.manifest.json"))


def _tok_missing(tmp):
    return ["--tokenizer", tmp / "missing.json"]


def _tok_garbage(tmp):
    (tmp / "tok.json").write_text('{"model": 3}')
    return ["--tokenizer", tmp / "tok.json"]


def _tok_wrong_type(tmp):
    (tmp / "tok.model").write_bytes(b"\x00" * 64)
    return ["--tokenizer", tmp / "tok.model", "--tokenizer-type", "sentencepiece"]


@pytest.mark.parametrize(
    "make, fragments",
    [
        pytest.param(_tok_missing, [r"missing\.json", "not found"], id="tokenizer-missing"),
        pytest.param(_tok_garbage, [r"tok\.json", "not a Hugging Face tokenizer"], id="tokenizer-garbage"),
        pytest.param(
            _tok_wrong_type, [r"tok\.model", "not a SentencePiece model"], id="tokenizer-not-sentencepiece"
        ),
    ],
)
def test_preprocess_refuses_bad_tokenizer(make, fragments, tmp_path, corpus, neox, capsys):
    argv = preprocess_argv([corpus], tmp_path / "out" / "set", neox) + make(tmp_path)
    expect_error(run_cli(argv, capsys), *fragments)
    assert outputs_of(tmp_path / "out" / "set") == []


def test_preprocess_needs_input_and_output(tmp_path, neox, capsys):
    expect_error(run_cli(["preprocess", "--tokenizer", neox], capsys), "--input", "--output-prefix", rc=2)


# --------------------------------------------------------------------------- preprocess: what it keeps


def test_truncated_zst_keeps_what_was_decodable_with_a_warning(tmp_path, shared_data, neox, capsys):
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        lines = zstandard.ZstdDecompressor().stream_reader(f).read(1_500_000).split(b"\n")[:-1]
    raw = b"\n".join(lines) + b"\n"  # distinct text: many zstd blocks
    data = zstandard.ZstdCompressor().compress(raw)
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(data[: len(data) // 2])
    prefix = tmp_path / "out" / "set"
    out = run_cli(preprocess_argv([cut], prefix, neox), capsys)
    expect_ok(out)
    assert re.search(r"warning: .*cut\.jsonl\.zst.*kept the \d+ line", out.err), out.err
    stats = json.loads(Path(f"{prefix}.stats.json").read_text())
    assert 0 < stats["documents"] < len(lines) and stats["errors"] == {"truncated_file": 1}
    verify_shard_set(prefix)


def test_subset_names_cannot_leave_the_output_directory(tmp_path, neox, capsys):
    lines = [
        {"text": "one", "meta": {"pile_set_name": "/../../escaped/y"}},
        {"text": "two", "meta": {"pile_set_name": "a/b"}},
        {"text": "three", "meta": {"pile_set_name": "a_b"}},
        {"text": "four", "meta": {"pile_set_name": "..\\..\\win\x00"}},
        {"text": "five", "meta": {"pile_set_name": "Wikipedia (en)"}},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in lines))
    out_dir = tmp_path / "deep" / "er" / "out"
    before = {p for p in tmp_path.rglob("*")}
    expect_ok(run_cli(preprocess_argv([src], out_dir / "set", neox, "--split-by-subset"), capsys))
    new = {p for p in tmp_path.rglob("*")} - before
    assert all(p.parent == out_dir or p == out_dir or p in out_dir.parents for p in new), sorted(
        map(str, new)
    )
    manifest = json.loads((out_dir / "set.manifest.json").read_text())
    assert len(manifest["shards"]) == 5  # "a/b" and "a_b" stay apart
    assert "set_Wikipedia (en)" in manifest["shards"]
    assert all("/" not in s and "\\" not in s and "\x00" not in s for s in manifest["shards"])
    for shard in manifest["shards"]:
        verify_shard_set(out_dir / shard)


def test_rerun_with_fewer_shards_removes_the_old_ones(tmp_path, corpus, neox, capsys):
    prefix = tmp_path / "set"
    expect_ok(run_cli(preprocess_argv([corpus], prefix, neox, "--shard-size-mb", "0.004"), capsys))
    first = json.loads(Path(f"{prefix}.manifest.json").read_text())["shards"]
    assert len(first) >= 3
    out = run_cli(preprocess_argv([corpus], prefix, neox, "--shard-size-mb", "1"), capsys)
    expect_ok(out)
    assert "removed" in out.out
    manifest = json.loads(Path(f"{prefix}.manifest.json").read_text())
    assert manifest["shards"] == ["set_00000"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*manifest["files"], "set.manifest.json"])


def test_rerun_removes_numbered_shards_without_a_manifest(tmp_path, corpus, neox, capsys):
    prefix = tmp_path / "set"
    b = IndexedDatasetBuilder(tmp_path / "set_00007", np.uint16)
    b.add_document([1, 2, 3])
    b.finalize()
    expect_ok(run_cli(preprocess_argv([corpus], prefix, neox, "--shard-size-mb", "1"), capsys))
    assert not (tmp_path / "set_00007.bin").exists() and not (tmp_path / "set_00007.idx").exists()


def test_a_failed_rerun_keeps_the_earlier_set(tmp_path, good_set, neox, capsys):
    prefix = copy_set(good_set, tmp_path / "out")
    before = snapshot(prefix.parent)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    expect_error(
        run_cli(preprocess_argv([bad], prefix, neox, "--shard-size-mb", "0.02"), capsys), "no documents"
    )
    assert snapshot(prefix.parent) == before and leftovers(prefix.parent) == []
    verify_shard_set(f"{prefix}_00000")


def dead_pid() -> int:
    """A pid that no longer runs."""
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout.strip()
    )


def this_host() -> str:
    """The host part of this machine's temp names (`.<name>.tmp.<host>-<pid>`)."""
    from megatron_lev.utils.io import temp_tag

    return temp_tag().rsplit("-", 1)[0]


DAY = 24 * 3600


def test_next_run_cleans_what_dead_runs_left(tmp_path, corpus, neox, capsys):
    pid = dead_pid()
    dead = f"{this_host()}-{pid}"
    out = tmp_path / "out"
    (out / f".set.staging.tmp.{dead}").mkdir(parents=True)
    (out / f".set.staging.tmp.{dead}" / "set.bin").write_bytes(b"x" * 100)
    (out / f".set.parts.{pid}").mkdir()  # the earlier design: no host recorded, so removed once old
    os.utime(out / f".set.parts.{pid}", (time.time() - 2 * DAY,) * 2)
    (out / f".set.counts.npy.tmp.othernode-{pid}").write_bytes(b"x")  # another host's, a day untouched
    os.utime(out / f".set.counts.npy.tmp.othernode-{pid}", (time.time() - 2 * DAY,) * 2)
    (out / f".set.bin.tmp.{dead}").write_bytes(b"x")
    (out / f".set_00003.idx.tmp.{dead}").write_bytes(b"x")
    (out / ".other.bin.tmp.1").write_bytes(b"x")  # another set's: not ours to remove
    res = run_cli(preprocess_argv([corpus], out / "set", neox), capsys)
    expect_ok(res)
    assert "interrupted earlier run" in res.err
    assert sorted(leftovers(out)) == [".other.bin.tmp.1"]


def _temp(make_name, age: float = 0, directory: bool = False):
    def make(out: Path) -> Path:
        p = out / make_name()
        p.mkdir() if directory else p.write_bytes(b"x")
        if age:
            os.utime(p, (time.time() - age,) * 2)
        return p

    return make


# (temp left in the directory of prefix `set_1`, removed by the next run into set_1?)
TEMP_CASES = [
    pytest.param(
        _temp(lambda: f".set_1.bin.tmp.{this_host()}-{dead_pid()}"), True, id="temp-of-dead-pid-here"
    ),
    pytest.param(
        _temp(lambda: f".set_1.staging.tmp.{this_host()}-{dead_pid()}", directory=True),
        True,
        id="staging-of-dead-pid-here",
    ),
    pytest.param(
        _temp(lambda: f".set_1.bin.tmp.{this_host()}-{os.getppid()}"), False, id="temp-of-live-pid-here"
    ),
    pytest.param(
        _temp(lambda: f".set_10.bin.tmp.{this_host()}-{dead_pid()}"),
        False,
        id="temp-of-a-longer-prefix-not-ours",
    ),
    pytest.param(_temp(lambda: f".set_1.bin.tmp.{dead_pid()}x"), False, id="temp-suffix-not-a-pid"),
    pytest.param(_temp(lambda: ".set_1.notes.tmp.keep-me"), False, id="temp-suffix-not-host-pid"),
    pytest.param(
        _temp(lambda: f".set_1.bin.tmp.othernode-{dead_pid()}"), False, id="temp-of-another-host-kept"
    ),
    pytest.param(
        _temp(lambda: f".set_1.staging.tmp.othernode-{dead_pid()}", directory=True),
        False,
        id="staging-of-another-host-kept",
    ),
    pytest.param(_temp(lambda: f".set_1.bin.tmp.{dead_pid()}"), False, id="temp-without-host-kept"),
    pytest.param(
        _temp(lambda: f".set_1.bin.tmp.{os.getppid()}", age=2 * DAY),
        True,
        id="temp-without-host-older-than-a-day",
    ),  # its pid number running here proves nothing
]


@pytest.mark.parametrize("make, removed", TEMP_CASES)
def test_dead_run_cleanup_takes_only_stale_temps_of_this_prefix(make, removed, tmp_path):
    """Liveness (a pid) means something on this host only: the directory may be on a filesystem
    that other nodes write to at the same time."""
    from megatron_lev.data.preprocess import clean_dead_runs

    temp = make(tmp_path)
    gone = clean_dead_runs(tmp_path / "set_1")
    assert (not temp.exists()) == removed and (temp in gone) == removed, (temp.name, gone)


def subset_docs(docs: list[bytes], subsets: list[str]) -> bytes:
    """The documents as JSON lines with meta.pile_set_name cycling through `subsets`."""
    texts = [json.loads(d)["text"] for d in docs if d.strip()][:40]
    return b"".join(
        json.dumps({"text": t, "meta": {"pile_set_name": subsets[i % len(subsets)]}}).encode() + b"\n"
        for i, t in enumerate(texts)
    )


def _sharded_subset_set_then_split(tmp, cli):
    """data/pile_Github made with --shard-size-mb, then `--output-prefix data/pile --split-by-subset`,
    which writes data/pile_Github.bin/.idx beside it (and used to delete its shards)."""
    cli(tmp / "github.jsonl", tmp / "data" / "pile_Github", "--shard-size-mb", "0.01")
    return tmp / "data" / "pile_Github", (tmp / "mixed.jsonl", tmp / "data" / "pile", "--split-by-subset")


def _sharded_subset_set_then_sharded_split(tmp, cli):
    cli(tmp / "github.jsonl", tmp / "data" / "pile_Github", "--shard-size-mb", "0.01")
    return tmp / "data" / "pile_Github", (
        tmp / "mixed.jsonl",
        tmp / "data" / "pile",
        "--split-by-subset",
        "--shard-size-mb",
        "0.01",
    )


def _unsharded_subset_set_then_split(tmp, cli):
    cli(tmp / "github.jsonl", tmp / "data" / "pile_Github")
    return tmp / "data" / "pile_Github", (tmp / "mixed.jsonl", tmp / "data" / "pile", "--split-by-subset")


def _split_set_then_its_subset_prefix(tmp, cli):
    """data/pile made with --split-by-subset, then `--output-prefix data/pile_Github`: its
    pile_Github.bin/.idx are pile's."""
    cli(tmp / "mixed.jsonl", tmp / "data" / "pile", "--split-by-subset")
    return tmp / "data" / "pile", (tmp / "github.jsonl", tmp / "data" / "pile_Github")


def _shared_shards_then_rerun_unsplit(tmp, cli):
    """data/pile made with --split-by-subset --shard-size-mb, its Github shards then also given a
    set of their own (--write-manifest-for data/pile_Github); a rerun into data/pile that no longer
    writes them must not delete what the other set lists."""
    cli(tmp / "mixed.jsonl", tmp / "data" / "pile", "--split-by-subset", "--shard-size-mb", "0.01")
    cli(None, tmp / "data" / "pile_Github")
    return tmp / "data" / "pile_Github", (tmp / "mixed.jsonl", tmp / "data" / "pile")


OTHER_SET_CASES = [
    pytest.param(
        _sharded_subset_set_then_split,
        [
            r"data/pile_Github\b",
            "prefix of another shard set",
            r"pile_Github\.manifest\.json",
            "--output-prefix",
        ],
        id="split-beside-a-sharded-set-of-a-subset-name",
    ),
    pytest.param(
        _sharded_subset_set_then_sharded_split,
        [
            r"would overwrite .*pile_Github_00000\.(bin|idx)",
            r"shard set .*data/pile_Github\b",
            "--output-prefix",
        ],
        id="split-would-overwrite-shards-of-another-set",
    ),
    pytest.param(
        _unsharded_subset_set_then_split,
        [r"would overwrite .*pile_Github\.(bin|idx)", r"pile_Github\.manifest\.json", "--output-prefix"],
        id="split-would-overwrite-an-unsharded-set",
    ),
    pytest.param(
        _split_set_then_its_subset_prefix,
        [r"would overwrite .*pile_Github\.(bin|idx)", r"shard set .*data/pile\b", r"pile\.manifest\.json"],
        id="prefix-would-overwrite-a-subset-of-another-set",
    ),
    pytest.param(_shared_shards_then_rerun_unsplit, None, id="rerun-keeps-shards-another-set-lists"),
]


@pytest.mark.parametrize("make, fragments", OTHER_SET_CASES)
def test_preprocess_never_touches_another_shard_set(make, fragments, tmp_path, docs, neox, capsys):
    (tmp_path / "github.jsonl").write_bytes(subset_docs(docs, ["Github"]))
    (tmp_path / "mixed.jsonl").write_bytes(subset_docs(docs, ["Github", "Wikipedia"]))

    def cli(src, prefix, *extra):
        argv = (
            preprocess_argv([src], prefix, neox, *extra)
            if src is not None
            else ["preprocess", "--write-manifest-for", prefix, "--tokenizer", neox]
        )
        return run_cli(argv, capsys)

    other, later = make(tmp_path, lambda *a: expect_ok(cli(*a)))
    manifest = json.loads(Path(f"{other}.manifest.json").read_text())
    owned = [*manifest["files"], f"{other.name}.manifest.json"]
    before = {n: (other.parent / n).read_bytes() for n in owned}
    res = cli(*later)
    if fragments is None:
        expect_ok(res)
    else:
        expect_error(res, *fragments, "nothing was written")
        assert not Path(f"{later[1]}.manifest.json").exists()
    assert {
        n: (other.parent / n).read_bytes() if (other.parent / n).exists() else None for n in owned
    } == before
    for shard in manifest["shards"]:
        verify_shard_set(other.parent / shard)
    assert leftovers(other.parent) == []


@pytest.fixture
def tiny_disk(tmp_path):
    """A directory on a 96 KiB tmpfs, or None where mounting is not allowed."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    ok = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        == 0
        if os.geteuid() == 0
        else False
    )
    yield mnt if ok else None
    if ok:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_names_the_output_and_leaves_nothing(
    tmp_path, tiny_disk, corpus, neox, capsys, monkeypatch
):
    big = tmp_path / "big.jsonl"
    big.write_bytes(corpus.read_bytes() * 6)
    out_dir = tiny_disk if tiny_disk is not None else tmp_path / "out"
    if tiny_disk is None:  # no tmpfs: the shard write raises ENOSPC as a full disk would
        import errno

        def full(self, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(self._tmp_bin))

        monkeypatch.setattr(IndexedDatasetBuilder, "_write", full)
    res = run_cli(preprocess_argv([big], out_dir / "set", neox), capsys)
    expect_error(res, r"set", "no space left")
    assert outputs_of(out_dir / "set") == [] and leftovers(out_dir) == []


@pytest.mark.parametrize(
    "fault, fragments",
    [
        pytest.param("raise:1", ["worker failed", r"docs\.jsonl", "injected fault"], id="worker-raises"),
        pytest.param("exit:1", ["worker died", r"docs\.jsonl", "--workers"], id="worker-dies"),
    ],
)
def test_worker_failure_stops_the_run_cleanly(
    fault, fragments, tmp_path, good_set, corpus, neox, capsys, monkeypatch
):
    prefix = copy_set(good_set, tmp_path / "out")
    before = snapshot(prefix.parent)
    monkeypatch.setenv(MARK_ENV, tmp_path.name)
    previous = set_chunk_hook(PreprocessFault.parse(fault))
    try:
        res = run_cli(preprocess_argv([corpus], prefix, neox, "--workers", "2", "--chunk-mb", "0.01"), capsys)
    finally:
        set_chunk_hook(previous)
    expect_error(res, *fragments)
    assert snapshot(prefix.parent) == before and leftovers(prefix.parent) == []
    assert wait_gone(tmp_path.name) == []


# --------------------------------------------------------------------------- preprocess: signals, kills


def marked(mark: str) -> list[str]:
    """Live processes whose environment carries this test's mark (the CLI and its workers), but
    not the multiprocessing resource tracker that this test process itself owns."""
    needle = f"{MARK_ENV}={mark}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if needle not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") or ") Z " in stat:
                continue
            ours = stat.rsplit(")", 1)[1].split()[1] == str(os.getpid())
            if ours and b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            found.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
        except OSError:
            continue
    return found


def wait_gone(mark: str, timeout: float = 10) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _workers_of(pid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == str(pid) and b"spawn_main" in cmd:
            out.append(int(p))
    return out


# `megatron-lev` whose preprocess worker stalls at chunk 2 (so a signal meets a run in progress)
STALLING_PREPROCESS = (
    "import sys\n"
    "from megatron_lev.data.preprocess import set_chunk_hook\n"
    "from megatron_lev.testing.preprocess_faults import PreprocessFault\n"
    "set_chunk_hook(PreprocessFault('sleep', 2))\n"
    "from megatron_lev.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _interrupt(proc):
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group


def _terminate(proc):
    os.kill(proc.pid, signal.SIGTERM)


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)


def _kill_a_worker(proc):
    os.kill(_workers_of(proc.pid)[0], signal.SIGKILL)  # what the OOM killer does


@pytest.mark.parametrize(
    "act, rc, fragment",
    [
        pytest.param(_interrupt, 130, "interrupted", id="ctrl-c"),
        pytest.param(_terminate, 143, "terminated", id="sigterm"),
        pytest.param(_kill, -signal.SIGKILL, None, id="sigkill"),
        pytest.param(_kill_a_worker, 1, "worker died", id="worker-killed"),
    ],
)
def test_signals_never_hang_or_orphan_workers(act, rc, fragment, tmp_path, good_set, corpus, neox, capsys):
    prefix = copy_set(good_set, tmp_path / "out")
    before = snapshot(prefix.parent)
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK_ENV: mark, "PYTHONPATH": str(ROOT)}
    argv = preprocess_argv([corpus], prefix, neox, "--workers", "2", "--chunk-mb", "0.005")
    # A suite started in the background (`make test &`) inherits SIGINT ignored, and so would the run.
    # A caught SIGINT is reset to the default at exec, so catching it here while the run starts gives
    # the run the disposition a terminal's Ctrl-C meets (preexec_fn would run Python between fork and
    # exec, which can deadlock in a process with threads).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", STALLING_PREPROCESS, *map(str, argv)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        deadline = time.monotonic() + 60
        while len(_workers_of(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert len(_workers_of(proc.pid)) == 2, "the workers did not start"
        time.sleep(1.5)  # the workers are importing or tokenising, one sleeps at chunk 2
        act(proc)
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # say who is still there (the main process, or a process holding its stderr open) and what
        # the run printed, so that a hang seen once can be diagnosed
        main = "alive" if proc.poll() is None else f"exited {proc.returncode}"
        alive = f"main {main}, marked {marked(mark)}"
        os.killpg(proc.pid, signal.SIGKILL)
        for entry in marked(mark):  # "pid: cmdline"
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(entry.split(":", 1)[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"preprocess hung after the signal ({alive}); its stderr ends:\n{err[-1500:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == rc, err[-2000:]
    if fragment:
        assert "Traceback" not in err and re.search(fragment, err.strip().splitlines()[-1]), err[-2000:]
    assert wait_gone(mark) == [], "workers outlived the run"
    after = snapshot(prefix.parent)
    lock = f".{prefix.name}.lock"  # a killed run's lock file stays: the kernel released its lock
    if rc == -signal.SIGKILL:
        after.pop(lock)
    assert after == before, "the earlier output changed"
    verify_shard_set(f"{prefix}_00000")
    if rc == -signal.SIGKILL:  # a killed run leaves its staging directory for the next run to remove
        expect_ok(run_cli(preprocess_argv([corpus], prefix, neox, "--shard-size-mb", "0.02"), capsys))
    assert leftovers(prefix.parent) == [] and not (prefix.parent / lock).exists()


# --------------------------------------------------------------------------- shard sets: the manifest


def build_indices_argv(prefix, tmp: Path, *extra) -> list:
    return [
        "build-indices",
        f"data.data_path=[{prefix}]",
        f"data.cache_dir={tmp / 'cache'}",
        "model.seq_length=16",
        "train.train_iters=4",
        "train.micro_batch_size=2",
        "train.eval_interval=0",
        f"logging.output_dir={tmp / 'run'}",
        *extra,
        "--num-samples",
        "8",
        "0",
        "0",
    ]


def _drop_manifest(prefix: Path, tmp: Path):
    Path(f"{prefix}.manifest.json").unlink()
    return f"{prefix}_00000"


def _garble_manifest(prefix, tmp):
    Path(f"{prefix}.manifest.json").write_text("{not json")
    return f"{prefix}_00000"


def _foreign_manifest(prefix, tmp):
    Path(f"{prefix}.manifest.json").write_text(json.dumps({"format": "something else"}))
    return f"{prefix}_00000"


def _grow_bin(prefix, tmp):
    with open(f"{prefix}_00000.bin", "ab") as f:
        f.write(b"\0\0")
    return f"{prefix}_00000"


def _flip_bin(prefix, tmp):
    p = Path(f"{prefix}_00000.bin")
    data = bytearray(p.read_bytes())
    data[100:164] = bytes(64)  # same size, other bytes
    p.write_bytes(bytes(data))
    return f"{prefix}_00000"


def _cut_idx(prefix, tmp):
    p = Path(f"{prefix}_00000.idx")
    p.write_bytes(p.read_bytes()[:-16])
    return f"{prefix}_00000"


def _stray_shard(prefix, tmp):
    for ext in (".bin", ".idx"):
        shutil.copyfile(f"{prefix}_00000{ext}", f"{prefix}_00009{ext}")
    return f"{prefix}_00009"


def _lose_counts(prefix, tmp):
    Path(f"{prefix}.counts.npy").unlink()
    return f"{prefix}_00000"


def _unknown_prefix(prefix, tmp):
    return f"{prefix.parent / 'absent'}"


SET_REFUSALS = [
    pytest.param(
        _drop_manifest,
        [r"set_00000", r"no set_00000\.manifest\.json", "--write-manifest-for"],
        id="manifest-missing",
    ),
    pytest.param(_garble_manifest, [r"set\.manifest\.json", "unreadable"], id="manifest-not-json"),
    pytest.param(
        _foreign_manifest,
        [r"set\.manifest\.json", "not a megatron-lev shard-set manifest"],
        id="manifest-foreign",
    ),
    pytest.param(_grow_bin, [r"set_00000\.bin", "bytes, but", "records"], id="bin-size-differs"),
    pytest.param(_flip_bin, [r"set_00000\.bin", "sha256", "damaged"], id="bin-bytes-changed"),
    pytest.param(_cut_idx, [r"set_00000\.idx", "bytes, but"], id="idx-truncated"),
    pytest.param(
        _stray_shard,
        [r"set_00009", "not part of the shard set", r"set\.manifest\.json"],
        id="stray-shard-not-in-manifest",
    ),
    pytest.param(_lose_counts, [r"set\.counts\.npy", "missing"], id="listed-file-missing"),
    pytest.param(_unknown_prefix, [r"absent", "no absent\\.manifest\\.json"], id="unknown-prefix"),
]


@pytest.mark.parametrize("damage, fragments", SET_REFUSALS)
def test_build_indices_refuses_a_damaged_set(damage, fragments, tmp_path, good_set, capsys):
    prefix = copy_set(good_set, tmp_path / "set")
    shard = damage(prefix, tmp_path)
    before = snapshot(prefix.parent)
    expect_error(run_cli(build_indices_argv(shard, tmp_path), capsys), *fragments)
    assert snapshot(prefix.parent) == before
    assert not list((tmp_path / "cache").glob("*description.json")) if (tmp_path / "cache").exists() else True


def _other_hf_tokenizer(tmp: Path, neox: str) -> list[str]:
    tok = json.loads(Path(neox).read_text())
    tok["added_tokens"][-1]["content"] = "<|renamed|>"  # another tokenizer file, same vocabulary size
    (tmp / "other.json").write_text(json.dumps(tok))
    return [f"data.tokenizer_path={tmp / 'other.json'}"]


def _same_tokenizer(tmp, neox):
    return [f"data.tokenizer_path={neox}"]


def _copied_tokenizer(tmp, neox):
    shutil.copyfile(neox, tmp / "renamed.json")  # the same file elsewhere is the same tokenizer
    return [f"data.tokenizer_path={tmp / 'renamed.json'}"]


@pytest.mark.parametrize(
    "make, fragments",
    [
        pytest.param(
            _other_hf_tokenizer,
            [r"set_00000", "another tokenizer", "data.tokenizer_path"],
            id="different-tokenizer",
        ),
        pytest.param(_same_tokenizer, None, id="same-tokenizer"),
        pytest.param(_copied_tokenizer, None, id="same-tokenizer-other-path"),
    ],
)
def test_shards_must_match_the_run_tokenizer(make, fragments, tmp_path, good_set, neox, capsys):
    prefix = copy_set(good_set, tmp_path / "set")
    res = run_cli(build_indices_argv(f"{prefix}_00000", tmp_path, *make(tmp_path, neox)), capsys)
    if fragments is None:
        expect_ok(res)
    else:
        expect_error(res, *fragments)
        assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_vocabulary_smaller_than_the_largest_id_is_refused(good_set):
    manifest = verify_shard_set(f"{good_set}_00000")
    with pytest.raises(
        ShardSetError, match=rf"token id {manifest['max_token_id']}.*vocabulary has only 1000"
    ):
        verify_shard_set(f"{good_set}_00000", vocab_size=1000)
    verify_shard_set(f"{good_set}_00000", vocab_size=manifest["max_token_id"] + 1)


def _verify_with_hashing_failing_on_rank_0(shard: str, error: str) -> str:
    """On 2 gloo ranks: rank 0, the one that hashes, cannot read the shard. Returns the error
    every rank raised."""
    import errno

    import torch.distributed as dist

    from megatron_lev.data import manifest

    if dist.get_rank() == 0:

        def failing(path, *args):
            if error == "permission":
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            raise OSError(errno.EIO, "Input/output error", str(path))

        manifest.cached_sha256 = failing  # the whole-file sums (the set's .stats.json, .counts.npy)
        manifest.chunk_digest = failing  # the sampled chunks of its shards (this rank's share)
    try:
        manifest.verify_shard_set(shard)
    except manifest.ShardSetError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "error, fragment",
    [
        pytest.param("permission", "Permission denied", id="rank0-hash-permission-error"),
    ],
)
def test_a_checksum_failure_on_rank_0_reaches_every_rank(error, fragment, tmp_path, good_set):
    """No rank is left waiting for rank 0's verdict: all raise the same one-line error."""
    from megatron_lev.testing.distributed import run_distributed

    prefix = copy_set(good_set, tmp_path / "set")
    got = run_distributed(
        _verify_with_hashing_failing_on_rank_0, 2, args=(f"{prefix}_00000", error), timeout=90
    )
    assert got[0] == got[1] and fragment in got[0] and "rank 0" in got[0], got
    assert "set_00000" in got[0] or "set.counts.npy" in got[0] or "set.stats.json" in got[0], got


def test_training_refuses_shards_of_another_tokenizer(tmp_path, good_set, neox):
    """The dataset builder `train` uses checks the tokenizer before any sample is drawn."""
    from megatron_lev.config import DataConfig
    from megatron_lev.data.gpt_dataset import build_train_valid_test_datasets

    prefix = copy_set(good_set, tmp_path / "set")
    _other_hf_tokenizer(tmp_path, neox)
    cfg = DataConfig(
        data_path=[f"{prefix}_00000"],
        tokenizer_path=str(tmp_path / "other.json"),
        cache_dir=str(tmp_path / "cache"),
    )
    with pytest.raises(ShardSetError, match="another tokenizer"):
        build_train_valid_test_datasets(cfg, 16, (8, 0, 0))
    with pytest.raises(ShardSetError, match="vocabulary has only 10 ids"):
        build_train_valid_test_datasets(
            DataConfig(data_path=[f"{prefix}_00000"], cache_dir=str(tmp_path)), 16, (8, 0, 0), vocab_size=10
        )


# -------------------------------------------------------------------------- MMIDIDX structure (legacy shards)


def spec_pair(
    prefix: Path,
    seqs=((1, 2, 3), (4, 5), (6,)),
    dtype=np.uint16,
    code=8,
    version=1,
    magic=b"MMIDIDX\0\0",
    sizes=None,
    pointers=None,
    doc_idx=None,
    n_doc=None,
    bin_cut=0,
):
    """A .bin/.idx pair written from the spec, with any field overridden."""
    sizes = list(map(len, seqs)) if sizes is None else sizes
    item = np.dtype(dtype).itemsize
    if pointers is None:
        pointers = [0] + list(np.cumsum([len(s) for s in seqs])[:-1] * item)
    doc_idx = list(range(len(seqs) + 1)) if doc_idx is None else doc_idx
    data = b"".join(np.asarray(s, dtype).tobytes() for s in seqs)
    Path(f"{prefix}.bin").write_bytes(data[: len(data) - bin_cut])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(
            magic + struct.pack("<QBQQ", version, code, len(sizes), len(doc_idx) if n_doc is None else n_doc)
        )
        f.write(np.asarray(sizes, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes())
        f.write(np.asarray(doc_idx, "<i8").tobytes())


IDX_REFUSALS = [
    pytest.param({"magic": b"NOTMMIDX\0"}, [r"legacy\.idx", "not an MMIDIDX"], id="idx-wrong-magic"),
    pytest.param({"version": 2}, [r"legacy\.idx", "unsupported version 2"], id="idx-wrong-version"),
    pytest.param({"code": 42}, [r"legacy\.idx", "unknown dtype code 42"], id="idx-unknown-dtype"),
    pytest.param({"code": 4}, [r"legacy\.idx", "disagree"], id="idx-dtype-code-wrong"),
    pytest.param({"n_doc": 9}, [r"legacy\.idx", "does not match its header"], id="idx-doc-count-disagrees"),
    pytest.param(
        {"sizes": [2, 3, 1]},
        [r"legacy\.idx", "sequence 1 points to byte 6", "disagree"],
        id="idx-sizes-shifted",
    ),
    pytest.param(
        {"pointers": [0, 6, 4000]}, [r"legacy\.idx", "sequence 2", "disagree"], id="idx-pointer-past-the-end"
    ),
    pytest.param({"sizes": [3, -2, 1]}, [r"legacy\.idx", "negative size"], id="idx-negative-size"),
    pytest.param(
        {"doc_idx": [0, 1, 2]},
        [r"legacy\.idx", "document index must run from 0 to 3"],
        id="idx-doc-index-short",
    ),
    pytest.param({"doc_idx": [0, 2, 1, 3]}, [r"legacy\.idx", "not in order"], id="idx-doc-index-unordered"),
    pytest.param({"bin_cut": 2}, [r"legacy\.bin", "truncated or mismatched"], id="bin-truncated"),
]


@pytest.mark.parametrize("fields, fragments", IDX_REFUSALS)
def test_damaged_index_is_refused_by_name(fields, fragments, tmp_path, neox, capsys):
    prefix = tmp_path / "legacy"
    spec_pair(prefix, **fields)
    expect_error(
        run_cli(["preprocess", "--write-manifest-for", prefix, "--tokenizer", neox], capsys), *fragments
    )
    assert not Path(f"{prefix}.manifest.json").exists()
    with pytest.raises(Exception, match=fragments[0]):  # the reader itself refuses too
        IndexedDataset(prefix)


def test_write_manifest_for_legacy_shards_then_use_them(tmp_path, good_set, neox, capsys):
    legacy = tmp_path / "legacy"
    for ext in (".bin", ".idx"):
        shutil.copyfile(f"{good_set}_00000{ext}", f"{legacy}{ext}")
    expect_error(run_cli(build_indices_argv(legacy, tmp_path), capsys), "--write-manifest-for")
    out = run_cli(["preprocess", "--write-manifest-for", legacy, "--tokenizer", neox], capsys)
    expect_ok(out)
    assert "checked 1 shard" in out.out
    expect_ok(run_cli(build_indices_argv(legacy, tmp_path, f"data.tokenizer_path={neox}"), capsys))


@pytest.mark.parametrize(
    "make, fragments",
    [
        pytest.param(
            lambda t: spec_pair(t / "legacy", seqs=((1, 2), (3, 60000))) or t / "legacy",
            [r"legacy", "token id 60000", "50277 ids"],
            id="legacy-ids-beyond-tokenizer",
        ),
        pytest.param(lambda t: t / "legacy", [r"legacy", r"no legacy\.bin"], id="legacy-prefix-missing"),
    ],
)
def test_write_manifest_for_refuses(make, fragments, tmp_path, neox, capsys):
    prefix = make(tmp_path)
    expect_error(
        run_cli(["preprocess", "--write-manifest-for", prefix, "--tokenizer", neox], capsys), *fragments
    )
    assert not Path(f"{prefix}.manifest.json").exists()


# --------------------------------------------------------------------------- the index cache


def _flip_npy(path: Path):
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8
    path.write_bytes(bytes(data))


def _cut_npy(path: Path):
    path.write_bytes(path.read_bytes()[:-12])


def _garble_npy(path: Path):
    path.write_bytes(b"garbage")


@pytest.mark.parametrize(
    "target, damage",
    [
        pytest.param("shuffle_idx", _flip_npy, id="cache-bytes-changed"),
        pytest.param("sample_idx", _cut_npy, id="cache-truncated"),
        pytest.param("doc_idx", _garble_npy, id="cache-not-npy"),
        pytest.param("doc_idx", Path.unlink, id="cache-file-missing"),
        pytest.param("description", _garble_npy, id="cache-description-garbled"),
    ],
)
def test_damaged_index_cache_is_rebuilt_with_a_message(target, damage, tmp_path, good_set, capsys, caplog):
    prefix = copy_set(good_set, tmp_path / "set")
    argv = build_indices_argv(f"{prefix}_00000", tmp_path)
    expect_ok(run_cli(argv, capsys))
    cache = tmp_path / "cache"
    before = snapshot(cache)
    victim = next(
        p
        for p in cache.iterdir()
        if p.name.endswith(f"_{target}.npy")
        or (target == "description" and p.name.endswith("_description.json"))
    )
    damage(victim)
    with caplog.at_level("WARNING"):
        expect_ok(run_cli(argv, capsys))
    assert any(victim.name in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    assert snapshot(cache) == before  # rebuilt to the same arrays
    assert leftovers(cache) == []


@pytest.mark.parametrize(
    "extra, fragments",
    [
        pytest.param(["--world-size", "0"], ["--world-size", ">= 1"], id="build-indices-world-size-zero"),
        pytest.param(
            ["--num-samples", "-1", "0", "0"],
            ["--num-samples", "non-negative"],
            id="build-indices-negative-samples",
        ),
    ],
)
def test_build_indices_refuses_bad_flags(extra, fragments, tmp_path, good_set, capsys):
    argv = build_indices_argv(f"{good_set}_00000", tmp_path)[:-4] + extra
    expect_error(run_cli(argv, capsys), *fragments, rc=2)
    assert not (tmp_path / "cache").exists()
