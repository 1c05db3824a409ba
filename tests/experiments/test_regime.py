"""The regime report from synthetic raw files with known differences: the band comparisons and their
intervals, and the README's criteria giving support, trade-off and refute where they should."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from studies import regime_report as rr
from studies.plan_raw import PlanRaw, paired_differences, seed_interval
from tests.experiments.committed import assert_pages_regenerate

DOCS, BANDS = 40, 5
BAND_NLL = np.array([9.0, 8.0, 6.0, 5.0, 4.0])  # TIED's per-token NLL in bands 0, 1-9, 10-99, ...


def _result(kind: str, shift: np.ndarray, rng, tokens: np.ndarray) -> dict:
    """Per-document sums: NLL per token = BAND_NLL + shift (per band) + small noise."""
    nll = tokens * (BAND_NLL + shift) + rng.normal(0, 0.05, size=tokens.shape) * tokens
    doc = {"tokens": tokens.sum(1).astype(int).tolist(), "nll_sum": nll.sum(1).tolist()}
    rows = []
    for b in range(BANDS):
        n = tokens[:, b].sum()
        rows.append(
            {"band": str(b), "tokens": int(n), "vocab_ids": 10 * b, "mean_nll": float(nll[:, b].sum() / n)}
        )
    for side in ("target_band", "input_band"):
        doc[f"{side}_tokens"] = tokens.T.astype(int).tolist()
        doc[f"{side}_nll_sum"] = nll.T.tolist()
    return {
        "corpus_kind": kind,
        "mean_nll": float(nll.sum() / tokens.sum()),
        "count_bands": {"target": rows, "input": rows},
        "per_document": doc,
    }


def _train_row(it: int, group: str) -> dict:
    """A logged step with the trainer's dynamics keys; LEV's seed side carries 3/4 of the squared
    global gradient norm, and its step 10 is clipped."""
    row = {"kind": "train", "iteration": it, "loss": 5.0, "clipped": int(it == 10), "grad_norm/global": 2.0}
    row.update(
        {f"input_table/{k}": v for k, v in zip(rr.TABLE_KEYS, (0.1, 0.2 + it / 1000, 30.0, 31.0, 0.01))}
    )
    if group.startswith("LEV"):
        row.update({"grad_norm/embedding.codebooks.weight": 1.0, "grad_norm/embedding.proj": 2**0.5})
    else:
        row["grad_norm/embedding.table.weight"] = 0.5
    return row


def _raw(tmp_path, lev_shift, albert_shift, tied_seed_sd=0.02):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, size=(DOCS, BANDS)).astype(float)
    tokens[:, 4] *= 20  # most tokens are frequent
    plan = [("TIED", 3, np.zeros(BANDS)), ("LEV", 3, lev_shift), ("ALBERT-32", 1, albert_shift)]
    plan += [("UNTIED", 1, np.full(BANDS, -0.01)), ("LEV-RANDOM", 1, lev_shift + 0.01)]
    runs = []
    for group, n, shift in plan:
        for k, seed in enumerate((1234, 1235, 1236)[:n]):
            name = f"{group.lower()}-s{seed}"
            (tmp_path / name).mkdir()
            jitter = np.full(BANDS, (k - 1) * tied_seed_sd)  # seed-to-seed spread of every group
            results = [_result(kind, shift + jitter, rng, tokens) for kind in ("mmidx", "text")]
            (tmp_path / name / "eval.json").write_text(json.dumps({"results": results}))
            curve = [
                {"kind": "valid", "iteration": it, "loss": 6.0 - it / 1000 + shift.mean()}
                for it in (100, 200)
            ]
            curve += [_train_row(it, group) for it in (10, 100)]
            (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(c) + "\n" for c in curve))
            runs.append({"name": name, "group": group, "variant": "x", "seed": seed, "overrides": []})
    (tmp_path / "study.json").write_text(json.dumps({"plan": "regime", "runs": runs}))
    return PlanRaw(tmp_path)


RARE_AHEAD = np.array([0.0, -0.5, 0.0, 0.0, 0.0])


def test_band_differences_and_intervals(tmp_path):
    raw = _raw(tmp_path, RARE_AHEAD, np.zeros(BANDS))
    c = rr.comparison(raw, "LEV", "TIED", "mmidx", ("input_band", 1))
    assert c["seeds"] == [1234, 1235, 1236] and c["mean"] == pytest.approx(-0.5, abs=0.05)
    assert c["document"][0] < c["mean"] < c["document"][1] < 0
    frequent = rr.comparison(raw, "LEV", "TIED", "mmidx", ("target_band", 4))
    assert frequent["document"][0] < 0 < frequent["document"][1]
    diffs, interval = paired_differences([(raw.result(raw.run("LEV")), raw.result(raw.run("TIED")))])
    assert len(diffs) == 1 and interval[0] < diffs[0] < interval[1]
    assert seed_interval([1.0]) is None and seed_interval([1.0, 2.0, 3.0])[0] < 2.0


@pytest.mark.parametrize(
    "lev_shift, albert_shift, expected",
    [
        (RARE_AHEAD, np.zeros(BANDS), "support"),  # ahead on 1-9, overall within the seed noise
        (RARE_AHEAD + np.array([0, 0, 0, 0, 0.3]), np.zeros(BANDS), "trade-off"),  # frequent tokens worse
        (np.array([0.0, 0.4, 0, 0, 0]), np.zeros(BANDS), "refute"),  # behind TIED on 1-9
        (RARE_AHEAD, RARE_AHEAD * 2, "refute"),  # generic sharing does better on 1-9
        (np.zeros(BANDS), np.zeros(BANDS), "inconclusive"),
    ],
    ids=["support", "trade-off", "refute-tied", "refute-albert", "inconclusive"],
)
def test_the_criteria(tmp_path, lev_shift, albert_shift, expected):
    raw = _raw(tmp_path, lev_shift, albert_shift)
    verdict, reasons = rr.verdict(raw)
    assert verdict == expected, reasons


def _one_tied_seed(path: Path, lev_shift) -> PlanRaw:
    path.mkdir()
    _raw(path, lev_shift, np.zeros(BANDS))
    listing = json.loads((path / "study.json").read_text())
    keep = [r for r in listing["runs"] if r["group"] != "TIED" or r["seed"] == 1234]
    (path / "study.json").write_text(json.dumps({**listing, "runs": keep}))
    return PlanRaw(path)


def test_a_refute_decides_before_the_seed_noise_is_known(tmp_path):
    """Refute is checked first (the README's order): with one TIED seed there is no seed noise, so
    support and trade-off cannot be decided, but LEV behind TIED on a 1-9 band is a refute all the
    same."""
    behind = _one_tied_seed(tmp_path / "behind", np.array([0.0, 0.4, 0, 0, 0]))
    assert rr.seed_noise(behind) is None
    verdict, reasons = rr.verdict(behind)
    assert verdict == "refute", reasons
    verdict, reasons = rr.verdict(_one_tied_seed(tmp_path / "ahead", RARE_AHEAD))
    assert verdict == "inconclusive" and "seed noise is not available" in reasons[-1], reasons


def test_the_verdict_page_says_when_runs_of_the_plan_are_missing(tmp_path):
    (tmp_path / "full").mkdir()
    full = _raw(tmp_path / "full", RARE_AHEAD, np.zeros(BANDS))
    assert full.missing() == []
    assert "Preliminary" not in rr.verdict_markdown(full)
    partial = _one_tied_seed(tmp_path / "partial", RARE_AHEAD)
    assert partial.missing() == ["tied-s1235", "tied-s1236"]
    page = rr.verdict_markdown(partial)
    assert "**Preliminary**: 7 of the plan's 9 runs collected; not yet: tied-s1235, tied-s1236." in page


def test_the_report_pages(tmp_path):
    (tmp_path / "raw").mkdir()
    _raw(tmp_path / "raw", RARE_AHEAD, np.zeros(BANDS))
    paths = rr.write_regime_report(tmp_path / "raw", tmp_path / "out", plots=True)
    assert sorted(paths) == sorted(rr.PAGES)
    assert (tmp_path / "out" / "plots" / "bands.png").stat().st_size > 5_000
    assert "**support**" in (tmp_path / "out" / "verdict.md").read_text()
    bands = (tmp_path / "out" / "bands.md").read_text()
    assert "## validation, by input count" in bands and "| 1-9 |" in bands
    curve = (tmp_path / "out" / "curve.md").read_text()
    assert "| 100 |" in curve and "| 200 |" in curve
    for plot in ("curve.png", "dynamics.png"):
        assert (tmp_path / "out" / "plots" / plot).stat().st_size > 5_000
    dynamics = (tmp_path / "out" / "dynamics.md").read_text()
    assert "| tied-s1235 | 100 | 0.1000 | 0.3000 | 30.0 | 31.0 | 0.01000 | 1/2 |" in dynamics
    assert "| lev-s1234 | 10 | 2.000 | 0.750 | codebooks.weight 1.0000, proj 1.4142 |" in dynamics
    assert "| tied-s1234 | 100 | 2.000 | - | table.weight 0.5000 |" in dynamics
    assert "lev-s1235 | 10 | 2.000" not in dynamics  # the gradient table shows seed 1234 only
    again = rr.write_regime_report(tmp_path / "raw", tmp_path / "again", plots=False)
    for name in rr.PAGES:
        assert paths[name].read_text() == again[name].read_text()


def test_the_order_page(tmp_path):
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 30, size=(DOCS, BANDS)).astype(float)
    runs = []
    for group, shift in (("LEV-BPE", 0.0), ("LEV-RANDOM", -0.2), ("LEV-FREQUENCY", 0.1)):
        for seed in (1234, 1235, 1236):
            name = f"{group.lower()}-s{seed}"
            (tmp_path / name).mkdir()
            results = [_result(k, np.full(BANDS, shift), rng, tokens) for k in ("mmidx", "text")]
            (tmp_path / name / "eval.json").write_text(json.dumps({"results": results}))
            runs.append({"name": name, "group": group, "variant": "lev", "seed": seed, "overrides": []})
    (tmp_path / "study.json").write_text(json.dumps({"plan": "order", "runs": runs}))
    page = rr.write_order_report(tmp_path, tmp_path / "out")["order.md"].read_text()
    row = next(
        line for line in page.splitlines() if line.startswith("| LEV-RANDOM - LEV-BPE | validation | all |")
    )
    assert float(row.split(" | ")[3]) == pytest.approx(-0.2, abs=0.03)
    assert "| LEV-FREQUENCY - LEV-BPE | zero-shot | >= 1000 |" in page and "Preliminary" not in page
    listing = json.loads((tmp_path / "study.json").read_text())
    keep = [r for r in listing["runs"] if r["seed"] == 1234]
    (tmp_path / "study.json").write_text(json.dumps({**listing, "runs": keep}))
    page = rr.write_order_report(tmp_path, tmp_path / "part")["order.md"].read_text()
    assert "**Preliminary**: 3 of the plan's 9 runs collected; not yet: lev-bpe-s1235, lev-bpe-s1236," in page


@pytest.mark.parametrize("plan", ["regime", "order"])
def test_every_run_of_the_plan_passes_the_trainers_checks_before_any_step(plan, shared_data, tmp_path):
    """`study run --plan regime` validates each run with its own overrides at the given tokenizer's
    vocabulary (ALBERT-32 is 32 wide by override; at the grid's parameter matching it would be 4 and
    refused), and a run that cannot start is refused before the data steps."""
    from megatron_lev.errors import ConfigError
    from studies.plans import study_plan
    from studies.runner import Study

    tokenizer = shared_data / "tokenizers" / "gpt-neox-20b.json"
    study = Study(shared_data / "minipile", tmp_path / "out", plan=plan, tokenizer=tokenizer)
    study.check()
    cfgs = {r.name: study.run_config(r) for r in study_plan(plan)}
    if plan == "regime":
        assert cfgs["albert-32-s1234"].model.baseline_dim == 32
        assert all(c.train.lr == 1e-3 and c.train.lr_warmup_fraction == 0.1 for c in cfgs.values())
        lev = cfgs["lev-s1234"]
        assert lev.model.lev.centre_reference == 256
        from megatron_lev.plan import param_group_rules

        assert [r.lr_mult for r in param_group_rules(lev)] == [0.1, 0.1]
        from studies.plans import REGIME_CONFIG

        narrow = tmp_path / "narrow.yaml"  # the regime config with a floor ALBERT-32 is under
        root = Path(__file__).resolve().parents[2]
        narrow.write_text(f"include: {root / REGIME_CONFIG}\nmodel: {{min_compressed_width: 64}}\n")
        broken = Study(
            shared_data / "minipile",
            tmp_path / "out2",
            config=narrow,
            plan=plan,
            tokenizer=tokenizer,
            runs=["albert-32-s1234"],
        )
        with pytest.raises(ConfigError, match="min_compressed_width"):
            broken.check()
        assert not (tmp_path / "out2").exists()


def test_the_reports_read_the_table_statistics_the_trainer_logs():
    """plan_raw repeats `training.dynamics.TABLE_KEYS` so that the reports need not import torch."""
    from megatron_lev.training.dynamics import TABLE_KEYS as LOGGED
    from studies.plan_raw import TABLE_KEYS

    assert TABLE_KEYS == LOGGED


def test_the_committed_tables_are_those_of_the_committed_raw_files(tmp_path):
    """Every committed page of the regime experiment is the report of its committed raw files."""
    assert_pages_regenerate(rr.write_regime_report, "regime", rr.PAGES, tmp_path, plots=False)


def test_the_committed_order_page_is_that_of_the_committed_raw_files(tmp_path):
    assert_pages_regenerate(rr.write_order_report, "order", ["order.md"], tmp_path)
