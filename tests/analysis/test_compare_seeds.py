"""`megatron-lev compare` over several seeds: mean, sd, the seed-paired t interval and the document
bootstrap checked against hand computation on synthetic results with known per-document losses,
the gain decomposition's arithmetic, and error bars in the plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_lev.analysis.compare import compare_markdown, compare_results, mean_sd, t_interval
from megatron_lev.analysis.corpora import sequence_batches
from megatron_lev.analysis.perplexity import (
    RecordLengths,
    TokenLosses,
    evaluation_result,
    per_document_sums,
)
from megatron_lev.cli import main as cli
from tests.analysis.synthetic import synthetic_result

LABELS = ["< 1e-07", ">= 1e-07"]
T_975_2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom
T_975_1 = 12.706204736174707


def _docs(n_docs: int = 40, seed: int = 0):
    """Per document and bucket: predicted tokens (n_docs, 2) and the baseline's NLL sums."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 30, size=(n_docs, 2)).astype(float)
    nll = tokens * rng.uniform(2.0, 6.0, size=(n_docs, 2))
    return tokens, nll


def _result(name: str, tokens: np.ndarray, nll: np.ndarray) -> dict:
    """An evaluate result whose perplexities follow from its per-document sums."""
    return synthetic_result(tokens, nll, LABELS, name=name, corpus="heldout")


def _scaled(name: str, tokens: np.ndarray, nll: np.ndarray, factor: float) -> dict:
    """A model whose perplexity is `factor` x the baseline's in every document (and so every bucket)."""
    return _result(name, tokens, nll + tokens * math.log(factor))


def _write(path, result: dict):
    path.write_text(json.dumps({"name": result["name"], "results": [result]}))
    return str(path)


