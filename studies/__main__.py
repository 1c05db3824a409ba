"""`megatron-lev study`: the rerun of the small grid with seeds and controls (docs/experiments.md).

megatron-lev study plan [--plan pilot]
megatron-lev study run --data-dir ../shared/data/minipile --out runs/study --lanes 2
megatron-lev study run --plan pilot --data-dir ../shared/data/minipile --out runs/pilot
megatron-lev study collect runs/pilot results/pilot/raw    # the plan study run recorded in runs/pilot
megatron-lev study report results/study/raw docs/results/study
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _plan_arg(p: argparse.ArgumentParser, default: str | None = "study") -> None:
    from megatron_lev.experiments.study import PLANS

    p.add_argument(
        "--plan",
        default=default,
        choices=sorted(PLANS),
        help="which runs: "
        + "; ".join(f"{k}: {v.about}" for k, v in PLANS.items())
        + ("" if default else " (default: the plan `study run` recorded in OUT)"),
    )


def _run_args(p: argparse.ArgumentParser) -> None:
    _plan_arg(p)
    p.add_argument("--data-dir", required=True, help="Pile-format corpus directory (*.jsonl[.zst])")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer file (default: a SentencePiece model trained on the split)",
    )
    p.add_argument("--out", default="runs/study", help="study directory (data, runs, logs, .steps)")
    p.add_argument("--config", default=None, help="run config (default: the study's, study.yaml)")
    p.add_argument("--runs", nargs="+", default=[], metavar="NAME", help="only these runs (study plan)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    _plan_arg(sub.add_parser("plan", help="print the plan's runs"))
    run = sub.add_parser(
        "run",
        help="data steps once, then every run's train/convert/evaluate/geometry on lanes (resumable)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _run_args(run)
    run.add_argument("--lanes", type=int, default=2, help="runs side by side, one thread each")
    lane = sub.add_parser("lane", help="one lane of `study run` (started by it)")
    _run_args(lane)
    lane.add_argument("--lane", type=int, required=True)
    collect = sub.add_parser("collect", help="copy every finished run's small raw files into RAW_DIR")
    collect.add_argument("out", metavar="OUT", help="the study directory (--out of study run)")
    collect.add_argument("raw", metavar="RAW_DIR", help="where the raw files go (RAW_DIR/<run>/)")
    _plan_arg(collect, default=None)
    report = sub.add_parser("report", help="every table of the write-up from RAW_DIR alone")
    report.add_argument("raw", metavar="RAW_DIR")
    report.add_argument("out", metavar="OUT_DIR")
    report.add_argument("--no-plots", action="store_true", help="markdown only")


def _study(args: argparse.Namespace, lanes: int = 1):
    from megatron_lev.experiments.study import Study

    extra = {"config": Path(args.config)} if args.config else {}
    if args.tokenizer:
        extra["tokenizer"] = Path(args.tokenizer)
    return Study(
        Path(args.data_dir), Path(args.out), lanes=lanes, runs=list(args.runs), plan=args.plan, **extra
    )


def main(args: argparse.Namespace) -> int:
    from megatron_lev.experiments import study as s

    if args.action == "plan":
        print(s.plan_markdown(plan=args.plan), end="")
        print(f"{len(s.study_plan(args.plan))} runs")
        return 0
    if args.action == "run":
        s.run_study(_study(args, args.lanes), log=lambda msg: print(msg, flush=True))
        return 0
    if args.action == "lane":
        s.run_lane(_study(args), args.lane)
        return 0
    if args.action == "collect":
        s.collect_study(Path(args.out), Path(args.raw), plan=args.plan)
        return 0
    listing = Path(args.raw) / "study.json"
    plan = (
        json.loads(listing.read_text(encoding="utf-8")).get("plan", "study") if listing.is_file() else "study"
    )
    if plan == "pilot":
        from megatron_lev.experiments.pilot_report import write_pilot_report as write_report
    elif plan == "regime":
        from megatron_lev.experiments.regime_report import write_regime_report as write_report
    elif plan == "order":
        from megatron_lev.experiments.regime_report import write_order_report as write_report
    elif plan == "clip":
        from megatron_lev.experiments.clip_report import write_clip_report as write_report
    else:
        from megatron_lev.experiments.study_report import write_report
    paths = write_report(Path(args.raw), Path(args.out), plots=not args.no_plots)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0
