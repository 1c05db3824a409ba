"""Local lm-eval task files for the downstream benchmarks, so an exported model is evaluated offline.

lm-eval's built-in ARC / PIQA / HellaSwag / WinoGrande tasks download from the hub.
`write_lm_eval_tasks(data_dir, out_dir)` writes equivalent YAMLs (same prompts,
choices and metrics as lm-eval's own definitions, expressed as Jinja templates so no
Python helper is needed) that read the validation splits from local arrow files in
the `datasets.save_to_disk` layout:

    data_dir/ai2_arc/ARC-Easy/validation/data-00000-of-00001.arrow   (and ARC-Challenge)
    data_dir/piqa/plain_text/validation/...
    data_dir/hellaswag/none/validation/...
    data_dir/winogrande/winogrande_xl/validation/...

`local_lambada` is lm-eval's `lambada_openai` (last-word accuracy and perplexity) on a local
file: a `.jsonl` with a `text` per passage (the `lambada_openai` layout) is read where it is;
plain text (one passage per line), or passages whose last word is not after a single space, are
first written as `local_lambada.jsonl` beside the task files, so lm-eval's template splits every
passage as `megatron-lev evaluate --lambada` does.

Task names carry a `local_` prefix so they never clash with lm-eval's built-ins;
the group `local_downstream` runs all the tasks written (ARC x 2, PIQA, HellaSwag, WinoGrande,
and LAMBADA where given: the paper's six).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from megatron_lev.data.zero_shot_formats import is_jsonl, read_lambada
from megatron_lev.errors import UserError
from megatron_lev.utils.io import atomic_write_text

GROUP = "local_downstream"
LAMBADA_TASK = "local_lambada"

_ACC = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
_ACC_NORM = _ACC + [{"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]

# HellaSwag's clean-up of WikiHow artefacts (lm-eval's `preprocess`), as Jinja filters.
_HS_CLEAN = "| trim | replace(' [title]', '. ') | regex_replace('\\\\[.*?\\\\]', '') | replace('  ', ' ')"
_HS_CLEAN_MAP = (
    "| map('trim') | map('replace', ' [title]', '. ') "
    "| map('regex_replace', '\\\\[.*?\\\\]', '') | map('replace', '  ', ' ') | list"
)

# task name -> (arrow directory relative to data_dir, fields of the YAML beyond the common ones)
TASKS: dict[str, tuple[str, dict]] = {
    "local_arc_easy": (
        "ai2_arc/ARC-Easy/validation",
        {
            "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_target": "{{choices.label.index(answerKey)}}",
            "doc_to_choice": "{{choices.text}}",
            "metric_list": _ACC_NORM,
        },
    ),
    "local_arc_challenge": (
        "ai2_arc/ARC-Challenge/validation",
        {
            "doc_to_text": "Question: {{question}}\nAnswer:",
            "doc_to_target": "{{choices.label.index(answerKey)}}",
            "doc_to_choice": "{{choices.text}}",
            "metric_list": _ACC_NORM,
        },
    ),
    "local_piqa": (
        "piqa/plain_text/validation",
        {
            "doc_to_text": "Question: {{goal}}\nAnswer:",
            "doc_to_target": "label",
            "doc_to_choice": "{{[sol1, sol2]}}",
            "metric_list": _ACC_NORM,
        },
    ),
    "local_hellaswag": (
        "hellaswag/none/validation",
        {
            "doc_to_text": "{{ (activity_label ~ ': ' ~ ctx_a ~ ' ' ~ (ctx_b | capitalize)) "
            + _HS_CLEAN
            + " }}",
            "doc_to_target": "{{label}}",
            "doc_to_choice": "{{ endings " + _HS_CLEAN_MAP + " }}",
            "metric_list": _ACC_NORM,
        },
    ),
    # WinoGrande scores the shared continuation after each filled-in prefix ("partial evaluation").
    "local_winogrande": (
        "winogrande/winogrande_xl/validation",
        {
            "doc_to_text": "{{ {'1': 0, '2': 1}[answer] }}",
            "doc_to_target": "{{ sentence[sentence.index('_') + 1:] | trim }}",
            "doc_to_choice": (
                "{{ [sentence[:sentence.index('_')] ~ option1, sentence[:sentence.index('_')] ~ option2] }}"
            ),
            "metric_list": _ACC,
        },
    ),
}


class TaskDataError(UserError, FileNotFoundError):
    """An expected arrow file of the downstream data is missing."""


def arrow_file(data_dir: str | os.PathLike, rel: str) -> Path:
    """The single arrow file of a `save_to_disk` split directory; a clear error if absent."""
    split_dir = Path(data_dir) / rel
    files = sorted(split_dir.glob("data-*.arrow"))
    if not files:
        raise TaskDataError(
            f"no data-*.arrow file in {split_dir} (expected the datasets.save_to_disk layout "
            f"under --data-dir {data_dir})"
        )
    if len(files) > 1:
        raise TaskDataError(f"{split_dir} holds {len(files)} arrow shards; local tasks expect one")
    return files[0]


def task_config(name: str, data_file: Path) -> dict:
    """The lm-eval YAML mapping of task `name` reading its validation split from `data_file`."""
    _, fields = TASKS[name]
    cfg = {
        "task": name,
        "tag": [GROUP + "_tasks"],
        "dataset_path": "arrow",
        "dataset_kwargs": {"data_files": {"validation": str(data_file)}},
        "output_type": "multiple_choice",
        "training_split": None,
        "validation_split": "validation",
        "test_split": None,
    }
    cfg.update(fields)
    cfg["metadata"] = {"version": 1.0}
    return cfg


def lambada_task_config(data_file: Path) -> dict:
    """lm-eval's `lambada_openai` definition (prompt, target, metrics) reading `data_file` (JSONL)."""
    return {
        "task": LAMBADA_TASK,
        "tag": [GROUP + "_tasks"],
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file)}},
        "output_type": "loglikelihood",
        "training_split": None,
        "validation_split": None,
        "test_split": "test",
        "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
        "doc_to_target": "{{' '+text.split(' ')[-1]}}",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }


