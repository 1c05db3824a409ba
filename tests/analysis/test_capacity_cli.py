"""`megatron-lev capacity` on .npy, .safetensors and a Hugging Face directory (input table and head)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from megatron_lev.analysis import capacity_report, cosine_stats, write_report
from megatron_lev.analysis.loaders import load_matrices
from megatron_lev.cli import main as cli
from megatron_lev.errors import DataError


def test_hf_directory_reports_input_and_output_separately(tiny_llama, tmp_path, capsys):
    hf_dir = tiny_llama
    assert cli(["capacity", str(hf_dir), "--out", str(tmp_path), "--block", "40", "--sample", "120"]) == 0
    printed = capsys.readouterr().out
    assert "Caveats" in printed and "four-constant" in printed
    reports = json.loads((tmp_path / "capacity.json").read_text())["reports"]
    assert [r["name"].split(":")[1].split(" ")[0] for r in reports] == ["input", "output"]
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as fh:
        emb, head = fh.get_tensor("model.embed_tokens.weight"), fh.get_tensor("lm_head.weight")
    assert reports[0]["eps"] == pytest.approx(cosine_stats(emb, sample=120).eps, abs=1e-7)
    assert reports[1]["eps"] == pytest.approx(cosine_stats(head, sample=120).eps, abs=1e-7)
    assert reports[0]["eps"] != reports[1]["eps"] and reports[0]["pairs"] == 120 * 119 // 2
    assert len(reports[0]["capacity"]) == 4 and reports[0]["class"] == "high-eps"
    assert len(list(tmp_path.glob("cosine_hist_*.png"))) == 2
    assert "fitted (4 const, paper table)" in (tmp_path / "capacity.md").read_text()


def test_npy_safetensors_and_tensor_flag(tmp_path):
    rng = np.random.default_rng(1)
    m = rng.normal(size=(50, 64)).astype(np.float32)
    np.save(tmp_path / "e.npy", m)
    save_file(
        {"my.table": torch.from_numpy(m), "transformer.wte.weight": torch.from_numpy(m[:30])},
        str(tmp_path / "w.safetensors"),
    )
    ((npy_name, npy),) = load_matrices(tmp_path / "e.npy").items()
    assert npy_name == "e.npy" and npy.shape == (50, 64)
    found = load_matrices(tmp_path / "w.safetensors")
    assert list(found) == ["w.safetensors:input (transformer.wte.weight)"]
    ((name, t),) = load_matrices(tmp_path / "w.safetensors", tensor="my.table").items()
    assert name.endswith(":my.table") and torch.equal(t, torch.from_numpy(m))
    with pytest.raises(DataError, match="no tensor named .nope."):
        load_matrices(tmp_path / "w.safetensors", tensor="nope")
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        load_matrices(tmp_path / "missing.npy")


def test_library_entry_points(tmp_path):
    m = torch.randn(40, 1024)  # random: eps ~ 2/sqrt(d), low-eps
    r = capacity_report(m, "LEV materialised", sample=30)
    assert r["sampled_rows"] == 30 and r["class"] == "low-eps" and r["capacity_meaningful"]
    paths = write_report([r], tmp_path / "out")
    assert paths["LEV materialised"].name == "cosine_hist_LEV_materialised.png"
    assert json.loads(paths["json"].read_text())["reports"][0]["eps"] == pytest.approx(r["eps"])


def test_formula_only_mode(capsys):
    assert cli(["capacity", "--formula", "4096", "0.0645"]) == 0
    out = capsys.readouterr().out
    assert "3.99e+07" in out and "2.16e+09" in out and "low-eps" in out


def test_cli_default_is_exact_gram_eps_with_a_seeded_histogram_sample(tmp_path, monkeypatch, capsys):
    """By default no pass visits all pairs: eps from the Gram matrix, the histogram from --hist-rows rows."""
    import megatron_lev.analysis.cosine as cosine

    visited = []
    pair_pass = cosine._accumulate
    monkeypatch.setattr(cosine, "_accumulate", lambda x, *a: visited.append(x.shape[0]) or pair_pass(x, *a))
    rng = np.random.default_rng(2)
    m = rng.normal(size=(300, 32)) + 0.4 * rng.normal(size=(1, 32))
    np.save(tmp_path / "e.npy", m.astype(np.float32))
    args = ["capacity", str(tmp_path / "e.npy"), "--threads", "1", "--hist-rows", "50"]
    assert cli([*args, "--out", str(tmp_path / "a")]) == 0
    assert visited == [50]
    r = json.loads((tmp_path / "a" / "capacity.json").read_text())["reports"][0]
    assert r["eps_method"] == "gram" and r["exact"] and r["pairs"] == 300 * 299 // 2
    assert (r["hist_mode"], r["hist_rows"], r["hist_seed"], r["hist_pairs"]) == (
        "sample",
        50,
        0,
        50 * 49 // 2,
    )
    assert r["eps"] == pytest.approx(
        cosine.gram_moments(m.astype(np.float32))[0] + 2 * cosine.gram_moments(m.astype(np.float32))[1],
        abs=1e-12,
    )
    md = (tmp_path / "a" / "capacity.md").read_text()
    assert "Gram identity" in md and "sample of 50 rows (seed 0)" in md
    assert cli([*args, "--out", str(tmp_path / "b")]) == 0  # same seed: same histogram
    again = json.loads((tmp_path / "b" / "capacity.json").read_text())["reports"][0]
    assert again["histogram"]["counts"] == r["histogram"]["counts"]
    assert cli([*args, "--seed", "1", "--out", str(tmp_path / "c")]) == 0
    other = json.loads((tmp_path / "c" / "capacity.json").read_text())["reports"][0]
    assert other["eps"] == r["eps"] and other["histogram"]["counts"] != r["histogram"]["counts"]
    visited.clear()
    assert cli([*args, "--histogram", "off", "--out", str(tmp_path / "d")]) == 0
    assert visited == [] and not list((tmp_path / "d").glob("*.png"))
    assert cli([*args, "--histogram", "full", "--out", str(tmp_path / "e")]) == 0
    full = json.loads((tmp_path / "e" / "capacity.json").read_text())["reports"][0]
    assert visited == [300] and full["hist_pairs"] == full["pairs"] and full["eps"] == r["eps"]
    assert full["eps_pairs"] == pytest.approx(r["eps"], abs=1e-6)
    capsys.readouterr()
