"""The study: the small grid's six variants rerun with several seeds, equal-scale and centred LEV
controls, a LAMBADA-style task and the embedding geometry at every saved checkpoint.

    plan = study_plan()                              # 19 StudyRun(name, group, variant, seed, overrides)
    run_study(Study(data_dir, out, lanes=2))         # data steps once, then the runs on 2 lanes
    collect_study(out, raw)                          # the small raw files of every finished run
    write_report(raw, out_dir)                       # every table of the write-up, from raw alone

Every run uses the study config (`experiments/small/study.yaml`), the same data, tokenizer and data
order (`data.seed`, fixed); a run's seed is `train.seed`, which sets the model's initialisation only
(no dropout in these configs). Each step is a `megatron-lev` command run through `StepRunner`; the
runs' steps are split over lanes, each a subprocess with one thread and its own `StepRunner` over
the same output directory (distinct step names), so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_lev.config import atomic_write_json, atomic_write_text
from megatron_lev.demo.steps import Step, StepFailed, StepRunner, read_marker
from megatron_lev.errors import ConfigError, UserError
from megatron_lev.experiments.small import SmallGrid, check_finished_steps

STUDY_CONFIG = Path("pretrain/configs/experiments/small/study.yaml")
SEEDS = (1234, 1235, 1236)
# model.input_init_rms of both equal-scale groups: TIED's own table init (normal, std model.init_std
# = 0.02) has an output RMS of about 0.02, so TIED-EQ is TIED at (exactly) its own scale and LEV-EQ
# is LEV started at TIED's scale.
EQUAL_SCALE_RMS = 0.02
LAMBADA_MAX_PASSAGES = 500
RUN_STEPS = ("train", "convert", "evaluate", "geometry")
MAX_RAW_BYTES = 5_000_000  # a raw file larger than this is not a small result file

# The study measured LEV as the spec defines it; its config's LEV now defaults to the pilot's setting
# (docs/results/pilot/selection.md), so its LEV groups set the spec's back and its raw files stay
# reproducible with this plan.
SPEC_LEV = ("model.lev.centre_reference=0", "model.lev.seed_lr_mult=1")
# group, model.embedding, seeds, overrides beyond train.seed
GROUPS: tuple[tuple[str, str, tuple[int, ...], tuple[str, ...]], ...] = (
    ("TIED", "tied", SEEDS, ()),
    ("LEV", "lev", SEEDS, SPEC_LEV),
    ("UNTIED", "untied", SEEDS[:1], ()),
    ("ALBERT", "albert", SEEDS[:1], ()),
    ("FLAT-MLP", "flat_mlp", SEEDS[:1], ()),
    ("FACT-MLP", "factorized_mlp", SEEDS[:1], ()),
    ("TIED-EQ", "tied", SEEDS, (f"model.input_init_rms={EQUAL_SCALE_RMS}",)),
    ("LEV-EQ", "lev", SEEDS, (*SPEC_LEV, f"model.input_init_rms={EQUAL_SCALE_RMS}")),
    ("LEV-C", "lev", SEEDS, (*SPEC_LEV, "model.lev.centred=true")),
)
VARIANT_GROUPS = ("TIED", "UNTIED", "ALBERT", "FLAT-MLP", "FACT-MLP", "LEV")

Group = tuple[str, str, tuple[int, ...], tuple[str, ...]]  # group, model.embedding, seeds, overrides

# The LEV pilot (docs/results/pilot/README.md states its questions and selection rules): 300 steps of
# the study's model; LEV as is, the remedies, a 10% warm-up for both, and a learning-rate sweep for both.
PILOT_CONFIG = Path("pretrain/configs/experiments/small/pilot.yaml")
PILOT_SEEDS = (1234, 1235)
CENTRE_REFERENCE = "model.lev.centre_reference=256"
WARMUP_10 = "train.lr_warmup_fraction=0.1"
LAYER_LR_X01 = 'train.param_groups=[{pattern: "embedding.*", lr_mult: 0.1}]'
# W_out at lr / (h r): the h r = 72 rows of the study's LEV (h 4, r 18) then move G by about lr per step
OUT_LR = "train.param_groups=[{pattern: embedding.out_proj, lr_mult: 0.0139}]"
SEED_LR_X01 = (
    'train.param_groups=[{pattern: "embedding.codebooks.*", lr_mult: 0.1}, '
    "{pattern: embedding.proj, lr_mult: 0.1}]"
)


def _lr(lr: float) -> tuple[str, str]:
    """The peak learning rate and its cosine floor (10%, as in the study's config)."""
    return (f"train.lr={lr:g}", f"train.min_lr={lr / 10:g}")


PILOT_GROUPS: tuple[Group, ...] = (
    ("TIED", "tied", PILOT_SEEDS, ()),
    ("TIED-LR1", "tied", PILOT_SEEDS[:1], _lr(1e-3)),
    ("TIED-LR4", "tied", PILOT_SEEDS[:1], _lr(4e-3)),
    ("TIED-W10", "tied", PILOT_SEEDS[:1], (WARMUP_10,)),
    ("LEV", "lev", PILOT_SEEDS, ()),
    ("LEV-LR1", "lev", PILOT_SEEDS[:1], _lr(1e-3)),
    ("LEV-LR4", "lev", PILOT_SEEDS[:1], _lr(4e-3)),
    ("LEV-W10", "lev", PILOT_SEEDS[:1], (WARMUP_10,)),
    ("LEV-X01", "lev", PILOT_SEEDS[:1], (LAYER_LR_X01,)),
    ("LEV-O", "lev", PILOT_SEEDS[:1], (OUT_LR,)),
    ("LEV-R", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE,)),
    ("LEV-RS", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE, "model.lev.seed_init_scale=10")),
    ("LEV-RG", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE, SEED_LR_X01)),
    # the amendment (docs/results/pilot/README.md): the learning-rate sweep with the 10% warm-up
    ("TIED-W10-LR1", "tied", PILOT_SEEDS[:1], (WARMUP_10, *_lr(1e-3))),
    ("TIED-W10-LR4", "tied", PILOT_SEEDS[:1], (WARMUP_10, *_lr(4e-3))),
    # the chosen setting (LEV-RG, selection.md) with the 10% warm-up at the three learning rates
    ("LEV-RG-W10", "lev", PILOT_SEEDS, (CENTRE_REFERENCE, SEED_LR_X01, WARMUP_10)),
    ("LEV-RG-W10-LR1", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE, SEED_LR_X01, WARMUP_10, *_lr(1e-3))),
    ("LEV-RG-W10-LR4", "lev", PILOT_SEEDS[:1], (CENTRE_REFERENCE, SEED_LR_X01, WARMUP_10, *_lr(4e-3))),
)