def test_mean_sd_and_seed_paired_t_interval_by_hand():
    tokens, nll = _docs()
    factors = [0.90, 0.92, 0.88]  # -10, -8, -12 %
    seeds = [nll + 0.01 * i * tokens for i in range(3)]  # the baseline differs a little per seed
    tied = [_result("TIED", tokens, s) for s in seeds]
    lev = [_scaled("LEV", tokens, s, f) for s, f in zip(seeds, factors)]
    cmp = compare_results({"TIED": tied, "LEV": lev}, bootstrap=0)
    row = {r["name"]: r for r in cmp["rows"]}["LEV"]
    ch = row["rel_change"]
    assert ch["per_seed"] == pytest.approx([-10.0, -8.0, -12.0])
    assert ch["mean"] == pytest.approx(-10.0) and row["rel_change_pct"] == pytest.approx(-10.0)
    assert ch["sd"] == pytest.approx(2.0)  # sqrt((0 + 4 + 4) / 2)
    half = T_975_2 * 2.0 / math.sqrt(3)
    assert ch["seed_interval"] == pytest.approx([-10.0 - half, -10.0 + half])
    for b in row["buckets"]:  # the same factor in every document: every bucket changes alike
        assert b["rel_change"]["per_seed"] == pytest.approx([-10.0, -8.0, -12.0])
        assert b["rel_change"]["seed_interval"] == pytest.approx([-10.0 - half, -10.0 + half])
    assert row["perplexity"] == pytest.approx(np.mean([r["perplexity"] for r in lev]))
    assert row["perplexity_sd"] == pytest.approx(np.std([r["perplexity"] for r in lev], ddof=1))
    assert cmp["bootstrap"]["skipped"] == "--bootstrap 0" and ch["bootstrap_interval"] is None
    # helpers on their own
    assert mean_sd([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert t_interval([1.0, 3.0]) == pytest.approx([2 - T_975_1 * 1.0, 2 + T_975_1 * 1.0])
    assert t_interval([5.0]) is None and mean_sd([5.0]) == (5.0, None)


def test_one_seed_has_no_seed_interval_and_says_so():
    tokens, nll = _docs()
    cmp = compare_results(
        {"TIED": _result("TIED", tokens, nll), "LEV": _scaled("LEV", tokens, nll, 0.95)}, bootstrap=0
    )
    ch = {r["name"]: r for r in cmp["rows"]}["LEV"]["rel_change"]
    assert ch["mean"] == pytest.approx(-5.0) and ch["sd"] is None and ch["seed_interval"] is None
    assert "at least 2" in ch["seed_interval_note"]
    md = compare_markdown(cmp)
    assert "| LEV | all | -5.00% (1 seed) | - (1 seed) | - (not run) |" in md
    first = cmp["bucket_labels"][0]  # a bucket's change says over how many target tokens it was taken
    count = int(tokens[:, 0].sum())
    assert count > 1 and f"| LEV | {first} ({count:,} tokens) | -5.00% (1 seed) |" in md
    assert "Seed-paired intervals need at least 2 seeds" in md


def test_document_bootstrap_is_reproducible_and_contains_the_estimate():
    tokens, nll = _docs(60)
    rng = np.random.default_rng(1)
    tied, lev = [], []
    for _ in range(2):
        base = nll * rng.uniform(0.95, 1.05, size=nll.shape)
        tied.append(_result("TIED", tokens, base))
        lev.append(_result("LEV", tokens, base * rng.uniform(0.9, 1.02, size=nll.shape)))  # per-doc noise
    runs = {"TIED": tied, "LEV": lev}
    a = compare_results(runs, bootstrap=300, bootstrap_seed=7)
    b = compare_results(runs, bootstrap=300, bootstrap_seed=7)
    c = compare_results(runs, bootstrap=300, bootstrap_seed=8)
    row = lambda cmp: {r["name"]: r for r in cmp["rows"]}["LEV"]  # noqa: E731
    ci = row(a)["rel_change"]["bootstrap_interval"]
    assert ci == row(b)["rel_change"]["bootstrap_interval"]  # same seed, same interval
    assert ci != row(c)["rel_change"]["bootstrap_interval"]
    assert ci[0] < row(a)["rel_change"]["mean"] < ci[1] and ci[0] < ci[1]
    for bucket in row(a)["buckets"]:
        lo, hi = bucket["rel_change"]["bootstrap_interval"]
        assert lo < bucket["rel_change"]["mean"] < hi
    # the point estimate from the per-document sums equals the one from the perplexities
    full = [
        (
            math.exp(np.sum(v["per_document"]["nll_sum"]) / np.sum(v["per_document"]["tokens"]))
            / t["perplexity"]
            - 1
        )
        * 100
        for v, t in zip(lev, tied)
    ]
    assert row(a)["rel_change"]["mean"] == pytest.approx(np.mean(full))
    assert a["bootstrap"] == {
        "resamples": 300,
        "seed": 7,
        "unit": "document",
        "units": 60,
        "group": 1,
        "skipped": None,
    }
    # a constant factor in every document leaves no document variance: the interval is the point
    const = compare_results(
        {"TIED": _result("TIED", tokens, nll), "LEV": _scaled("LEV", tokens, nll, 0.9)}, bootstrap=50
    )
    assert {r["name"]: r for r in const["rows"]}["LEV"]["rel_change"]["bootstrap_interval"] == pytest.approx(
        [-10.0, -10.0]
    )


def test_bootstrap_refuses_results_on_other_documents():
    tokens, nll = _docs(20)
    other_tokens, other_nll = _docs(21, seed=3)
    runs = {"TIED": _result("TIED", tokens, nll), "LEV": _result("LEV", other_tokens, other_nll)}
    with pytest.raises(ValueError, match="LEV seed 1: its per-document token counts differ"):
        compare_results(runs, bootstrap=10, require_bootstrap=True)
    skipped = compare_results(runs, bootstrap=10)  # by default: skipped with the reason
    assert "differ" in skipped["bootstrap"]["skipped"]


def test_gain_decomposition_arithmetic():
    tokens, nll = _docs()
    # perplexity factors against TIED, per seed
    factors = {
        "TIED": [1.0, 1.0],
        "ALBERT": [1.05, 1.04],
        "FLAT-MLP": [1.03, 1.03],
        "FACT-MLP": [1.02, 1.01],
        "LEV": [0.95, 0.96],
    }
    runs = {name: [_scaled(name, tokens, nll, f) for f in fs] for name, fs in factors.items()}
    cmp = compare_results(runs, bootstrap=100)
    dec = cmp["decomposition"]
    chain = [("ALBERT", "FLAT-MLP"), ("FLAT-MLP", "FACT-MLP"), ("FACT-MLP", "LEV")]
    assert [(t["reference"], t["variant"]) for t in dec["terms"]] == chain
    assert [t["term"] for t in dec["terms"]] == [
        "non-linearity",
        "compositional structure",
        "separable spline",
    ]
    assert [t["paper_gain_pct"] for t in dec["terms"]] == [1.13, 0.37, 0.62]
    for term, (ref, var) in zip(dec["terms"], chain):
        per_seed = [(1 - v / r) * 100 for v, r in zip(factors[var], factors[ref])]
        assert term["gain"]["per_seed"] == pytest.approx(per_seed)
        assert term["gain"]["mean"] == pytest.approx(np.mean(per_seed))
        assert term["gain"]["sd"] == pytest.approx(np.std(per_seed, ddof=1))
        half = T_975_1 * np.std(per_seed, ddof=1) / math.sqrt(2)
        assert term["gain"]["seed_interval"] == pytest.approx(
            [np.mean(per_seed) - half, np.mean(per_seed) + half]
        )
        assert term["gain"]["bootstrap_interval"] == pytest.approx([np.mean(per_seed)] * 2)
    total = [(1 - v / r) * 100 for v, r in zip(factors["LEV"], factors["ALBERT"])]
    assert dec["total"]["gain"]["per_seed"] == pytest.approx(total)
    for s in range(2):  # the terms multiply up to the total
        prod = np.prod([1 - t["gain"]["per_seed"][s] / 100 for t in dec["terms"]])
        assert (1 - prod) * 100 == pytest.approx(total[s])
    md = compare_markdown(cmp)
    assert "## Gain decomposition" in md
    assert "| separable spline | LEV vs FACT-MLP |" in md and "spline smoothness +0.62%" in md
    # names as the grid writes them or as config variants both work; without the four runs: none
    lower = {name.lower().replace("-", "_").replace("fact_", "factorized_"): r for name, r in runs.items()}
    assert (
        compare_results(lower, baseline="tied", bootstrap=0)["decomposition"]["terms"][2]["variant"] == "lev"
    )
    assert compare_results({"TIED": runs["TIED"], "LEV": runs["LEV"]}, bootstrap=0)["decomposition"] is None
    with pytest.raises(ValueError, match="missing: ALBERT, FLAT-MLP, FACT-MLP"):
        compare_results({"TIED": runs["TIED"], "LEV": runs["LEV"]}, bootstrap=0, decomposition=True)


def test_cli_seed_syntaxes_outputs_and_error_bars(tmp_path, capsys, monkeypatch):
    import matplotlib.axes

    tokens, nll = _docs()
    paths = {}
    for name, fs in {"TIED": [1.0, 1.01, 0.99], "LEV": [0.9, 0.92, 0.88], "UNTIED": [1.1, 1.0, 1.05]}.items():
        base = [nll + 0.01 * i * tokens for i in range(3)]
        paths[name] = [
            _write(tmp_path / f"{name}_{i}.json", _scaled(name, tokens, b, f))
            for i, (b, f) in enumerate(zip(base, fs))
        ]
    given = {"bar": [], "errorbar": []}
    for method in given:
        original = getattr(matplotlib.axes.Axes, method)

        def spy(self, *args, _original=original, _method=method, **kwargs):
            given[_method].append(kwargs.get("yerr"))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(matplotlib.axes.Axes, method, spy)
    out = tmp_path / "out"
    args = [
        "compare",
        "TIED=" + ",".join(paths["TIED"]),
        *(f"LEV={p}" for p in paths["LEV"]),  # repeated NAME= adds seeds
        "UNTIED=" + ",".join(paths["UNTIED"][:2]),
        f"UNTIED={paths['UNTIED'][2]}",
        "--bootstrap",
        "200",
        "--bootstrap-seed",
        "3",
        "--out",
        str(out),
    ]
    assert cli(args) == 0
    cmp = json.loads((out / "compare.json").read_text())
    rows = {r["name"]: r for r in cmp["rows"]}
    assert cmp["seeds"] == 3 and rows["LEV"]["sources"] == paths["LEV"]
    assert rows["LEV"]["rel_change"]["per_seed"] == pytest.approx(
        [-10.0, -100 * (1 - 0.92 / 1.01), -100 * (1 - 0.88 / 0.99)]
    )
    assert cmp["bootstrap"]["resamples"] == 200 and cmp["bootstrap"]["seed"] == 3
    md = (out / "compare.md").read_text()
    assert "seed-paired 95%" in md and "document bootstrap 95%" in md and "±" in md
    for png in ("bucket_perplexity.png", "bucket_rel_change.png", "overall_rel_change.png"):
        assert (out / png).stat().st_size > 0
    # bucket plots: every run's bars with error bars (3 perplexity + 2 change); overall: errorbar()
    assert sum(y is not None for y in given["bar"]) == 5
    seed_err, boot_err = given["errorbar"][-2:]  # bar() draws its yerr through errorbar() too
    assert np.asarray(seed_err).shape == (2, 2) and np.asarray(boot_err).shape == (2, 2)
    assert np.asarray(seed_err).min() > 0  # seed-paired intervals of LEV and UNTIED are not empty
    assert "wrote" in capsys.readouterr().out


def test_per_document_sums_follow_document_boundaries():
    docs = [np.arange(0, 7), np.arange(7, 10), np.arange(10, 23)]  # 23 tokens, 22 predicted
    recorded = RecordLengths(docs)
    targets = np.concatenate([b[:, 1:].reshape(-1).numpy() for b in sequence_batches(recorded, 4, 2)])
    assert recorded.lengths == [7, 3, 13]
    losses = TokenLosses(targets.astype(float) / 10, targets)  # NLL of a token: its id / 10
    counts = np.ones(23, dtype=np.int64)
    counts[:5] = 1000  # ids 0-4 are frequent
    res = evaluation_result(losses, "toy", counts, edges=(0.01,), doc_lengths=recorded.lengths)
    doc = res["per_document"]
    assert doc["unit"] == "document" and doc["tokens"] == [6, 3, 13]  # the first token is never predicted
    assert doc["nll_sum"] == pytest.approx(
        [sum(range(1, 7)) / 10, sum(range(7, 10)) / 10, sum(range(10, 23)) / 10]
    )
    assert doc["bucket_tokens"] == [[2, 3, 13], [4, 0, 0]]  # ids 1-4 are in the frequent bucket
    assert np.sum(doc["bucket_nll_sum"]) == pytest.approx(losses.nll.sum())
    windows = per_document_sums(losses, unit_tokens=5)  # without boundaries: windows of 5 predictions
    assert windows["unit"] == "window" and windows["tokens"] == [5, 5, 5, 5, 2]
    grouped = per_document_sums(losses, recorded.lengths, max_units=2)
    assert grouped["group"] == 2 and grouped["tokens"] == [9, 13]
    with pytest.raises(ValueError, match="document lengths add up to 20"):
        per_document_sums(losses, [7, 13])
