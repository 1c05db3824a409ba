"""The data subcommands end to end through the `megatron-lev` CLI."""

from __future__ import annotations

import json

from megatron_lev.cli import main
from megatron_lev.data.indexed import IndexedDataset


def test_preprocess_then_build_indices(tmp_path, pile_jsonl, pile_shard, neox_path, capsys):
    prefix = tmp_path / "cli"
    rc = main(
        [
            "preprocess",
            "--input",
            str(pile_jsonl),
            "--output-prefix",
            str(prefix),
            "--tokenizer",
            neox_path,
            "--workers",
            "1",
            "--no-progress",
        ]
    )
    assert rc == 0 and "300 documents" in capsys.readouterr().out
    assert (tmp_path / "cli.bin").read_bytes() == open(f"{pile_shard}.bin", "rb").read()
    assert json.loads((tmp_path / "cli.stats.json").read_text())["documents"] == 300
    rc = main(
        [
            "build-indices",
            f"data.data_path=[{prefix}]",
            f"data.cache_dir={tmp_path / 'cache'}",
            "model.seq_length=32",
            "train.train_iters=10",
            "train.micro_batch_size=2",
            "train.eval_interval=5",
            "train.eval_iters=2",
            "logging.output_dir=" + str(tmp_path / "run"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "train: 20 samples" in out and "valid: 12 samples" in out
    assert "test: empty" in out  # 969,30,1 of 300 documents leaves none for test
    assert len(list((tmp_path / "cache").glob("*description.json"))) == 2


def test_train_tokenizer_and_sample_corpus(tmp_path, capsys):
    assert (
        main(
            [
                "sample-corpus",
                "--output-dir",
                str(tmp_path / "corpus"),
                "--max-mb",
                "0.3",
                "--sources",
                "Github",
                "Python_docs",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train-tokenizer",
                "--input",
                str(tmp_path / "corpus"),
                "--model-prefix",
                str(tmp_path / "tok"),
                "--vocab-size",
                "400",
                "--max-mb",
                "0.3",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert "vocabulary 400" in capsys.readouterr().out
    prefix = tmp_path / "corpus_sp"
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "corpus"),
                "--output-prefix",
                str(prefix),
                "--tokenizer-type",
                "sentencepiece",
                "--tokenizer",
                str(tmp_path / "tok.model"),
                "--split-by-subset",
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    ds = IndexedDataset(f"{prefix}_Github")
    assert len(ds) > 0 and int(ds[0][-1]) == 1  # the SentencePiece EOD closes each document