@dataclass(frozen=True)
class Plan:
    """A set of runs `megatron-lev study` runs on resumable lanes: the study's, or another experiment
    on the same machinery (`PLANS`)."""

    name: str
    config: Path  # the run config every run starts from
    groups: tuple[Group, ...]
    seeds: tuple[int, ...]  # the seed order of `assign_lanes` (first seeds first)
    tokenizer_hint: str | None = None  # the plan needs `--tokenizer` (this file of the shared data)
    lambada: bool = True  # the LAMBADA-style passages and their evaluation
    about: str = ""


# The regime experiment (docs/results/regime/README.md): GPT-NeoX's vocabulary, a model whose input
# table is 80% of it. Each side runs as the pilot chose (docs/results/pilot/selection.md): LEV in the
# chosen setting at LEV's chosen learning rate, TIED, ALBERT and UNTIED at TIED's, all with the 10%
# warm-up (the amendment). tests/experiments/test_pilot.py checks these names against the rules
# applied to the committed pilot raw files.
REGIME_CONFIG = Path("pretrain/configs/experiments/regime/regime.yaml")
REGIME_SEEDS = SEEDS
PILOT_TIED_CHOICE = "TIED-W10-LR1"
PILOT_LEV_CHOICE = "LEV-RG-W10-LR1"
_PILOT_OVERRIDES = {group: extra for group, _, _, extra in PILOT_GROUPS}
TIED_SETTING: tuple[str, ...] = _PILOT_OVERRIDES[PILOT_TIED_CHOICE]
LEV_SETTING: tuple[str, ...] = _PILOT_OVERRIDES[PILOT_LEV_CHOICE]
REGIME_GROUPS: tuple[Group, ...] = (
    ("TIED", "tied", REGIME_SEEDS, TIED_SETTING),
    ("LEV", "lev", REGIME_SEEDS, LEV_SETTING),
    ("ALBERT-32", "albert", REGIME_SEEDS[:1], ("model.baseline_dim=32", *TIED_SETTING)),
    ("UNTIED", "untied", REGIME_SEEDS[:1], TIED_SETTING),
    ("LEV-RANDOM", "lev", REGIME_SEEDS[:1], (*LEV_SETTING, "model.lev.id_order=random")),
)

