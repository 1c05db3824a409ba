"""The training loop over real DeepSpeed engines (2 gloo ranks) with a toy model.

An injected NaN leaves master weights and Adam moments untouched on every ZeRO stage
(and ZeRO-3 with CPU offload);
a preemption signal on one rank stops both at the same step with a checkpoint, and
resuming gives the uninterrupted losses; too many skips in a row stop the run. A built
`DeepSpeedEngine` is an `Engine`.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lev.training.callbacks import SKIP_LIMIT_EXIT_CODE
from megatron_lev.training.signals import PREEMPTED_EXIT_CODE
from tests.training.suites import NAN_STAGES

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.mark.parametrize("stage", NAN_STAGES)
def test_injected_nan_is_skipped_without_touching_the_state(two_rank_results, stage):
    for rank_results in two_rank_results:
        r = rank_results["nan"][stage]
        (l1, s1), (l2, s2), (l3, s3) = r["steps"]
        assert (s1, s2, s3) == (False, True, False)
        assert math.isfinite(l1) and math.isnan(l2) and math.isfinite(l3)
        assert r["unchanged"], "a skipped step changed weights or Adam moments"
        assert r["changed_after"], "the step after the skip did not update"


def test_signal_on_one_rank_stops_both_and_resume_is_exact(two_rank_results):
    for r in (x["preempt"] for x in two_rank_results):
        assert r["first"] == (PREEMPTED_EXIT_CODE, 3)  # both ranks stop after iteration 3
        assert r["resumed_from"] == 3 and r["rest_exit"] == 0
        assert sorted(r["rest"]) == [4, 5, 6]
        for it in (4, 5, 6):
            assert r["rest"][it] == pytest.approx(r["full"][it], abs=1e-6), it
    assert two_rank_results[0]["preempt"]["full"] == two_rank_results[1]["preempt"]["full"]


def test_consecutive_skips_stop_the_run_with_a_checkpoint(two_rank_results):
    r = two_rank_results[0]["skip_limit"]
    assert r == {"exit": SKIP_LIMIT_EXIT_CODE, "iteration": 3, "skipped": 2, "latest": "iter_0000003"}


def test_a_notice_during_start_up_stops_every_rank_before_the_first_step(two_rank_results):
    assert [r["early_signal"] for r in two_rank_results] == [(PREEMPTED_EXIT_CODE, 0)] * 2


def _engine_protocol() -> dict:
    """Runs in a gloo process: a toy DeepSpeedEngine is an `Engine`, and its finiteness flag stays on
    the device and sees an inf weight."""
    import torch

    from megatron_lev.engine import Engine
    from megatron_lev.engine.deepspeed_engine import DeepSpeedEngine, build_engine, disable_cpu_shm_comm
    from megatron_lev.parallel import state
    from megatron_lev.plan import model_plan
    from tests.training.toy import ToyLM, toy_config

    disable_cpu_shm_comm()
    layout = state.initialize_model_parallel(1, 1)
    cfg = toy_config(0, iters=1)
    engine = build_engine(model_plan(cfg, 1, None), ToyLM(), layout)
    finite = engine.weights_finite()
    with torch.no_grad():
        next(engine.module.parameters()).view(-1)[0] = float("inf")
    return {
        "is_engine": isinstance(engine, Engine) and isinstance(engine, DeepSpeedEngine),
        "flag": (finite.dtype, finite.shape, bool(finite)),
        "after_inf": bool(engine.weights_finite()),
        "has_layers": hasattr(engine, "layers"),
    }


def test_the_deepspeed_engine_is_an_engine():
    from megatron_lev.testing.distributed import run_distributed

    (res,) = run_distributed(_engine_protocol, world_size=1, timeout=240)
    assert res["is_engine"]
    assert res["flag"] == (torch.bool, torch.Size([]), True)
    assert res["after_inf"] is False
    assert not res["has_layers"]  # what a callback needs of the model, it finds through `module`
