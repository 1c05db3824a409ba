"""The training loop over real DeepSpeed engines (2 gloo ranks) with a toy model.

An injected NaN leaves master weights and Adam moments untouched on every ZeRO stage
(and ZeRO-3 with CPU offload);
a preemption signal on one rank stops both at the same step with a checkpoint, and
resuming gives the uninterrupted losses; too many skips in a row stop the run.
"""

from __future__ import annotations

import math

import pytest

from megatron_lev.training.signals import PREEMPTED_EXIT_CODE
from megatron_lev.training.trainer import SKIP_LIMIT_EXIT_CODE
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
