"""The cool-down plan's temperature follow-up (`docs/results/cooldown/calibration.md`): each
checkpoint's zero-shot loss at T = 1 and at a cross-fitted temperature, its entropy, and the two
readings `docs/results/cooldown/README.md` fixed before the measurement: (a) the LEV seed gap and
(b) LEV - TIED on the rarest targets, at T = 1 and cross-fitted.

python -m studies calibrate runs/cooldown results/cooldown/raw   # the records
python -m studies report results/cooldown/raw docs/results/cooldown
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_lev.analysis.calibration import best_temperature, cross_fitted, mean_entropy, mean_nll_at
from megatron_lev.analysis.perplexity import bucket_labels
from studies.calibrate import EVAL, RECORD, check_record, read_record, text_result
from studies.plan_raw import paired_differences, seed_interval
from studies.plans import PLANS

PLAN = PLANS["cooldown"]
SEEDS = (1234, 1235)
BRANCHES = {"constant": "", "cooled": "-cool"}
RAREST = 0  # the paper's bucket below 1e-7
ALL = None


def records(raw: Path) -> dict[tuple[str, str, int], dict]:
    """{(run, branch, stage): record} of every temperature record in `raw`, each checked against the
    evaluation beside it."""
    out = {}
    for run_dir in sorted(p for p in raw.iterdir() if p.is_dir()):
        for branch, kind in BRANCHES.items():
            for n in PLAN.stages:
                path = run_dir / RECORD.format(kind=kind, n=n)
                if path.is_file():
                    record = read_record(path)
                    check_record(record, text_result(run_dir / EVAL.format(kind=kind, n=n)), path)
                    out[(run_dir.name, branch, n)] = record
    return out


def as_result(record: dict, how: str) -> dict:
    """A record as the per-document result `paired_differences` reads: at T = 1 (`how="t1"`) or at
    the cross-fitted temperature (`how="cf"`)."""
    if how == "t1":
        i = record["temperatures"].index(1.0)  # on the grid: `records` checked it
        nll, bucket = record["nll_sum"][i], record["bucket_nll_sum"][i]
    else:
        fit = cross_fitted(record)
        nll, bucket = fit["nll_sum"].tolist(), fit["bucket_nll_sum"].tolist()
    doc = {
        "tokens": record["tokens"],
        "nll_sum": nll,
        "bucket_tokens": record["bucket_tokens"],
        "bucket_nll_sum": bucket,
    }
    return {"name": record.get("run", "?"), "per_document": doc}


def difference(a: dict, b: dict, how: str, bucket: int | None) -> tuple[float, tuple[float, float] | None]:
    """Mean NLL of `a` minus `b` (records over the same documents) and its document interval."""
    diffs, ci = paired_differences(
        [(as_result(a, how), as_result(b, how))], None if bucket is None else ("bucket", bucket)
    )
    return (diffs[0] if diffs else float("nan")), ci


def _cell(v: float, ci) -> str:
    return f"{v:+.3f}" if ci is None else f"{v:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _below(ci) -> bool:
    return ci is not None and ci[1] < 0


READ_STAGES = PLAN.stages[:2]  # the stages the readings need on both seeds (stages 3-4: seed 1234 only)


def reading_a(have: dict) -> tuple[str, list[tuple]]:
    """(a): G and Gc at every constant-rate stage both LEV seeds have; the reading, at stages 1 and 2."""
    rows = []
    for n in PLAN.stages:
        pair = [have.get((f"lev-s{s}", "constant", n)) for s in (1235, 1234)]
        if None in pair:
            continue
        g, gci = difference(*pair, "t1", ALL)
        gc, gcci = difference(*pair, "cf", ALL)
        rows.append((n, g, gc, gci, gcci))
    read = [r for r in rows if r[0] in READ_STAGES]
    if len(read) < len(READ_STAGES):
        return "open (needs both LEV seeds at stages 1 and 2)", rows
    if any(g <= 0 for _, g, *_ in read):
        return "open (G is not positive at every stage: the rule assumes seed 1235 behind)", rows
    if all(abs(gc) <= g / 3 for _, g, gc, *_ in read):
        return "sharpness explains it", rows
    if any(gc >= 2 * g / 3 for _, g, gc, *_ in read):
        return "it does not", rows
    return "partly", rows


def reading_b(have: dict) -> tuple[str, list[tuple]]:
    """(b): D and Dc below 1e-7 per seed, branch and stage that both sides have; the reading over
    those where D's interval lies below zero, once both seeds have stages 1 and 2 in both branches."""
    rows = []
    for seed in SEEDS:
        for branch in BRANCHES:
            for n in PLAN.stages:
                lev, tied = have.get((f"lev-s{seed}", branch, n)), have.get((f"tied-s{seed}", branch, n))
                if lev is None or tied is None:
                    continue
                d, dci = difference(lev, tied, "t1", RAREST)
                dc, dcci = difference(lev, tied, "cf", RAREST)
                rows.append((seed, branch, n, d, dci, dc, dcci))
    present = {(seed, branch, n) for seed, branch, n, *_ in rows}
    if any((s, b, n) not in present for s in SEEDS for b in BRANCHES for n in READ_STAGES):
        return "open (needs TIED and LEV of both seeds at stages 1 and 2, constant and cooled)", rows
    if any(r[4] is None or r[6] is None for r in rows):
        return "open (a resample held no target below 1e-7)", rows
    led = [r for r in rows if _below(r[4])]
    if not led:
        return "no lead at T = 1 to read", rows
    if all(not _below(r[6]) for r in led):
        return "the lead is sharpness", rows
    if all(_below(r[6]) for r in led):
        return "the lead survives calibration", rows
    return "mixed", rows


