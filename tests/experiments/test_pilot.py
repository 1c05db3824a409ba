"""The LEV pilot: its plan, and its report from synthetic raw files (the README's rules applied: the
collapse rule, the chosen setting with ties, the learning rate, the default) and, once collected, from
the committed raw files, which must regenerate the committed tables exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from studies import pilot_report as pr
from studies import plans as study
from studies.plans import PILOT_GROUPS, study_plan
from tests.experiments.committed import assert_pages_regenerate, pages_dir, raw_dir

PILOT = pages_dir("pilot")
PILOT_RAW = raw_dir("pilot")


def test_the_pilot_plan_has_every_arm_the_readme_names():
    runs = study_plan("pilot")
    groups = {r.group for r in runs}
    readme = (PILOT / "README.md").read_text()
    assert set(pr.SPEC_ORDER) <= groups
    for group in pr.SPEC_ORDER:  # every candidate setting is explained in the plan's table
        assert f"| {group} |" in readme, group
    assert {"TIED-LR1", "TIED-LR4", "LEV-LR1", "LEV-LR4", "TIED-W10"} <= groups
    assert {r.seed for r in runs if r.group in ("TIED", "LEV")} == {1234, 1235}
    lrs = {g: o for g, _, _, o in PILOT_GROUPS}
    assert lrs["LEV-LR1"] == ("train.lr=0.001", "train.min_lr=0.0001")
    assert lrs["TIED-LR4"] == ("train.lr=0.004", "train.min_lr=0.0004")


def _result(doc_nll: np.ndarray, tokens: np.ndarray, kind: str) -> dict:
    return {
        "corpus_kind": kind,
        "mean_nll": float(doc_nll.sum() / tokens.sum()),
        "per_document": {"tokens": tokens.astype(int).tolist(), "nll_sum": doc_nll.tolist()},
    }


def _metrics(mean_row: tuple[float, float], rank: tuple[float, float]) -> str:
    rows = []
    for it, (m, r) in ((10, (mean_row[0], rank[0])), (300, (mean_row[1], rank[1]))):
        rows.append(
            {
                "kind": "train",
                "iteration": it,
                "loss": 5.0,
                "clipped": 1 if it == 10 else 0,
                "grad_norm/global": 1.0,
                "grad_norm/embedding.delta": 0.5,
                "update_ratio/embedding.delta": 0.01,
                "input_table/rms": 0.1,
                "input_table/mean_row_ratio": m,
                "input_table/effective_rank": r,
                "input_table/effective_rank_centred": r,
                "input_table/update_ratio": 0.02,
            }
        )
    return "".join(json.dumps(r) + "\n" for r in rows)


# group -> (shift of the per-token NLL, collapsed?) for seed 1234; every document's NLL is shifted
SHIFTS = {
    "TIED": (0.00, False),
    "TIED-LR1": (0.02, False),
    "TIED-LR4": (0.03, False),
    "TIED-W10": (-0.10, False),
    "TIED-W10-LR1": (-0.08, False),
    "TIED-W10-LR4": (-0.105, False),  # within 0.01 of TIED-W10: the tie goes to the rate nearer 2e-3
    "LEV": (0.50, True),
    "LEV-W10": (0.45, True),
    "LEV-X01": (0.40, False),
    "LEV-R": (0.205, False),
    "LEV-RS": (0.20, False),  # lowest, but within 0.01 of LEV-R: LEV-R (nearer the spec) is chosen
    "LEV-RG": (0.30, False),
}


@pytest.fixture
def raw(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(50, 200, size=40).astype(float)
    base = tokens * rng.uniform(4.5, 5.5, size=40)
    runs = []
    for group, (shift, collapsed) in {**SHIFTS, "LEV:1235": (0.52, True)}.items():
        name_group, _, seed = group.partition(":")
        seed = int(seed or 1234)
        name = f"{name_group.lower()}-s{seed}"
        d = tmp_path / name
        d.mkdir()
        doc = base + shift * tokens + rng.normal(0, 0.5, size=40)
        results = [_result(doc, tokens, "mmidx"), _result(doc + 0.1 * tokens, tokens, "text")]
        (d / "eval.json").write_text(json.dumps({"results": results}))
        mr, rk = ((0.93, 0.99), (66.0, 20.0)) if collapsed else ((0.1, 0.2), (66.0, 50.0))
        (d / "metrics.jsonl").write_text(_metrics(mr, rk))
        variant = "lev" if name_group.startswith("LEV") else "tied"
        runs.append({"name": name, "group": name_group, "variant": variant, "seed": seed, "overrides": []})
    (tmp_path / "study.json").write_text(json.dumps({"plan": "pilot", "runs": runs}))
    return tmp_path


def test_paired_interval_is_the_difference_over_the_same_documents(raw):
    r = pr.PlanRaw(raw)
    a, b = r.result(r.run("LEV-R")), r.result(r.run("TIED"))
    point, lo, hi = pr.paired_interval(a, b)
    assert point == pytest.approx(a["mean_nll"] - b["mean_nll"], abs=1e-12)
    assert lo < point < hi and hi - lo < 0.1
    with pytest.raises(Exception, match="same documents"):
        pr.paired_interval(a, {**b, "per_document": {"tokens": [1], "nll_sum": [1.0]}})


def test_the_rules_pick_the_setting_the_rate_and_the_default(raw):
    r = pr.PlanRaw(raw)
    assert pr.collapsed(r, r.run("LEV")) is True and pr.collapsed(r, r.run("LEV-R")) is False
    sel = pr.selection(r)
    assert sel["chosen"] == "LEV-R" and sorted(sel["tied"]) == ["LEV-R", "LEV-RS"]
    assert sel["lr"]["TIED"] == ("TIED-W10", ["TIED-W10", "TIED-W10-LR4"])
    assert sel["lr"]["LEV"] is None  # LEV-R-W10 and its rates not run yet
    assert (
        pr.warmed("LEV") == "LEV-W10"
        and pr.warmed("LEV-W10") == "LEV-W10"
        and pr.warmed("LEV-R") == "LEV-R-W10"
    )
    ok, why = sel["default"]
    assert ok and why.startswith("LEV-R - LEV = -0.2")


def test_the_report_is_deterministic_and_says_what_it_found(raw, tmp_path):
    a = pr.write_pilot_report(raw, tmp_path / "a", plots=True)
    pr.write_pilot_report(raw, tmp_path / "b", plots=False)
    assert sorted(a) == sorted(pr.PAGES)
    for name in pr.PAGES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "plots" / "dynamics.png").stat().st_size > 10_000
    runs = (tmp_path / "a" / "runs.md").read_text()
    assert "| lev-s1234 | LEV | 1234 | 0.002 |" in runs and "| yes |" in runs
    assert "- LEV: " in runs and "spread" in runs
    selection = (tmp_path / "a" / "selection.md").read_text()
    assert "chosen (nearest the spec among those): **LEV-R**" in selection
    assert "Becomes the default" in selection
    collapse = (tmp_path / "a" / "collapse.md").read_text()
    assert "| lev-s1234 | 300 | 0.1000 | 0.9900 | 20.0 | 20.0 | 0.0200 | 1/2 |" in collapse


def test_the_committed_tables_are_those_of_the_committed_raw_files(tmp_path):
    assert_pages_regenerate(pr.write_pilot_report, "pilot", pr.PAGES, tmp_path, plots=False)


def test_the_regime_and_order_plans_run_what_the_committed_pilot_chose():
    """The settings the later experiments use are those the README's rules give on the committed raw
    files, not numbers copied by hand."""
    sel = pr.selection(pr.PlanRaw(PILOT_RAW))
    assert sel["lr"]["TIED"] is not None and sel["lr"]["LEV"] is not None, "the pilot's sweeps are incomplete"
    assert study.PILOT_TIED_CHOICE == sel["lr"]["TIED"][0]
    assert study.PILOT_LEV_CHOICE == sel["lr"]["LEV"][0]
    assert sel["lr"]["LEV"][0].startswith(pr.warmed(sel["chosen"]))
    overrides = {g: o for g, _, _, o in PILOT_GROUPS}
    regime = {g: o for g, _, _, o in study.REGIME_GROUPS}
    assert regime["TIED"] == overrides[study.PILOT_TIED_CHOICE]
    assert regime["LEV"] == overrides[study.PILOT_LEV_CHOICE]
    assert all(o[: len(regime["LEV"])] == regime["LEV"] for g, _, _, o in study.ORDER_GROUPS)
