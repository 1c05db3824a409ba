"""Running a plan: the data steps once, then every run's train / convert / evaluate / geometry steps
on lanes side by side (`python -m studies run`).

Every run uses its plan's config, the same data, tokenizer and data order (`data.seed`, fixed); a
run's seed is `train.seed`, which sets the model's initialisation only (no dropout in these
configs). Each step is a `megatron-lev` command run through `StepRunner`; the runs' steps are split
over lanes, each a subprocess (`python -m studies lane`) with one thread and its own `StepRunner`
over the same output directory (distinct step names), so an interrupted study resumes where it
stopped. The step commands are the package's own, so a study directory started by an earlier
checkout's `python -m studies run` goes on here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lev.ckpt.layout import tag_for
from megatron_lev.demo.steps import Step, StepFailed, StepRunner, read_marker
from megatron_lev.errors import ConfigError, UserError
from megatron_lev.experiments.small import SmallGrid, check_finished_steps
from megatron_lev.utils.io import atomic_write_json
from studies.plans import (
    LAMBADA_MAX_PASSAGES,
    Plan,
    StudyRun,
    assign_lanes,
    cooldown_name,
    get_plan,
    select_runs,
    stage_suffix,
)

REPO = Path(__file__).resolve().parents[1]  # a lane runs `python -m studies` with this on its path


@dataclass
class Study:
    """Where the study reads and writes, and which runs it runs."""

    data_dir: Path
    out: Path
    config: Path | None = None  # None: the plan's
    lanes: int = 2
    runs: list[str] = field(default_factory=list)  # run names; empty: all
    lambada_max_passages: int = LAMBADA_MAX_PASSAGES
    plan: str = "study"  # a key of PLANS
    tokenizer: Path | None = None  # None: a SentencePiece model trained on the split (plans without a hint)
    max_stage: int | None = None  # a staged plan: run its stages up to this iteration only (None: all)

    def __post_init__(self) -> None:
        self.data_dir, self.out = Path(self.data_dir), Path(self.out)
        spec = get_plan(self.plan)
        if self.config is None:
            self.config = spec.config
        if spec.tokenizer_hint and self.tokenizer is None:
            raise ConfigError(
                f"the {spec.name} plan uses a given tokenizer: pass --tokenizer "
                f"<shared data>/{spec.tokenizer_hint}"
            )
        if self.max_stage is not None and self.max_stage not in spec.stages:
            raise ConfigError(
                f"--max-stage {self.max_stage}: not a stage of the {spec.name} plan "
                + (f"({', '.join(map(str, spec.stages))})" if spec.stages else "(it has no stages)")
            )
        chars = spec.max_chars_per_subset
        sized = {} if chars is None else {"max_chars_per_subset": chars}
        self.grid = SmallGrid(
            self.data_dir,
            self.out,
            **sized,
            variants=list(dict.fromkeys(v for _, v, _, _ in spec.groups)),
            config=self.config,
            threads=1,
            tokenizer=Path(self.tokenizer) if self.tokenizer is not None else None,
        )

    @property
    def spec(self) -> Plan:
        return get_plan(self.plan)

    @property
    def selected(self) -> list[StudyRun]:
        return select_runs(self.runs, self.plan)

    def run_dir(self, run: StudyRun) -> Path:
        return self.out / "runs" / run.name

    @property
    def lambada_file(self) -> Path:
        return self.grid.data / "lambada.jsonl"

    def check(self) -> None:
        """The grid's checks, then every selected run's config through the trainer's validation."""
        import torch

        from megatron_lev.plan import validate_run

        if self.lanes < 1:
            raise ConfigError(f"--lanes {self.lanes}: must be an integer >= 1")
        self.grid.check(variants=False)  # the runs carry their own overrides (e.g. ALBERT-32's width)
        vocab = self.grid.tokenizer_vocab()
        for run in self.selected:
            validate_run(self.run_config(run), 1, cuda=torch.cuda.is_available(), tokenizer_vocab=vocab)

    def run_config(self, run: StudyRun):
        return self.grid.run_config(run.variant, self.run_dir(run), run.overrides)

    def data_steps(self) -> list[Step]:
        env = self.grid._env()
        if not self.spec.lambada:
            return self.grid.data_steps()
        return self.grid.data_steps() + [
            Step(
                "lambada",
                "cut LAMBADA-format passages from the held-out zero-shot documents",
                lambda: self.grid._python(
                    "megatron_lev.experiments.corpus",
                    "lambada",
                    "--input",
                    str(self.grid.data / "zero_shot.jsonl"),
                    "--out",
                    str(self.lambada_file),
                    "--max-passages",
                    str(self.lambada_max_passages),
                ),
                lambda: [self.lambada_file],
                env,
            )
        ]

    def run_steps(self, run: StudyRun) -> list[Step]:
        """The run's steps: train, convert, evaluate, geometry; for a staged plan, train (resuming the
        previous stage), convert that stage's checkpoint and evaluate it, per stage, then geometry.
        Every stage runs the full run's command with `train.exit_interval` at the stage length, so the
        data order (whose shuffle depends on the run's length) and the schedule are the full run's."""
        lambada = self.lambada_file if self.spec.lambada else None
        stages = self.spec.stages
        if not stages:
            return self.grid.run_steps(
                run.name,
                run.variant,
                self.run_dir(run),
                run.overrides,
                label=run.group,
                lambada=lambada,
                geometry=True,
            )
        if stages != tuple(stages[0] * (k + 1) for k in range(len(stages))):
            raise ConfigError(f"the {self.spec.name} plan's stages {stages} are not evenly spaced")
        length = (
            f"train.train_tokens={stages[-1] * self.spec.tokens_per_step}",
            f"train.exit_interval={stages[0]}",
        )
        steps = []
        for n in stages:
            if self.max_stage is not None and n > self.max_stage:
                break
            stage = self.grid.run_steps(
                run.name,
                run.variant,
                self.run_dir(run),
                (*run.overrides, *length),
                label=f"{run.group} at {n} steps",
                lambada=lambada,
                geometry=n == stages[-1],
                stage=stage_suffix(n),
                tag=tag_for(n),
            )
            # the branch right after the stage's training (before the next stage moves on from its
            # checkpoint), and evaluated before the stage: a session that stops early keeps the branch
            cool = self.cooldown_steps(run, n) if self.spec.cooldown else []
            steps += stage[:1] + cool + stage[1:]
        return steps

    def cooldown_steps(self, run: StudyRun, stage: int) -> list[Step]:
        """Train, export and evaluate the cool-down branch of `run` from its checkpoint at `stage`:
        the run's command (so the same data order and the same rates up to `stage`) resumed from that
        checkpoint into its own directory, with a WSD schedule that decays linearly to the floor
        (`train.min_lr`) over the plan's share of the stage's steps. The trainer accepts it as a branch
        (every past update had the rate the new schedule gives it) without `--allow-change`."""
        decay = self.spec.cooldown_iters(stage)
        branch = (
            f"train.train_tokens={(stage + decay) * self.spec.tokens_per_step}",
            "train.lr_decay_style=wsd",
            f"train.lr_wsd_decay_iters={decay}",
            "train.lr_wsd_decay_style=linear",
            f"train.load={self.run_dir(run) / 'checkpoints' / tag_for(stage)}",
        )
        name = cooldown_name(run, stage)
        return self.grid.run_steps(
            name,
            run.variant,
            self.out / "runs" / name,
            (*run.overrides, *branch),
            label=f"{run.group} cooled down from {stage} steps",
        )

    def all_steps(self) -> list[Step]:
        return self.data_steps() + [s for run in self.selected for s in self.run_steps(run)]

    def lane_command(self, lane: int, runs: list[StudyRun]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "studies",
            "lane",
            "--data-dir",
            str(self.data_dir),
            "--out",
            str(self.out),
            "--config",
            str(self.config),
            "--plan",
            self.plan,
            *(["--tokenizer", str(self.tokenizer)] if self.tokenizer is not None else []),
            *(["--max-stage", str(self.max_stage)] if self.max_stage is not None else []),
            "--lane",
            str(lane),
            "--runs",
            *(r.name for r in runs),
        ]


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _file_log(path: Path):
    """A StepRunner log that appends to `path` (each step's command and status)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        with open(path, "a") as f:
            f.write(msg + "\n")

    return log


def _print(msg: str) -> None:
    print(msg, flush=True)


def run_lane(study: Study, lane: int, log=_print) -> None:
    """Run (or resume) the steps of the selected runs, one line per finished step; a failed step
    raises StepFailed naming its run, the step and its log."""
    os.environ["MEGATRON_LEV_DEMO_QUIET"] = "1"  # the commands' output goes to their logs only
    runner = StepRunner(study.out, log=_file_log(study.out / "logs" / f"lane-{lane}.log"))
    start = time.time()
    for run in study.selected:
        for step in study.run_steps(run):
            skipped = runner.is_done(step)
            try:
                runner.run([step])
            except StepFailed as exc:
                raise StepFailed(f"run {run.name}: {exc}", exc.tail) from None
            what = "already done" if skipped else f"done in {runner.timings[step.name]:.0f}s"
            log(f"[lane {lane}] {_clock(time.time() - start)} {step.name}: {what}")


def _relay(proc: subprocess.Popen, lane: int, log, last: dict[int, str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.strip():
            last[lane] = line
        log(line)


def _stop(procs: list[subprocess.Popen], grace: float = 60.0) -> None:
    """SIGTERM to each running lane's process group (the lane and its command: a training saves a
    checkpoint and exits), then SIGKILL after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


