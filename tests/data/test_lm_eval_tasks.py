"""The local task YAMLs render the same prompts and choices as lm-eval's built-in definitions."""

from __future__ import annotations

import itertools
import json

import pytest
import yaml

from megatron_lev.cli import main as cli_main
from megatron_lev.data.lm_eval_tasks import GROUP, TASKS, TaskDataError, write_lm_eval_tasks

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


# ------------------------------------------------------------------------------------------ LAMBADA

LAMBADA_TEXTS = [
    "she looked at the old map and pointed to the harbour",
    "one",
    "he wrote \u201cthe end\u201d on the last page",
]


def _lambada_task(path):
    task = _task(path)
    return task, list(task.test_docs())


def test_lambada_task_reads_a_clean_jsonl_in_place(tmp_path, monkeypatch_module):
    from megatron_lev.data.lm_eval_tasks import LAMBADA_TASK
    from megatron_lev.data.zero_shot_formats import read_lambada

    src = tmp_path / "lambada_test.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA_TEXTS))
    written = write_lm_eval_tasks(None, tmp_path / "tasks", lambada=src)
    assert [p.name for p in written] == [f"{LAMBADA_TASK}.yaml", f"{GROUP}.yaml"]
    cfg = yaml.safe_load(written[0].read_text())
    assert cfg["dataset_kwargs"]["data_files"]["test"] == str(src.resolve())  # the file itself
    assert cfg["output_type"] == "loglikelihood"
    assert [m["metric"] for m in cfg["metric_list"]] == ["perplexity", "acc"]
    assert yaml.safe_load(written[1].read_text())["task"] == [LAMBADA_TASK]
    task, docs = _lambada_task(written[0])
    passages = read_lambada(src)
    assert task.OUTPUT_TYPE == "loglikelihood" and len(docs) == len(passages) == 3
    for doc, p in zip(docs, passages):
        assert (task.doc_to_text(doc), task.doc_to_target(doc)) == (p.context, p.target)


def test_lambada_plain_text_is_normalised_for_lm_eval(tmp_path, monkeypatch_module):
    from megatron_lev.data.zero_shot_formats import read_lambada

    src = tmp_path / "lambada.txt"
    src.write_text("a passage whose last word follows\ttwo  spaces\n\nanother passage ends here  \n")
    (task_yaml, _) = write_lm_eval_tasks(None, tmp_path / "tasks", lambada=src)
    data = yaml.safe_load(task_yaml.read_text())["dataset_kwargs"]["data_files"]["test"]
    assert data == str((tmp_path / "tasks" / "local_lambada.jsonl").resolve())
    task, docs = _lambada_task(task_yaml)
    passages = read_lambada(src)
    assert [p.target for p in passages] == [" spaces", " here"]
    assert [(task.doc_to_text(d), task.doc_to_target(d)) for d in docs] == [
        (p.context, p.target) for p in passages
    ]


def test_lambada_joins_the_downstream_group(shared_data, tmp_path, monkeypatch_module):
    src = tmp_path / "l.txt"
    src.write_text("\n".join(LAMBADA_TEXTS) + "\n")
    out = tmp_path / "tasks"
    argv = [
        "lm-eval-tasks",
        "--data-dir",
        str(shared_data / "eval"),
        "--lambada",
        str(src),
        "--out",
        str(out),
    ]
    assert cli_main(argv) == 0
    group = yaml.safe_load((out / f"{GROUP}.yaml").read_text())
    assert group["task"] == [*TASKS, "local_lambada"]  # the paper's six downstream tasks
