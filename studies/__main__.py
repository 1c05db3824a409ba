"""`python -m studies`: the study runner and its report writers, run from a checkout's root.

python -m studies plan [--plan pilot]
python -m studies run --data-dir ../shared/data/minipile --out runs/study --lanes 2
python -m studies run --plan pilot --data-dir ../shared/data/minipile --out runs/pilot
python -m studies collect runs/pilot results/pilot/raw    # the plan `run` recorded in runs/pilot
python -m studies rows runs/clip results/clip/raw          # Adam's state of the output rows
python -m studies calibrate runs/cooldown results/cooldown/raw   # zero-shot NLL by softmax temperature
python -m studies report results/study/raw docs/results/study

A study directory that an earlier checkout's `python -m studies run` started is the same here: the
same `plan.json`, `.steps/` markers, run names and step commands, so `collect` and `report` read it
and `run` goes on with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "python -m studies"


def _plan_arg(p: argparse.ArgumentParser, default: str | None = "study", recorded: str = "in OUT") -> None:
    from studies.plans import PLANS

    p.add_argument(
        "--plan",
        default=default,
        choices=sorted(PLANS),
        help="which runs: "
        + "; ".join(f"{k}: {v.about}" for k, v in PLANS.items())
        + ("" if default else f" (default: the plan recorded {recorded})"),
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
    p.add_argument(
        "--max-stage",
        type=int,
        default=None,
        metavar="N",
        help="a staged plan: its stages up to iteration N only (the same command without it goes on)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="The study runner: plans of seeded runs on resumable lanes, their raw files and "
        "reports. Errors print one line; --debug shows the traceback.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    sub = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    _plan_arg(sub.add_parser("plan", help="print the plan's runs"))
    run = sub.add_parser(
        "run",
        help="data steps once, then every run's train/convert/evaluate/geometry on lanes (resumable)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _run_args(run)
    run.add_argument("--lanes", type=int, default=2, help="runs side by side, one thread each")
    lane = sub.add_parser("lane", help="one lane of `run` (started by it)")
    _run_args(lane)
    lane.add_argument("--lane", type=int, required=True)
    collect = sub.add_parser("collect", help="copy every finished run's small raw files into RAW_DIR")
    collect.add_argument("out", metavar="OUT", help="the study directory (--out of run)")
    collect.add_argument("raw", metavar="RAW_DIR", help="where the raw files go (RAW_DIR/<run>/)")
    _plan_arg(collect, default=None)
    rows = sub.add_parser(
        "rows", help="Adam's state of the output rows by training count, from each collected run's checkpoint"
    )
    rows.add_argument("out", metavar="OUT", help="the study directory (--out of run)")
    rows.add_argument(
        "raw", metavar="RAW_DIR", help="the collected raw files (RAW_DIR/<run>/output_rows.json)"
    )
    rows.add_argument("--tag", default=None, help="checkpoint tag (default: each run's latest)")
    cal = sub.add_parser(
        "calibrate",
        help="a staged study's checkpoints on its zero-shot corpus at a grid of softmax temperatures",
    )
    cal.add_argument("out", metavar="OUT", help="the study directory (--out of run)")
    cal.add_argument("raw", metavar="RAW_DIR", help="the collected raw files; records go beside them")
    cal.add_argument("--runs", nargs="+", default=None, metavar="NAME", help="only these runs")
    cal.add_argument("--seq-len", type=int, default=256, help="as the study's evaluate step")
    report = sub.add_parser("report", help="every table of the write-up from RAW_DIR alone")
    report.add_argument("raw", metavar="RAW_DIR")
    report.add_argument("out", metavar="OUT_DIR")
    report.add_argument("--no-plots", action="store_true", help="markdown only")
    _plan_arg(report, default=None, recorded="in RAW_DIR/study.json; another is refused")
    return parser


def _study(args: argparse.Namespace, lanes: int = 1):
    from studies.runner import Study

    extra = {"config": Path(args.config)} if args.config else {}
    if args.tokenizer:
        extra["tokenizer"] = Path(args.tokenizer)
    if args.max_stage is not None:
        extra["max_stage"] = args.max_stage
    return Study(
        Path(args.data_dir), Path(args.out), lanes=lanes, runs=list(args.runs), plan=args.plan, **extra
    )


def report_writer(plan: str):
    """The report writer of a plan: `write(raw_dir, out_dir, plots=...) -> {page: path}`."""
    if plan == "pilot":
        from studies.pilot_report import write_pilot_report as write
    elif plan == "regime":
        from studies.regime_report import write_regime_report as write
    elif plan == "order":
        from studies.regime_report import write_order_report as write
    elif plan == "clip":
        from studies.clip_report import write_clip_report as write
    elif plan == "budget":
        from studies.budget_report import write_budget_report as write
    elif plan == "lr":
        from studies.lr_report import write_lr_report as write
    elif plan == "eps":
        from studies.eps_report import write_eps_report as write
    elif plan == "controls":
        from studies.controls_report import write_controls_report as write
    elif plan == "cooldown":
        from studies.cooldown_report import write_cooldown_report as write
    else:
        from studies.study_report import write_report as write
    return write


def _report(args: argparse.Namespace) -> int:
    from megatron_lev.errors import UserError

    listing = Path(args.raw) / "study.json"
    plan = (
        json.loads(listing.read_text(encoding="utf-8")).get("plan", "study") if listing.is_file() else "study"
    )
    if args.plan is not None and args.plan != plan:
        raise UserError(f"{args.raw}: holds the runs of the {plan} plan, not {args.plan}")
    paths = report_writer(plan)(Path(args.raw), Path(args.out), plots=not args.no_plots)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def run(args: argparse.Namespace) -> int:
    from studies import collect, plans, runner

    if args.action == "plan":
        print(plans.plan_markdown(plan=args.plan), end="")
        print(f"{len(plans.study_plan(args.plan))} runs")
        return 0
    if args.action == "run":
        runner.run_study(_study(args, args.lanes), log=lambda msg: print(msg, flush=True))
        return 0
    if args.action == "lane":
        runner.run_lane(_study(args), args.lane)
        return 0
    if args.action == "rows":
        from studies.output_rows import collect_rows

        collect_rows(Path(args.out), Path(args.raw), tag=args.tag)
        return 0
    if args.action == "calibrate":
        from studies.calibrate import calibrate_study

        calibrate_study(
            Path(args.out), Path(args.raw), args.runs, args.seq_len, log=lambda m: print(m, flush=True)
        )
        return 0
    if args.action == "collect":
        collect.collect_study(Path(args.out), Path(args.raw), plan=args.plan)
        return 0
    return _report(args)


def main(argv: list[str] | None = None) -> int:
    from megatron_lev.cli import run_guarded

    args = build_parser().parse_args(argv)
    return run_guarded(f"{PROG} {args.action}", lambda: run(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
