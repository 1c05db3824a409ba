"""Provenance across commands: a checkpoint records the shard sets (their content digests), the
blend and the tokenizer it was trained on (`provenance.json`), and resume, `convert`, `evaluate`
and `reshard` compare against it; `evaluate --data` verifies shard manifests as `train` does.

One real tiny training (checkpoints at iterations 2 and 4) on a shard set and a tokenizer file
of this module is shared; each case copies the run, changes the data or the tokenizer in place
(as a user re-running `preprocess` or replacing a file would), runs one command, and checks its
exit status, its one-line message and what it left on disk. The data and tokenizer are restored
after every case.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import zstandard

from megatron_lev.ckpt import layout as ck
from megatron_lev.ckpt.provenance import PROVENANCE_FILE, manifest_digest
from megatron_lev.utils.io import sha256_file
from tests.reliability.harness import (
    ROOT,
    Outcome,
    expect_error,
    expect_ok,
    run_cli,
    run_cli_process,
    tiny_run_overrides,
)

pytestmark = pytest.mark.timeout(900)

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATRON_LEV_DEBUG")
IT4, IT6 = ck.tag_for(4), ck.tag_for(6)


# ------------------------------------------------------------------ shared inputs


@pytest.fixture(scope="module", autouse=True)
def checksum_cache(tmp_path_factory):
    old = os.environ.get("MEGATRON_LEV_CACHE_DIR")
    os.environ["MEGATRON_LEV_CACHE_DIR"] = str(tmp_path_factory.mktemp("sha-cache"))
    yield
    if old is None:
        os.environ.pop("MEGATRON_LEV_CACHE_DIR", None)
    else:
        os.environ["MEGATRON_LEV_CACHE_DIR"] = old


def _jsonl(shared_data: Path, subset: str, path: Path, n: int = 300) -> Path:
    lines = []
    with open(shared_data / "minipile" / f"{subset}.jsonl.zst", "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            lines.append(line)
            if len(lines) == n:
                break
    path.write_text("".join(lines))
    return path


def preprocess_into(prefix: Path, corpus: Path, tokenizer: Path, workers: int = 1) -> None:
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    preprocess(
        PreprocessOptions([str(corpus)], str(prefix), "hf", str(tokenizer), workers=workers, progress=False)
    )


@dataclass
class World:
    work: Path
    prefix: Path  # the run's shard set
    tokenizer: Path  # the run's tokenizer file
    wiki: Path  # the corpus the run was trained on
    fortunes: Path  # another corpus
    trained: Path  # the finished run's output directory (ckpt/ inside)
    pristine: Path  # copies of the data directory and the tokenizer, to restore after each case


def overrides(w: World, out: Path, **extra) -> list[str]:
    return tiny_run_overrides(w.prefix, w.tokenizer, w.work / "cache", out, **extra)


def train(argv: list, timeout: float = 300) -> Outcome:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(ENV)
    return run_cli_process(["train", "--config", TINY, *argv], timeout=timeout, env=env)


@pytest.fixture(scope="module")
def world(tmp_path_factory, shared_data) -> World:
    work = tmp_path_factory.mktemp("provenance")
    (work / "data").mkdir()
    tokenizer = work / "tok" / "run_tok.json"
    tokenizer.parent.mkdir()
    shutil.copyfile(shared_data / "tokenizers" / "gpt-neox-20b.json", tokenizer)
    wiki = _jsonl(shared_data, "Wikipedia_en", work / "wiki.jsonl")
    fortunes = _jsonl(shared_data, "Fortunes", work / "fortunes.jsonl")
    prefix = work / "data" / "corpus_text_document"
    preprocess_into(prefix, wiki, tokenizer)
    pristine = work / "pristine"
    shutil.copytree(work / "data", pristine / "data")
    shutil.copy2(tokenizer, pristine / "run_tok.json")
    w = World(work, prefix, tokenizer, wiki, fortunes, work / "run", pristine)
    expect_ok(train(overrides(w, w.trained)))
    assert (w.trained / "ckpt" / "latest").read_text().strip() == IT4
    return w


@dataclass
class Ctx:
    w: World
    tmp: Path
    run: Path  # a private copy of the trained run

    @property
    def ckpt(self) -> Path:
        return self.run / "ckpt"

    def resume(self, *extra) -> list:
        """argv of `train` resuming this copy up to iteration 6."""
        return ["train", *overrides(self.w, self.run, **{"train.train_iters": 6}), *extra]

    def preprocess_other(self) -> None:
        """`preprocess` again into the run's prefix, from another corpus."""
        preprocess_into(self.w.prefix, self.w.fortunes, self.w.tokenizer)

    def replace_tokenizer(self) -> None:
        """The file at the run's tokenizer path replaced by one with the ids of " the" and " and"
        swapped: the same size and EOD, other ids for common words (and for the probe text)."""
        data = json.loads(self.w.tokenizer.read_text())
        vocab = data["model"]["vocab"]
        vocab["\u0120the"], vocab["\u0120and"] = vocab["\u0120and"], vocab["\u0120the"]
        self.w.tokenizer.write_text(json.dumps(data))

    def heldout_copy(self) -> Path:
        """A copy of the run's shard set under another name (manifest included)."""
        d = self.tmp / "heldout"
        d.mkdir(exist_ok=True)
        src = self.w.prefix
        for p in src.parent.glob(f"{src.name}.*"):
            shutil.copyfile(p, d / p.name.replace(src.name, "heldout"))
        manifest = json.loads((d / "heldout.manifest.json").read_text())
        manifest["prefix"] = "heldout"
        manifest["shards"] = ["heldout"]
        manifest["files"] = {k.replace(src.name, "heldout"): v for k, v in manifest["files"].items()}
        (d / "heldout.manifest.json").write_text(json.dumps(manifest))
        return d / "heldout"

    def evaluate(self, *extra) -> list:
        return ["evaluate", self.ckpt, "--out", self.tmp / "ev", "--threads", "1", "--seq-len", "8", *extra]


