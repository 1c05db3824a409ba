"""`logging.profile_steps`: a `torch.profiler` trace of a window of steps that names the model's modules;
nothing is profiled outside the window or off `logging.profile_ranks`; bad windows are refused."""

from __future__ import annotations

import json

import pytest

from megatron_lev.config import load_config
from megatron_lev.errors import ConfigError
from tests.tiny_run import tiny_overrides
from tests.training.conftest import run_train

pytestmark = pytest.mark.slow


def test_a_window_of_steps_is_traced_with_the_model_modules(minipile_prefix, tokenizer_path, tmp_path):
    out = tmp_path / "run"
    over = tiny_overrides(
        minipile_prefix,
        tokenizer_path,
        out,
        **{"train.train_iters": 5, "logging.profile_steps": "[2, 3]", "train.save_interval": 0},
    )
    res = run_train(1, over)
    assert res.returncode == 0, res.stderr[-3000:]
    traces = sorted((out / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, list((out / "profile").iterdir()) if (out / "profile").exists() else res.stderr
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("layers.0" in n and "attention" in n for n in names), sorted(names)[:40]  # module scopes
    assert any(n.startswith("aten::") for n in names)
    assert "profiling iterations 2..3" in res.stderr


def test_another_rank_writes_nothing_and_bad_windows_are_refused(minipile_prefix, tokenizer_path, tmp_path):
    out = tmp_path / "run"
    over = tiny_overrides(
        minipile_prefix,
        tokenizer_path,
        out,
        **{
            "train.train_iters": 3,
            "logging.profile_steps": "[1, 2]",
            "logging.profile_ranks": "[1]",
            "train.save_interval": 0,
        },
    )
    assert run_train(1, over).returncode == 0
    assert not (out / "profile").exists()
    for bad in ("[3, 2]", "[0, 2]", "[4]"):
        with pytest.raises(ConfigError, match=r"logging\.profile_steps"):
            load_config(None, [f"logging.profile_steps={bad}"])
