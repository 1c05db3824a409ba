"""The local task YAMLs render the same prompts and choices as lm-eval's built-in definitions."""

from __future__ import annotations

import itertools

import pytest
import yaml

from megatron_lev.checkpoint.lm_eval_tasks import GROUP, TASKS, TaskDataError, write_lm_eval_tasks
from megatron_lev.cli import main as cli_main

N_DOCS = 60


def _task(path):
    from lm_eval.api.task import ConfigurableTask

    return ConfigurableTask(config=yaml.safe_load(path.read_text()))


@pytest.fixture(scope="module")
def task_dir(shared_data, tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("tasks")
    assert cli_main(["lm-eval-tasks", "--data-dir", str(shared_data / "eval"), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield mp


def test_all_files_written(task_dir):
    names = {p.stem for p in task_dir.glob("*.yaml")}
    assert names == set(TASKS) | {GROUP}
    group = yaml.safe_load((task_dir / f"{GROUP}.yaml").read_text())
    assert group["task"] == list(TASKS)


@pytest.mark.parametrize("name", ["local_arc_easy", "local_piqa"])
def test_simple_templates(task_dir, name):
    task = _task(task_dir / f"{name}.yaml")
    docs = list(itertools.islice(task.validation_docs(), N_DOCS))
    for doc in docs:
        choices = task.doc_to_choice(doc)
        target = task.doc_to_target(doc)
        assert task.doc_to_text(doc).startswith("Question: ")
        assert isinstance(target, int) and 0 <= target < len(choices)
        if name == "local_arc_easy":
            assert choices == doc["choices"]["text"]
            assert doc["choices"]["label"][target] == doc["answerKey"]
        else:
            assert choices == [doc["sol1"], doc["sol2"]] and target == doc["label"]


def test_hellaswag_matches_builtin_preprocessing(task_dir):
    from lm_eval.tasks.hellaswag import utils as hs

    task = _task(task_dir / "local_hellaswag.yaml")
    all_docs = task.validation_docs()
    wikihow = all_docs.select(range(3200, 3600))  # the WikiHow part, with its [title]/[step] artefacts
    bracketed = [d for d in wikihow if "[" in d["ctx"] or any("[" in e for e in d["endings"])]
    assert len(bracketed) > 100  # the clean-up is exercised
    bracketed = bracketed[:120]
    docs = list(itertools.islice(all_docs, N_DOCS)) + bracketed
    for doc in docs:
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        assert task.doc_to_text(doc) == hs.preprocess(doc["activity_label"] + ": " + ctx)
        assert task.doc_to_choice(doc) == [hs.preprocess(e) for e in doc["endings"]]
        assert task.doc_to_target(doc) == int(doc["label"])


def test_winogrande_matches_builtin_partial_scoring(task_dir):
    from lm_eval.tasks.winogrande import preprocess_winogrande as wg

    task = _task(task_dir / "local_winogrande.yaml")
    for doc in itertools.islice(task.validation_docs(), N_DOCS):
        assert task.doc_to_text(doc) == wg.doc_to_text(doc)
        assert task.doc_to_choice(doc) == wg.doc_to_choice(doc)
        assert task.doc_to_target(doc) == wg.doc_to_target(doc)


def test_missing_data_is_a_clear_error(tmp_path):
    (tmp_path / "piqa").mkdir()
    with pytest.raises(TaskDataError, match="ai2_arc/ARC-Easy/validation"):
        write_lm_eval_tasks(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="unknown task"):
        write_lm_eval_tasks(tmp_path, tmp_path / "out", tasks=["arc_easy"])
