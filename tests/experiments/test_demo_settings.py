"""The demo-settings page (`docs/results/demo/settings.md`) is the report of its raw summaries, and the
small config the demo trains carries the setting that page chose."""

from __future__ import annotations

from pathlib import Path

from megatron_lev.config import load_config
from megatron_lev.demo.pipeline import DEFAULT_CONFIG
from studies import demo_report

ROOT = Path(__file__).resolve().parents[2]


def test_committed_page_is_the_report(tmp_path):
    written = demo_report.write(ROOT / "results" / "demo" / "raw", tmp_path)
    assert written.read_text() == (ROOT / "docs" / "results" / "demo" / "settings.md").read_text()


def test_the_chosen_setting_met_its_criterion_and_is_the_demos():
    raw = ROOT / "results" / "demo" / "raw"
    spec, chosen = demo_report._row(raw / "spec"), demo_report._row(raw / "experiments")
    assert chosen["mean_row_ratio"] < 0.5 <= spec["mean_row_ratio"]
    assert chosen["valid_loss_last"] <= spec["valid_loss_last"] + 0.05
    lev = load_config(str(DEFAULT_CONFIG), ["model.embedding=lev"]).model.lev
    assert (lev.centre_reference, lev.seed_lr_mult) == (chosen["centre_reference"], chosen["seed_lr_mult"])