def lambada_data_file(src: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """The JSONL file the LAMBADA task reads: `src` itself where lm-eval's template splits each of its
    passages as `read_lambada` does, else `out_dir/local_lambada.jsonl` with the passages normalised.
    A file `read_lambada` refuses is refused here too (DataError naming the file and line)."""
    src = Path(src)
    passages = read_lambada(src)
    consecutive = all(p.line == i + 1 for i, p in enumerate(passages))  # no blank lines between
    if is_jsonl(src) and consecutive and all(p.text == p.normalised for p in passages):
        return src.resolve()
    path = Path(out_dir) / f"{LAMBADA_TASK}.jsonl"
    atomic_write_text(path, "".join(json.dumps({"text": p.normalised}) + "\n" for p in passages))
    return path.resolve()


def write_lm_eval_tasks(
    data_dir: str | os.PathLike | None,
    out_dir: str | os.PathLike,
    tasks: list[str] | None = None,
    lambada: str | os.PathLike | None = None,
) -> list[Path]:
    """Write one YAML per task plus the group file into `out_dir`; returns the written paths.

    `data_dir=None` writes none of the arrow tasks; `lambada` (a LAMBADA file) adds `local_lambada`.
    """
    names = (list(TASKS) if tasks is None else tasks) if data_dir is not None else []
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available: {', '.join(TASKS)}")
    if not names and lambada is None:
        raise UserError("no task to write: give the downstream data directory and/or a LAMBADA file")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    configs = []
    if names:
        data_dir = Path(data_dir).resolve()
        configs = [task_config(name, arrow_file(data_dir, TASKS[name][0])) for name in names]
    if lambada is not None:
        configs.append(lambada_task_config(lambada_data_file(lambada, out)))
    written = []
    for cfg in configs:
        path = out / f"{cfg['task']}.yaml"
        atomic_write_text(path, yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True, width=1000))
        written.append(path)
    group = {
        "group": GROUP,
        "task": [cfg["task"] for cfg in configs],
        "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": False}],
        "metadata": {"version": 1.0},
    }
    path = out / f"{GROUP}.yaml"
    atomic_write_text(path, yaml.safe_dump(group, sort_keys=False))
    written.append(path)
    return written
