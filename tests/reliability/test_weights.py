"""Non-finite and absurd weights in `train`: an update that blows the weights up is a failed step,
and a run that learnt nothing saves nothing, so its rerun (a requeue) cannot look successful.

Each case runs `megatron-lev train` as a real process (the tiny config of `test_checkpoint`), once
or twice with the same command, and checks the exit status, the one-line message and what the save
directory holds afterwards. NaN losses come from the fault callback (`testing.faults`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from megatron_lev.ckpt import layout as ck
from megatron_lev.utils.io import sha256_file
from tests.reliability.harness import expect_error
from tests.reliability.test_checkpoint import IT4, MODEL, data, overrides, run_copy, train, trained  # noqa: F401

pytestmark = pytest.mark.timeout(400)

FAULTS = "[megatron_lev.testing.faults:FaultInjection]"


def nothing_saved(out: Path) -> None:
    ckpt = out / "ckpt"
    tags = [c.tag for c in ck.list_checkpoints(ckpt)]
    assert tags == [] and not (ckpt / ck.LATEST_FILE).exists(), f"a run that learnt nothing saved {tags}"


def checkpoint_at(it: int) -> Callable[[Path], None]:
    def check(out: Path) -> None:
        ckpt = out / "ckpt"
        assert (ckpt / ck.LATEST_FILE).read_text().strip() == ck.tag_for(it)
        assert ck.verify_checkpoint(ckpt / ck.tag_for(it)) == []

    return check


@dataclass
class Case:
    over: dict  # overrides of the tiny run
    fragments: tuple[str, ...]  # regexes of the last run's error line
    env: dict = field(default_factory=dict)
    runs: int = 1  # the same command this many times (a requeue reruns it); each must fail alike
    logged: bool = False  # the fragments are in a logged line (the run then saved: not the last line)
    check: Callable[[Path], None] = nothing_saved


CASES = [
    pytest.param(
        Case(
            # the largest learning rate the config accepts (1e9 is refused: tests/reliability/test_config.py)
            {"train.lr": 1.0, "train.min_lr": 0.1},
            (r"iteration 1: the update grew the weight norm", r"train\.max_update_ratio=2", "lower train.lr"),
        ),
        id="lr-1-blows-the-weights-up",
    ),
    pytest.param(
        Case(
            {"train.lr": 0.3, "train.min_lr": 0.03},  # 0.3 for 3e-4: finite weights, every step after skipped
            (r"iteration 1: the update grew the weight norm \d", "far too high", "lower train.lr"),
        ),
        id="lr-0.3-typo-blows-the-weights-up",
    ),
    pytest.param(
        Case(
            # one block at 300 times the learning rate: it blows up, the rest of the model does not
            {"train.param_groups": "[{pattern: 'layers.1.*', lr_mult: 300}]"},
            (
                r"iteration 1: the update grew the weight norm",
                "one block blew up, layers.1",
                "look at layers.1",
            ),
        ),
        id="one-block-blows-up-and-is-named",
    ),
    pytest.param(
        Case(
            {"train.callbacks": FAULTS},
            (r"all 4 steps \(iterations 1-4\)", "learnt nothing and saved nothing"),
            env={"MEGATRON_LEV_INJECT_NAN_AT_STEP": "1,2,3,4"},
        ),
        id="all-steps-skipped-saves-nothing",
    ),
    pytest.param(
        Case(
            {"train.callbacks": FAULTS},
            (r"all 4 steps \(iterations 1-4\)", "learnt nothing and saved nothing"),
            env={"MEGATRON_LEV_INJECT_NAN_AT_STEP": "1,2,3,4"},
            runs=2,
        ),
        id="all-steps-skipped-rerun-fails-again",
    ),
    pytest.param(
        Case(
            {"train.callbacks": FAULTS, "train.max_consecutive_skips": 3},
            (r"3 consecutive steps up to iteration 3", "no update of the run was applied", "saved nothing"),
            env={"MEGATRON_LEV_INJECT_NAN_AT_STEP": "1,2,3,4"},
            runs=2,
        ),
        id="skip-limit-with-nothing-learnt-saves-nothing",
    ),
    pytest.param(
        Case(
            {"train.callbacks": FAULTS, "train.max_consecutive_skips": 2},
            (r"2 consecutive steps up to iteration 4", "stopped with a checkpoint of the last good weights"),
            env={"MEGATRON_LEV_INJECT_NAN_AT_STEP": "3,4"},
            logged=True,
            check=checkpoint_at(4),
        ),
        id="skip-limit-after-learning-still-saves",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_absurd_or_skipped_updates_fail_and_save_nothing(case: Case, data, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    over = overrides(data, out, **case.over)
    for _ in range(case.runs):
        res = train(over, **case.env)
        if case.logged:
            assert res.rc == 3 and "Traceback" not in res.err, res.err[-3000:]
            assert all(re.search(f, res.err) for f in case.fragments), res.err[-3000:]
        else:
            expect_error(res, *case.fragments, rc=3)
        if case.check is nothing_saved:
            assert "saved checkpoint" not in res.err and "resumed from" not in res.err, res.err[-3000:]
    case.check(out)


def _all_skipped_in_state(tag_dir: Path) -> None:
    """What a checkpoint saved by a run whose every step was skipped records (as earlier versions saved
    it): the skip tally equals the iteration. Its checksum is recorded again."""
    path = tag_dir / MODEL
    state = torch.load(path, map_location="cpu", weights_only=False)
    it = state["train_state"]["iteration"]
    state["train_state"]["skips"] = {"total": it, "consecutive": it}
    torch.save(state, path)
    marker = json.loads((tag_dir / ck.COMPLETE_MARKER).read_text())
    marker["files"][MODEL] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    (tag_dir / ck.COMPLETE_MARKER).write_text(json.dumps(marker))


def test_resuming_a_checkpoint_that_learnt_nothing_is_not_a_success(run_copy, data):  # noqa: F811
    """A save directory left by an earlier version after a run whose steps were all skipped: the rerun
    resumes at the end and trains nothing; it must fail, naming the checkpoint, not exit 0."""
    _all_skipped_in_state(run_copy / "ckpt" / IT4)
    res = train(overrides(data, run_copy))
    expect_error(
        res, "every one of the 4 iterations up to 4 was skipped", re.escape(str(run_copy / "ckpt")), rc=3
    )