# LEV's token-id order on the pilot's config: the chosen setting in bpe, random and frequency order.
ORDER_GROUPS: tuple[Group, ...] = tuple(
    (f"LEV-{name}", "lev", SEEDS, (*LEV_SETTING, f"model.lev.id_order={order}"))
    for name, order in (("BPE", "bpe"), ("RANDOM", "random"), ("FREQUENCY", "frequency"))
)

# The clip experiment (docs/results/clip/README.md, plan and criteria fixed before its runs): the
# regime's comparison with LEV's seed side clipped on its own (`model.lev.seed_clip_grad`, at the
# global threshold), TIED rerun on the same code (its clipping is now the project's), one seed of each
# without clipping as controls, and UNTIED's seeds 1235 and 1236 for a head-matched comparison.
SEED_CLIP = "model.lev.seed_clip_grad=1"
NO_CLIP = "train.clip_grad=0"
CLIP_GROUPS: tuple[Group, ...] = (
    ("TIED", "tied", REGIME_SEEDS, TIED_SETTING),
    ("LEV-SC", "lev", REGIME_SEEDS, (*LEV_SETTING, SEED_CLIP)),
    ("TIED-C0", "tied", REGIME_SEEDS[:1], (*TIED_SETTING, NO_CLIP)),
    ("LEV-C0", "lev", REGIME_SEEDS[:1], (*LEV_SETTING, NO_CLIP)),
    ("UNTIED", "untied", REGIME_SEEDS[1:], TIED_SETTING),
)

PLANS: dict[str, Plan] = {
    "study": Plan(
        "study", STUDY_CONFIG, GROUPS, SEEDS, about="the small grid's variants with seeds and LEV controls"
    ),
    "pilot": Plan(
        "pilot",
        PILOT_CONFIG,
        PILOT_GROUPS,
        PILOT_SEEDS,
        lambada=False,
        about="300 steps of LEV as is, its remedies, warm-up and learning rates, against TIED",
    ),
    "regime": Plan(
        "regime",
        REGIME_CONFIG,
        REGIME_GROUPS,
        REGIME_SEEDS,
        tokenizer_hint="tokenizers/gpt-neox-20b.json",
        lambada=False,
        about="GPT-NeoX vocabulary, 4 x 192 model: LEV against TIED, ALBERT-32 and UNTIED by count band",
    ),
    "clip": Plan(
        "clip",
        REGIME_CONFIG,
        CLIP_GROUPS,
        REGIME_SEEDS,
        tokenizer_hint="tokenizers/gpt-neox-20b.json",
        lambada=False,
        about="the regime with LEV's seed side clipped on its own, TIED rerun, no-clip controls, UNTIED",
    ),
    "order": Plan(
        "order",
        PILOT_CONFIG,
        ORDER_GROUPS,
        SEEDS,
        lambada=False,
        about="LEV's token-id order (bpe, random, frequency) on the pilot's config, three seeds",
    ),
}


