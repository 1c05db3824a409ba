"""Collecting a plan's results: the small raw files of every finished run of a study directory,
copied into `results/<study>/raw/<run>/` with machine paths scrubbed (`python -m studies collect`).
The report writers read nothing else."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from megatron_lev.demo.steps import read_marker
from megatron_lev.errors import UserError
from megatron_lev.utils.io import atomic_write_json, atomic_write_text
from studies.plans import (
    PLANS,
    RUN_STEPS,
    Plan,
    StudyRun,
    cooldown_name,
    get_plan,
    run_step_names,
    stage_suffix,
    study_plan,
)
from studies.runner import PLAN_FILE, recorded_plan

MAX_RAW_BYTES = 5_000_000  # a raw file larger than this is not a small result file


def _scrub(text: str, out: Path) -> str:
    """The output directory's absolute path written as `<study>`: raw files name no machine path."""
    for prefix in sorted({str(out.resolve()), str(out.absolute())}, key=len, reverse=True):
        text = text.replace(prefix, "<study>")
    return text


def _copy_small(src: Path, dst: Path, out: Path) -> int:
    """Copy one small text result file (paths scrubbed); a checkpoint or a large file is refused."""
    try:
        parts = src.resolve().relative_to(out.resolve()).parts
    except ValueError:
        parts = src.parts
    if "checkpoints" in parts or "hf" in parts or src.suffix in (".pt", ".bin", ".safetensors"):
        raise UserError(f"{src}: a checkpoint or model file; the raw results hold small result files only")
    size = src.stat().st_size
    if size > MAX_RAW_BYTES:
        raise UserError(f"{src}: {size:,} bytes, more than {MAX_RAW_BYTES:,}: not a small result file")
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(dst, _scrub(src.read_text(encoding="utf-8"), out))
    return dst.stat().st_size


def _timing(state_dir: Path, run: StudyRun, plan: str | Plan) -> dict:
    steps = {}
    for kind, step in run_step_names(run, plan).items():
        rec = read_marker(state_dir / f"{step}.json") or {}
        command = list(rec.get("command") or [])
        if command:
            command[0] = "python"
        steps[kind] = {"seconds": rec.get("seconds"), "command": command}
    return {"run": run.name, "threads": 1, "steps": steps}


def vocabulary_buckets(data: Path, edges: tuple[float, ...] | None = None) -> dict | None:
    """What the frequency buckets of the evaluation hold: per bucket of relative training frequency,
    the vocabulary ids and how many are SentencePiece byte-fallback pieces (UTF-8 bytes of characters
    the vocabulary has no piece for) or control/unknown pieces. From the study's SentencePiece model
    and training counts in `data`; None where they are not there."""
    import numpy as np

    from megatron_lev.analysis.perplexity import DEFAULT_EDGES, bucket_labels

    models = sorted(data.glob("spm*.model"))
    counts_file = data / "train_text_document.counts.npy"
    if len(models) != 1 or not counts_file.is_file():
        return None
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(models[0]))
    counts = np.load(counts_file)
    edges = tuple(edges or DEFAULT_EDGES)
    freq = counts / counts.sum()
    bucket = np.searchsorted(edges, freq, side="right")
    rows = []
    for b, label in enumerate(bucket_labels(edges)):
        ids = [int(i) for i in np.flatnonzero(bucket == b)]
        byte = sum(sp.is_byte(i) for i in ids)
        special = sum(sp.is_control(i) or sp.is_unknown(i) for i in ids)
        rows.append(
            {
                "bucket": label,
                "vocab_ids": len(ids),
                "byte_pieces": byte,
                "control_or_unknown": special,
                "other": len(ids) - byte - special,
                "other_examples": [sp.id_to_piece(i) for i in ids if not sp.is_byte(i)][:10],
            }
        )
    return {
        "tokenizer": models[0].name,
        "training_tokens": int(counts.sum()),
        "buckets": rows,
        "note": "vocabulary ids per bucket of relative training frequency; byte_pieces are SentencePiece "
        "byte-fallback pieces (<0x..>)",
    }


