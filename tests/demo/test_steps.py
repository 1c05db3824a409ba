import sys

import pytest

from megatron_lev.demo.steps import Step, StepFailed, StepRunner


def _touch_step(name, path, counter):
    code = (
        f"import pathlib; pathlib.Path({str(path)!r}).write_text('x'); open({str(counter)!r}, 'a').write('1')"
    )
    return Step(name, f"writes {path.name}", lambda: [sys.executable, "-c", code], lambda: [path])


def test_finished_steps_are_skipped_and_missing_outputs_rerun(tmp_path):
    out, counter = tmp_path / "a.txt", tmp_path / "count"
    step = _touch_step("make-a", out, counter)
    logs = []
    StepRunner(tmp_path, log=logs.append).run([step])
    StepRunner(tmp_path, log=logs.append).run([step])
    assert counter.read_text() == "1"
    assert any("already done, skipping" in line for line in logs)
    out.unlink()  # an output vanished: the step runs again
    StepRunner(tmp_path, log=logs.append).run([step])
    assert counter.read_text() == "11"


def test_failing_step_names_itself_and_stops_the_pipeline(tmp_path):
    bad = Step(
        "broken", "exits 3", lambda: [sys.executable, "-c", "print('about to fail'); raise SystemExit(3)"]
    )
    after = _touch_step("after", tmp_path / "b.txt", tmp_path / "count")
    with pytest.raises(StepFailed, match=r"(?s)step 'broken' failed \(exit status 3\).*about to fail"):
        StepRunner(tmp_path, log=lambda *_: None).run([bad, after])
    assert not (tmp_path / "b.txt").exists()
    assert not (tmp_path / ".steps" / "broken.json").exists()


def test_step_without_its_output_fails(tmp_path):
    lazy = Step(
        "lazy", "claims an output", lambda: [sys.executable, "-c", "pass"], lambda: [tmp_path / "never"]
    )
    with pytest.raises(StepFailed, match="did not produce"):
        StepRunner(tmp_path, log=lambda *_: None).run([lazy])
