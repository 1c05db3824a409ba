"""The sample corpus: Pile format, deterministic, capped, degrading when a source is missing."""

from __future__ import annotations

import io
import json

import zstandard

from megatron_lev.data import sample_corpus as sc


def _records(path):
    with open(path, "rb") as f:
        return [json.loads(line) for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f))]


def test_pile_format_deterministic_and_capped(tmp_path, monkeypatch):
    monkeypatch.setitem(sc.SOURCES, "Dictionaries", lambda: sc.dictionary_docs(str(tmp_path / "no-dict")))
    names = ["Github", "Python_docs", "Dictionaries"]
    a = sc.build_sample_corpus(tmp_path / "a", max_mb=0.4, sources=names, progress=False)
    b = sc.build_sample_corpus(tmp_path / "b", max_mb=0.4, sources=names, progress=False)
    assert a == b and a["unavailable"] == ["Dictionaries"]
    assert sorted(a["subsets"]) == ["Github", "Python_docs"]
    for name in a["subsets"]:
        assert (tmp_path / "a" / f"{name}.jsonl.zst").read_bytes() == (
            tmp_path / "b" / f"{name}.jsonl.zst"
        ).read_bytes()
        recs = _records(tmp_path / "a" / f"{name}.jsonl.zst")
        assert len(recs) == a["subsets"][name]["documents"]
        assert all(
            r["meta"] == {"pile_set_name": name} and len(r["text"].strip()) >= sc.MIN_CHARS for r in recs
        )
    total = sum(
        len(r["text"].encode()) for n in a["subsets"] for r in _records(tmp_path / "a" / f"{n}.jsonl.zst")
    )
    assert total == a["bytes"] >= 0.4e6 and total < 0.4e6 + 400_000  # stops right after crossing the cap
    assert json.loads((tmp_path / "a" / "manifest.json").read_text()) == a


def test_troff_is_stripped():
    page = '.\\" comment\n.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\n.IX Header x\n.B \\-l\n'
    assert sc._strip_troff(page) == "LS 1\nNAME\nls - list directory contents\n-l"