def _collected_before(raw: Path, plan: str) -> set[str]:
    """The runs an earlier collection listed in `raw/study.json` whose files are still there: a
    session's lanes hold only that session's runs, and collecting them must not drop the others."""
    listing = raw / "study.json"
    if not listing.is_file():
        return set()
    try:
        held = json.loads(listing.read_text(encoding="utf-8"))
        names = {r["name"] for r in held["runs"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{listing}: unreadable ({exc}); move it away to collect afresh") from exc
    if held.get("plan") != plan:
        raise UserError(
            f"{raw}: holds runs of the {held.get('plan')} plan, not {plan}; give another directory"
        )
    return {n for n in names if (raw / n / "eval.json").is_file()}


def collect_study(out: Path, raw: Path, log=print, plan: str | Plan | None = None) -> dict[str, int]:
    """Copy the small raw files of every finished run of `out` (all four steps done; a staged run
    from its first evaluated stage on, with the stages it has) into `raw/<run>/`, with the data
    split, the LAMBADA passages' summary and the plan; `study.json` lists these runs and those an
    earlier collection into `raw` listed. Returns the bytes written per file (relative name).
    `plan`: None for the one `study run` recorded in `out` (refused for a directory without a
    record); another than the recorded one is refused."""
    out, raw = Path(out), Path(raw)
    state = out / ".steps"
    if not state.is_dir():
        raise UserError(f"{out}: no study here (no .steps directory); give the --out of `study run`")
    held = recorded_plan(out)
    if plan is None and held is None:  # the plans share run names: guessing would mix them up
        raise UserError(
            f"{out}: no record of which plan's runs it holds ({PLAN_FILE}: `study run` writes it since "
            f"the plans share run names); give --plan {'|'.join(PLANS)}"
        )
    if plan is None:
        plan = held
    elif held is not None and get_plan(plan).name != held:
        raise UserError(
            f"{out}: holds the runs of the {held} plan, not {get_plan(plan).name}: give --plan {held}"
        )
    raw_resolved = raw.resolve()
    if raw_resolved == out.resolve() or out.resolve() in raw_resolved.parents:
        raise UserError(f"{raw}: inside the study directory {out}; give another directory")
    sizes: dict[str, int] = {}
    plan_stages = get_plan(plan).stages
    evaluated = {r.name: evaluated_stages(state, r, plan) for r in study_plan(plan)}
    done = {
        r.name: bool(read_marker(state / f"{run_step_names(r, plan)['geometry']}.json"))
        for r in study_plan(plan)
    }
    if plan_stages:  # a staged run counts from its first evaluated stage
        finished = [r for r in study_plan(plan) if evaluated[r.name]]
    else:
        finished = [
            r
            for r in study_plan(plan)
            if all(read_marker(state / f"{step}.json") for step in run_step_names(r, plan).values())
        ]
    if not finished:
        raise UserError(
            f"{out}: no finished run (train, convert, evaluate and geometry all done; for a staged "
            "plan, its first stage's train, convert and evaluate)"
        )
    partial = []
    for run in finished:
        src = out / "runs" / run.name
        stages = [stage_suffix(n) for n in evaluated[run.name]]
        files = {  # a staged run: each evaluated stage's evaluation, and the last one's as eval.json
            **{f"eval{s}.json": src / f"eval{s}" / "eval.json" for s in stages},
            "eval.json": src / f"eval{stages[-1] if stages else ''}" / "eval.json",
            "metrics.jsonl": src / "metrics.jsonl",
            "config.yaml": src / "config.yaml",
        }
        for n in cooled_stages(state, run, plan):  # a cool-down branch: its evaluation and its log
            branch = out / "runs" / cooldown_name(run, n)
            files[f"eval-cool{stage_suffix(n)}.json"] = branch / "eval" / "eval.json"
            files[f"metrics-cool{stage_suffix(n)}.jsonl"] = branch / "metrics.jsonl"
        if done[run.name]:
            files["geometry.json"] = src / "geometry" / "geometry.json"
        if plan_stages and not (done[run.name] and len(stages) == len(plan_stages)):
            partial.append(run.name)
            olds = [f"eval{i}{stage_suffix(n)}.json" for n in plan_stages for i in ("", "-cool")]
            olds += [f"metrics-cool{stage_suffix(n)}.jsonl" for n in plan_stages]
            for stale in ("geometry.json", *olds):
                if stale not in files and (raw / run.name / stale).is_file():  # an earlier collection's
                    (raw / run.name / stale).unlink()
        for name, path in files.items():
            sizes[f"{run.name}/{name}"] = _copy_small(path, raw / run.name / name, out)
        dst = raw / run.name / "timing.json"
        atomic_write_text(dst, _scrub(json.dumps(_timing(state, run, plan), indent=1) + "\n", out))
        sizes[f"{run.name}/timing.json"] = dst.stat().st_size
    split = out / "data" / "split.json"
    if split.is_file():
        sizes["split.json"] = _copy_small(split, raw / "split.json", out)
        record = json.loads((raw / "split.json").read_text(encoding="utf-8"))
        if Path(str(record.get("data_dir", ""))).is_absolute():  # a path of this machine: its last part
            record["data_dir"] = f"<data>/{Path(record['data_dir']).name}"
            atomic_write_json(raw / "split.json", record)
            sizes["split.json"] = (raw / "split.json").stat().st_size
    pieces = vocabulary_buckets(out / "data")
    if pieces is not None:
        atomic_write_json(raw / "vocab_buckets.json", pieces)
        sizes["vocab_buckets.json"] = (raw / "vocab_buckets.json").stat().st_size
    lambada = out / "data" / "lambada.jsonl"
    if lambada.is_file():
        lengths = [len(json.loads(line)["text"].split()) for line in lambada.read_text().splitlines()]
        atomic_write_json(
            raw / "lambada.json",
            {
                "passages": len(lengths),
                "min_words": min(lengths),
                "max_words": max(lengths),
                "mean_words": round(sum(lengths) / len(lengths), 2),
            },
        )
        sizes["lambada.json"] = (raw / "lambada.json").stat().st_size
    listed = {r.name for r in finished} | _collected_before(raw, get_plan(plan).name)
    runs = [r for r in study_plan(plan) if r.name in listed]  # this collection's and earlier ones'
    atomic_write_json(raw / "study.json", {"plan": get_plan(plan).name, "runs": [asdict(r) for r in runs]})
    sizes["study.json"] = (raw / "study.json").stat().st_size
    missing = [r.name for r in study_plan(plan) if r not in runs]
    for name, size in sorted(sizes.items()):
        log(f"{size:>10,}  {name}")
    log(f"{sum(sizes.values()):,} bytes in {len(sizes)} files -> {raw}")
    if missing:
        log(f"not finished (not collected): {' '.join(missing)}")
    for name in partial:
        have = evaluated[name]
        lacks = [n for n in plan_stages if n not in have]
        log(
            f"{name}: partial, evaluated at iterations {', '.join(map(str, have))}"
            + (f"; not at {', '.join(map(str, lacks))}" if lacks else "")
            + ("" if done[name] else "; no geometry")
        )
    return sizes


def cooled_stages(state: Path, run: StudyRun, plan: str | Plan) -> list[int]:
    """The stages (iterations) of a run whose cool-down branch is trained, exported and evaluated (a
    plan with `cooldown`); [] otherwise."""
    names = run_step_names(run, plan)
    return [
        n
        for n in get_plan(plan).stages
        if f"evaluate-cool{stage_suffix(n)}" in names
        and all(read_marker(state / f"{names[f'{k}-cool{stage_suffix(n)}']}.json") for k in RUN_STEPS[:3])
    ]


def evaluated_stages(state: Path, run: StudyRun, plan: str | Plan) -> list[int]:
    """A staged run's stages (iterations) whose train, convert and evaluate steps are all done, from
    the first up to the first that is not (a later stage resumes the earlier ones); [] for a plan
    without stages."""
    names = run_step_names(run, plan)
    have = []
    for n in get_plan(plan).stages:
        if not all(read_marker(state / f"{names[f'{k}{stage_suffix(n)}']}.json") for k in RUN_STEPS[:3]):
            break
        have.append(n)
    return have