def get_plan(plan: str | Plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if plan not in PLANS:
        raise ConfigError(f"--plan {plan}: unknown; the plans are {', '.join(PLANS)}")
    return PLANS[plan]


CORPORA = (
    ("mmidx", "validation", "held-out documents of the training subsets"),
    ("text", "zero-shot", "the held-out subset, never trained on"),
    ("lambada", "LAMBADA-style", "last word of passages cut from the held-out subset"),
)


@dataclass(frozen=True)
class StudyRun:
    name: str  # run directory and step names: <group>-s<seed>, lower case
    group: str
    variant: str  # model.embedding
    seed: int  # train.seed
    overrides: tuple[str, ...]  # train.seed first, then the group's own


def study_plan(plan: str | Plan = "study") -> list[StudyRun]:
    """A plan's runs (the study's 19 by default), in the order of its groups and seeds."""
    return [
        StudyRun(f"{group.lower()}-s{seed}", group, variant, seed, (f"train.seed={seed}", *extra))
        for group, variant, seeds, extra in get_plan(plan).groups
        for seed in seeds
    ]


def select_runs(names: list[str] | None, plan: str | Plan = "study") -> list[StudyRun]:
    """The plan's runs named, in the order named (a lane runs them in the order `assign_lanes` dealt
    them); all of them, in plan order, when `names` is empty. An unknown name is refused."""
    runs = study_plan(plan)
    if not names:
        return runs
    known = {r.name for r in runs}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"--runs: unknown {unknown}; the {get_plan(plan).name} plan's runs are {', '.join(sorted(known))}"
        )
    by_name = {r.name: r for r in runs}
    return [by_name[n] for n in dict.fromkeys(names)]


def assign_lanes(runs: list[StudyRun], lanes: int, plan: str | Plan = "study") -> list[list[StudyRun]]:
    """Runs dealt round-robin to `lanes` lanes, first seeds first: every group's first seed finishes
    before any group's second, so a study cut short still has every variant."""
    if lanes < 1:
        raise ConfigError(f"--lanes {lanes}: must be an integer >= 1")
    order = {seed: i for i, seed in enumerate(get_plan(plan).seeds)}
    plan_index = {r.name: i for i, r in enumerate(study_plan(plan))}
    ordered = sorted(runs, key=lambda r: (order.get(r.seed, len(order)), plan_index.get(r.name, 0)))
    return [ordered[k::lanes] for k in range(lanes)]


def plan_markdown(runs: list[StudyRun] | None = None, plan: str | Plan = "study") -> str:
    runs = study_plan(plan) if runs is None else runs
    lines = ["| run | group | model.embedding | train.seed | overrides |", "|---|---|---|---|---|"]
    for r in runs:
        extra = " ".join(f"`{o}`" for o in r.overrides[1:]) or "-"
        lines.append(f"| {r.name} | {r.group} | {r.variant} | {r.seed} | {extra} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- running


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
        self.grid = SmallGrid(
            self.data_dir,
            self.out,
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

        from megatron_lev.engine.plan import validate_run

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
        return self.grid.run_steps(
            run.name,
            run.variant,
            self.run_dir(run),
            run.overrides,
            label=run.group,
            lambada=self.lambada_file if self.spec.lambada else None,
            geometry=True,
        )

    def all_steps(self) -> list[Step]:
        return self.data_steps() + [s for run in self.selected for s in self.run_steps(run)]

    def lane_command(self, lane: int, runs: list[StudyRun]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "megatron_lev",
            "study",
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


# ---------------------------------------------------------------------------------------- collecting


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


def _timing(state_dir: Path, run: StudyRun) -> dict:
    steps = {}
    for kind in RUN_STEPS:
        rec = read_marker(state_dir / f"{kind}-{run.name}.json") or {}
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
    """Copy the small raw files of every finished run (all four steps done) of `out` into
    `raw/<run>/`, with the data split, the LAMBADA passages' summary and the plan; `study.json` lists
    these runs and those an earlier collection into `raw` listed. Returns the bytes written per file
    (relative name). `plan`: None for the one `study run` recorded in `out` (refused for a
    directory without a record); another than the recorded one is refused."""
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
    finished = [
        r for r in study_plan(plan) if all(read_marker(state / f"{k}-{r.name}.json") for k in RUN_STEPS)
    ]
    if not finished:
        raise UserError(f"{out}: no finished run (train, convert, evaluate and geometry all done)")
    for run in finished:
        src = out / "runs" / run.name
        files = {
            "eval.json": src / "eval" / "eval.json",
            "metrics.jsonl": src / "metrics.jsonl",
            "geometry.json": src / "geometry" / "geometry.json",
            "config.yaml": src / "config.yaml",
        }
        for name, path in files.items():
            sizes[f"{run.name}/{name}"] = _copy_small(path, raw / run.name / name, out)
        dst = raw / run.name / "timing.json"
        atomic_write_text(dst, _scrub(json.dumps(_timing(state, run), indent=1) + "\n", out))
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
    return sizes