def report(raw: Path, have: dict | None = None) -> str:
    """The page; `have`: the records of `raw` when the caller has read them already."""
    have = records(raw) if have is None else have
    a, a_rows = reading_a(have)
    b, b_rows = reading_b(have)
    lines = [
        "# Zero-shot loss by softmax temperature: is the seed's effect on LEV sharpness?",
        "",
        "Written by `python -m studies report results/cooldown/raw docs/results/cooldown` from the "
        "temperature records `python -m studies calibrate runs/cooldown results/cooldown/raw` wrote "
        "(`studies/calibration_report.py`). The zero-shot corpus (never trained on), every predicted "
        "token; nats per token. `T = 1`: the model as it is; cross-fitted: each document scored at the "
        "grid temperature that minimises the loss of the documents of the other parity. Brackets: "
        "document-bootstrap 95% (1000 resamples, seed 0). The readings are the README's, fixed before "
        "the measurement.",
        "",
        "## Readings",
        "",
        f"- **(a) the LEV seed gap**: {a}.",
        f"- **(b) LEV - TIED below 1e-7**: {b}.",
        "",
        "## Each checkpoint",
        "",
        "| run | branch | stage | NLL at T = 1 | cross-fitted | fitted T (even, odd docs) | "
        "best T (all docs) | entropy at T = 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (run, branch, n), rec in sorted(have.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        fit = cross_fitted(rec)
        cf = float(np.sum(fit["nll_sum"]) / np.sum(rec["tokens"]))
        lines.append(
            f"| {run} | {branch} | {n:,} | {mean_nll_at(rec):.3f} | {cf:.3f} | "
            f"{fit['fit'][0]:.2f}, {fit['fit'][1]:.2f} | {best_temperature(rec):.2f} | "
            f"{mean_entropy(rec):.3f} |"
        )
    lines += [
        "",
        "## (a) LEV seed 1235 - LEV seed 1234, overall, constant rate",
        "",
        "| stage | G at T = 1 | Gc cross-fitted | Gc / G |",
        "|---|---|---|---|",
    ]
    for n, g, gc, gci, gcci in a_rows:
        ratio = f"{gc / g:+.2f}" if g else "-"
        lines.append(f"| {n:,} | {_cell(g, gci)} | {_cell(gc, gcci)} | {ratio} |")
    lines += _spread(have)
    lines += [
        "",
        "## (b) LEV - TIED below 1e-7, per seed",
        "",
        "| seed | branch | stage | D at T = 1 | Dc cross-fitted |",
        "|---|---|---|---|---|",
    ]
    for seed, branch, n, d, dci, dc, dcci in b_rows:
        lines.append(f"| {seed} | {branch} | {n:,} | {_cell(d, dci)} | {_cell(dc, dcci)} |")
    lines += [
        "",
        "## LEV - TIED by the paper's buckets, over the seeds (reported, deciding nothing)",
        "",
        "Per seed at T = 1 and cross-fitted; where both seeds have the checkpoint, their mean with a "
        "Student-t interval over the seeds (1 df).",
        "",
        "| target | branch | stage | T = 1 per seed | mean (t, 1 df) | cross-fitted per seed "
        "| mean (t, 1 df) |",
        "|---|---|---|---|---|---|---|",
    ]
    first = next(iter(have.values()), None)
    labels = ["overall"] + (bucket_labels(tuple(first["bucket_edges"])) if first else [])
    for k, label in enumerate(labels):
        bucket = None if k == 0 else k - 1
        for branch in BRANCHES:
            for n in PLAN.stages:
                cells = []
                for how in ("t1", "cf"):
                    per = []
                    for seed in SEEDS:
                        lev, tied = (
                            have.get((f"lev-s{seed}", branch, n)),
                            have.get((f"tied-s{seed}", branch, n)),
                        )
                        if lev is not None and tied is not None:
                            per.append((seed, difference(lev, tied, how, bucket)[0]))
                    if not per:
                        break
                    ci = seed_interval([v for _, v in per])
                    mean = sum(v for _, v in per) / len(per)
                    cells += [
                        ", ".join(f"{v:+.3f} ({s})" for s, v in per),
                        _cell(mean, ci) if ci is not None else "-",
                    ]
                if len(cells) == 4:
                    lines.append(f"| {label} | {branch} | {n:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _spread(have: dict, top: int = 10) -> list[str]:
    """Where the LEV seed gap sits among the documents: the share of documents worse on seed 1235,
    the median per-token difference of a document, and the share of the total difference the `top`
    documents that move most carry; at T = 1 and cross-fitted, with the T = 1 entropy of the first
    200 documents (the look that prompted the follow-up)."""
    lines = [
        "",
        "### Where G sits among the documents",
        "",
        f"| stage | temperature | documents worse on seed 1235 | median per document | share of G in the "
        f"{top} documents that move most | entropy, first 200 documents (1234, 1235) |",
        "|---|---|---|---|---|---|",
    ]
    for n in PLAN.stages:
        new, old = (have.get((f"lev-s{s}", "constant", n)) for s in (1235, 1234))
        if new is None or old is None:
            continue
        tokens = np.asarray(old["tokens"], dtype=np.float64)
        ent = [float(np.sum(r["entropy_sum"][:200]) / np.sum(r["tokens"][:200])) for r in (old, new)]
        for how, label in (("t1", "T = 1"), ("cf", "cross-fitted")):
            diff = np.asarray(as_result(new, how)["per_document"]["nll_sum"]) - np.asarray(
                as_result(old, how)["per_document"]["nll_sum"]
            )
            per_token = diff[tokens > 0] / tokens[tokens > 0]
            moved = np.sort(diff)[::-1][:top].sum() / diff.sum() if diff.sum() else float("nan")
            lines.append(
                f"| {n:,} | {label} | {np.mean(per_token > 0):.0%} | {np.median(per_token):+.3f} | "
                f"{moved:.0%} | " + (f"{ent[0]:.2f}, {ent[1]:.2f} |" if how == "t1" else "- |")
            )
    return lines
