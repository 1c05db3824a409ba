"""`megatron-lev compare` on synthetic results and loss curves with a known crossing point."""

from __future__ import annotations

import json

import pytest
from torch.utils.tensorboard import SummaryWriter

from megatron_lev.analysis.curves import read_curve, tokens_to_target
from megatron_lev.cli import main as cli

LABELS = ["< 1e-07", "[1e-07, 1e-06)", ">= 1e-06"]


def _result(path, name, ppl, bucket_ppl):
    buckets = [{"bucket": lab, "tokens": 10, "perplexity": p} for lab, p in zip(LABELS, bucket_ppl)]
    path.write_text(
        json.dumps(
            {
                "name": name,
                "results": [{"name": name, "perplexity": ppl, "buckets": buckets, "corpus": "heldout"}],
            }
        )
    )
    return path


def _tb_log(logdir, slope):
    """valid/loss = 3 - slope * step every 10 steps; train/tokens = 1000 * step."""
    w = SummaryWriter(str(logdir))
    for step in range(0, 101, 10):
        w.add_scalar("valid/loss", 3.0 - slope * step, step)
        w.add_scalar("train/tokens", 1000.0 * step, step)
    w.close()
    return logdir


def test_compare_table_and_tokens_to_target(tmp_path, capsys):
    tied = _result(tmp_path / "tied.json", "TIED", 20.0, [400.0, 100.0, 10.0])
    lev = _result(tmp_path / "lev.json", "LEV", 18.0, [300.0, 95.0, 10.5])
    untied = _result(tmp_path / "untied.json", "UNTIED", 21.0, [440.0, 100.0, 10.0])
    curves = {
        "TIED": _tb_log(tmp_path / "tb_tied", 0.01),  # final loss 2.0, first reached at 100k
        "LEV": _tb_log(tmp_path / "tb_lev", 0.0225),  # reaches 2.0 at step 44.44 -> 44,444 tokens
        "UNTIED": _tb_log(tmp_path / "tb_untied", 0.005),
    }  # never reaches 2.0
    (tmp_path / "untied.csv").write_text("tokens,loss\n0,3.0\n100000,2.5\n")
    args = [
        "compare",
        str(tied),
        f"LEV={lev}",
        str(untied),
        "--out",
        str(tmp_path / "out"),
        "--curves",
        f"TIED={curves['TIED']}",
        f"LEV={curves['LEV']}",
        f"UNTIED={tmp_path / 'untied.csv'}",
    ]
    assert cli(args) == 0
    cmp = json.loads((tmp_path / "out" / "compare.json").read_text())
    rows = {r["name"]: r for r in cmp["rows"]}
    assert cmp["target_loss"] == pytest.approx(2.0)
    assert rows["LEV"]["rel_change_pct"] == pytest.approx(-10.0)
    assert [b["rel_change_pct"] for b in rows["LEV"]["buckets"]] == pytest.approx([-25.0, -5.0, 5.0])
    assert rows["TIED"]["tokens_to_target"] == pytest.approx(100_000, rel=1e-6)
    assert rows["LEV"]["tokens_to_target"] == pytest.approx(44_444.44, rel=1e-5)
    assert rows["LEV"]["tokens_ratio"] == pytest.approx(0.444444, rel=1e-5)
    assert rows["UNTIED"]["tokens_to_target"] is None
    table = capsys.readouterr().out
    assert "| LEV | 18.000 | -10.00% | -25.00% | -5.00% | +5.00% | 4.444e+04 | 0.444 |" in table
    assert "not reached" in table
    assert (tmp_path / "out" / "loss_curves.png").stat().st_size > 0
    assert (tmp_path / "out" / "bucket_perplexity.png").stat().st_size > 0


def test_curve_sources_and_errors(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"tokens": [0, 10, 20], "loss": [3.0, 2.0, 1.0]}))
    c = read_curve(tmp_path / "c.json")
    assert tokens_to_target(c, 1.5) == pytest.approx(15.0) and tokens_to_target(c, 0.5) is None
    (tmp_path / "c.csv").write_text("0,3\n10,1\n")
    assert tokens_to_target(read_curve(tmp_path / "c.csv"), 2.0) == pytest.approx(5.0)
    w = SummaryWriter(str(tmp_path / "tb"))
    for step in range(5):
        w.add_scalar("train/loss", 5.0 - step, step)
    w.close()
    steps = read_curve(tmp_path / "tb")  # no valid/loss, no tokens tag
    assert steps.x_label == "steps" and steps.loss.tolist() == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert read_curve(tmp_path / "tb", tokens_per_step=512).x[-1] == 2048
    with pytest.raises(ValueError, match="no scalar tag valid/ppl"):
        read_curve(tmp_path / "tb", tag="valid/ppl")
    with pytest.raises(ValueError, match="baseline 'TIED'"):
        from megatron_lev.analysis.compare import compare_results

        compare_results({"LEV": {"perplexity": 1.0}})