@pytest.fixture
def ctx(world, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(world.trained, run)
    yield Ctx(world, tmp_path, run)
    shutil.rmtree(world.work / "data")
    shutil.copytree(world.pristine / "data", world.work / "data")  # copy2: the original mtimes
    shutil.copy2(world.pristine / "run_tok.json", world.tokenizer)


def record_of(tag_dir: Path) -> dict:
    return json.loads((tag_dir / PROVENANCE_FILE).read_text())


def set_digest(prefix: Path) -> str:
    return manifest_digest(json.loads(Path(f"{prefix}.manifest.json").read_text()))


# ------------------------------------------------------------------ the table


@dataclass
class Case:
    setup: Callable[[Ctx], list]  # changes the world, returns argv
    fragments: tuple[str, ...] | None  # regexes of the error line; None: the command must succeed
    check: Callable[[Ctx, Outcome], None] | None = None
    rc: int | None = 1


def unchanged_checkpoint(c: Ctx, res: Outcome) -> None:
    assert ck.read_latest(c.ckpt)[0] == IT4 and not (c.ckpt / IT6).exists(), "the refused resume saved"
    assert not (c.tmp / "out").exists() and not (c.tmp / "ev").exists()


def other_corpus(c: Ctx) -> list:
    c.preprocess_other()
    return c.resume()


def other_corpus_allowed(c: Ctx) -> list:
    c.preprocess_other()
    return c.resume("--allow-change", "data")


def records_new_data(c: Ctx, res: Outcome) -> None:
    new, old = record_of(c.ckpt / IT6)["data"]["train"][0], record_of(c.ckpt / IT4)["data"]["train"][0]
    assert new["digest"] == set_digest(c.w.prefix) != old["digest"]
    assert "allowed by --allow-change" in res.err


def same_corpus_again(c: Ctx) -> list:
    preprocess_into(c.w.prefix, c.w.wiki, c.w.tokenizer, workers=2)  # new files, timings and stats
    return c.resume()


def records_same_data(c: Ctx, res: Outcome) -> None:
    assert record_of(c.ckpt / IT6)["data"] == record_of(c.ckpt / IT4)["data"]


def tokenizer_replaced(then: Callable[[Ctx], list]) -> Callable[[Ctx], list]:
    def setup(c: Ctx) -> list:
        c.replace_tokenizer()
        return then(c)

    return setup


def without_record(c: Ctx) -> list:
    """Checkpoints as an older version saved them: no provenance.json (the marker re-sealed)."""
    for tag in (ck.tag_for(2), IT4):
        (c.ckpt / tag / PROVENANCE_FILE).unlink(missing_ok=True)
        marker = c.ckpt / tag / ck.COMPLETE_MARKER
        data = json.loads(marker.read_text())
        data["files"].pop(PROVENANCE_FILE, None)
        marker.write_text(json.dumps(data))
    return c.resume()


def warned_once_and_recorded(c: Ctx, res: Outcome) -> None:
    assert res.err.count(f"records no {PROVENANCE_FILE}") == 1, res.err[-3000:]
    assert record_of(c.ckpt / IT6)["data"]["train"][0]["digest"] == set_digest(c.w.prefix)


def exported_with_new_tokenizer(c: Ctx, res: Outcome) -> None:
    assert sha256_file(c.tmp / "out" / "tokenizer.json") == sha256_file(c.w.tokenizer)
    assert "--allow-tokenizer-change" in res.err


def overwrite_tokens(c: Ctx) -> list:
    prefix = c.heldout_copy()
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
    tokens[100:200] = 7  # same size: only the checksum can tell
    tokens.tofile(f"{prefix}.bin")
    return c.evaluate("--data", prefix, "--max-docs", "3")


def no_manifest(c: Ctx) -> list:
    prefix = c.heldout_copy()
    Path(f"{prefix}.manifest.json").unlink()
    return c.evaluate("--data", prefix, "--max-docs", "3")


def evaluated(c: Ctx, res: Outcome) -> None:
    result = json.loads((c.tmp / "ev" / "eval.json").read_text())["results"][0]
    assert np.isfinite(result["perplexity"]) and result["tokens"] > 8


def reshard_then_other_corpus(c: Ctx) -> list:
    expect_ok(run_cli_process(["reshard", c.ckpt, c.tmp / "rs", "--tp", "1", "--pp", "1"], timeout=600))
    assert record_of(c.tmp / "rs" / IT4) == record_of(c.ckpt / IT4), "reshard did not carry the record"
    c.preprocess_other()
    return ["train", *overrides(c.w, c.run, **{"train.train_iters": 6, "train.save": c.tmp / "rs"})]


CASES = [
    # resume
    pytest.param(
        Case(
            other_corpus,
            ("cannot resume", "corpus_text_document", "other tokens", "--allow-change data"),
            unchanged_checkpoint,
        ),
        id="preprocess-other-corpus-into-the-prefix-then-resume",
    ),
    pytest.param(
        Case(other_corpus_allowed, None, records_new_data, rc=None),
        id="preprocess-other-corpus-resume-with-allow-change-data",
    ),
    pytest.param(
        Case(same_corpus_again, None, records_same_data, rc=None),
        id="preprocess-same-corpus-again-then-resume",
    ),
    pytest.param(
        Case(
            tokenizer_replaced(Ctx.resume),
            ("cannot resume", "run_tok.json", "changed since", "--allow-change tokenizer"),
            unchanged_checkpoint,
        ),
        id="tokenizer-file-replaced-then-resume",
    ),
    pytest.param(
        Case(without_record, None, warned_once_and_recorded, rc=None),
        id="checkpoint-without-record-warns-once",
    ),
    # convert
    pytest.param(
        Case(
            tokenizer_replaced(lambda c: ["convert", c.ckpt, c.tmp / "out", "--no-progress"]),
            (
                "run_tok.json",
                "not the one the run was trained with",
                "provenance.json",
                "--allow-tokenizer-change",
            ),
            unchanged_checkpoint,
        ),
        id="convert-after-tokenizer-replaced",
    ),
    pytest.param(
        Case(
            tokenizer_replaced(
                lambda c: ["convert", c.ckpt, c.tmp / "out", "--no-progress", "--allow-tokenizer-change"]
            ),
            None,
            exported_with_new_tokenizer,
            rc=None,
        ),
        id="convert-after-tokenizer-replaced-allowed",
    ),
    # evaluate
    pytest.param(
        Case(
            overwrite_tokens,
            ("heldout.bin", "sha256", "heldout.manifest.json", "damaged"),
            unchanged_checkpoint,
        ),
        id="evaluate-data-tokens-overwritten-same-size",
    ),
    pytest.param(
        Case(
            no_manifest, ("heldout", "no heldout.manifest.json", "--write-manifest-for"), unchanged_checkpoint
        ),
        id="evaluate-data-without-manifest",
    ),
    pytest.param(
        Case(
            tokenizer_replaced(
                lambda c: c.evaluate("--text", c.w.wiki, "--tokenizer", c.w.tokenizer, "--max-docs", "2")
            ),
            ("run_tok.json", "not the model's tokenizer", "provenance.json"),
            unchanged_checkpoint,
        ),
        id="evaluate-checkpoint-text-with-replaced-tokenizer",
    ),
    pytest.param(
        Case(
            tokenizer_replaced(lambda c: c.evaluate("--data", c.heldout_copy(), "--max-docs", "3")),
            None,
            evaluated,
            rc=None,
        ),
        id="evaluate-checkpoint-data-after-tokenizer-replaced",
    ),
    # reshard
    pytest.param(
        Case(
            reshard_then_other_corpus,
            ("cannot resume", "rs/iter_0000004", "other tokens", "--allow-change data"),
        ),
        id="reshard-carries-record-then-resume-on-other-corpus",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_provenance_is_compared_across_commands(case: Case, ctx: Ctx, capsys):
    argv = case.setup(ctx)
    if argv[0] == "train":
        res = train(argv[1:])
    else:
        res = run_cli(argv, capsys)
    if case.fragments is None:
        expect_ok(res)
    else:
        expect_error(res, *case.fragments, rc=case.rc)
    if case.check is not None:
        case.check(ctx, res)


def test_the_record_is_covered_by_the_checkpoint_checksums(world):
    """provenance.json is listed in the `complete` marker, so an edited record fails verification."""
    tag = world.trained / "ckpt" / IT4
    record = record_of(tag)
    assert record["tokenizer"]["sha256"] == sha256_file(world.pristine / "run_tok.json")
    assert record["data"]["train"][0]["digest"] == set_digest(
        world.pristine / "data" / "corpus_text_document"
    )
    assert record["data"]["split"] == "98,2,0"
    listed = json.loads((tag / ck.COMPLETE_MARKER).read_text())["files"][PROVENANCE_FILE]
    assert listed["sha256"] == sha256_file(tag / PROVENANCE_FILE)


def _record(valid: bool, split: str) -> dict:
    entry = {"prefix": "data/pile_00_text_document", "digest": "a" * 64, "weight": 1.0}
    val = [{"prefix": "data/pile_val_text_document", "digest": "b" * 64, "weight": 1.0}] if valid else []
    from megatron_lev.ckpt.provenance import FORMAT, VERSION

    return {"format": FORMAT, "version": VERSION, "data": {"train": [entry], "valid": val, "split": split}}


@pytest.mark.parametrize(
    "before, after, split, changed",
    [
        (False, True, "969,30,1", "added"),  # the split's training part -> every document: other losses
        (True, False, "969,30,1", "removed"),
        (False, True, "100,0,0", None),  # the split trained on every document already: the same run
        (True, True, "969,30,1", None),
        (False, False, "969,30,1", None),
    ],
)
def test_adding_a_validation_set_on_a_resume_is_named_when_it_moves_the_training_documents(
    tmp_path, before, after, split, changed
):
    """With `data.valid_data_path`, training reads every document of `data.data_path`; without it,
    `data.split`'s training part. Before, adding one on a resume was accepted as exact (an info line)
    while the losses that followed changed. Now refused like other data, unless --allow-change data."""
    from megatron_lev.ckpt.provenance import data_changes
    from megatron_lev.errors import CheckpointDataError
    from megatron_lev.training.resume_checks import check_resume_provenance

    changes = data_changes(_record(before, split), _record(after, split))
    if changed is None:
        assert changes == []
        return
    assert len(changes) == 1 and f"a validation set was {changed} (data.valid_data_path)" in changes[0]
    tag = tmp_path / "iter_0000004"
    tag.mkdir()
    (tag / PROVENANCE_FILE).write_text(json.dumps(_record(before, split)))
    current = _record(after, split)
    current["tokenizer"] = None
    with pytest.raises(CheckpointDataError, match="--allow-change data"):
        check_resume_provenance(tag, None, (), current)
    check_resume_provenance(tag, None, ("data",), current)