PLAN_FILE = "plan.json"  # in a study directory: which plan's runs it holds


def recorded_plan(out: Path) -> str | None:
    """The plan whose runs `out` holds (`study run` records it), or None for a directory from before
    the record."""
    rec = read_marker(Path(out) / PLAN_FILE)
    return rec.get("plan") if rec else None


def claim_plan(out: Path, plan: str) -> None:
    """Record `plan` as the one `out` holds; refuse another plan's directory. The plans share run names
    (tied-s1234 is in the study, the pilot and the regime), so a second plan would take the first's
    finished runs as its own."""
    held = recorded_plan(out)
    if held is not None and held != plan:
        raise UserError(
            f"--out {out}: holds the runs of the {held} plan; give --plan {held} to go on with it, or "
            f"another --out for the {plan} plan"
        )
    if held is None:
        Path(out).mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(out) / PLAN_FILE, {"plan": plan})


def run_study(study: Study, log=print, poll: float = 1.0) -> list[list[StudyRun]]:
    """Data steps here, then the selected runs on `study.lanes` lanes side by side (subprocesses with
    OMP_NUM_THREADS=1); a failing lane stops the others and raises with its run and log."""
    study.check()
    claim_plan(study.out, study.spec.name)
    runner = StepRunner(study.out, log=_file_log(study.out / "logs" / "data.log"))
    check_finished_steps(runner.state_dir, study.all_steps())
    start = time.time()
    quiet = os.environ.get("MEGATRON_LEV_DEMO_QUIET")
    os.environ["MEGATRON_LEV_DEMO_QUIET"] = "1"  # the commands' output goes to their logs only
    try:
        for step in study.data_steps():
            skipped = runner.is_done(step)
            runner.run([step])
            what = "already done" if skipped else f"done in {runner.timings[step.name]:.0f}s"
            log(f"[data] {_clock(time.time() - start)} {step.name}: {what}")
    finally:
        if quiet is None:
            os.environ.pop("MEGATRON_LEV_DEMO_QUIET")
        else:
            os.environ["MEGATRON_LEV_DEMO_QUIET"] = quiet
    lanes = [lane for lane in assign_lanes(study.selected, study.lanes, study.plan) if lane]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRON_LEV_DEMO_QUIET": "1"}
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # CPU trainers keep their step's large buffers in the heap (utils/host_malloc.py: 1.45-1.57x less
    # CPU time per step over GPT-NeoX's vocabulary, bit-identical losses, more resident memory)
    env.setdefault("MEGATRON_LEV_HOST_MALLOC", "1")
    procs, threads, last = [], [], {}
    try:
        for k, runs in enumerate(lanes, 1):
            log(f"[lane {k}] runs: {' '.join(r.name for r in runs)}")
            p = subprocess.Popen(
                study.lane_command(k, runs),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                env=env,
                start_new_session=True,  # its own process group: stopped with its command
            )
            procs.append(p)
            t = threading.Thread(target=_relay, args=(p, k, log, last), daemon=True)
            t.start()
            threads.append(t)
        while True:
            failed = [(k, p) for k, p in enumerate(procs, 1) if p.poll() not in (None, 0)]
            if failed:
                k, p = failed[0]
                _stop(procs)
                for t in threads:
                    t.join(timeout=5)
                raise StepFailed(
                    f"lane {k} failed (exit status {p.returncode}): {last.get(k, 'no output')}; the other "
                    "lanes were stopped; fix the cause and run the same command again: finished steps "
                    "are skipped"
                )
            if all(p.poll() == 0 for p in procs):
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    for t in threads:
        t.join(timeout=5)
    log(f"study: {len(study.selected)} run(s) finished in {_clock(time.time() - start)}; {study.out}")
    return lanes
