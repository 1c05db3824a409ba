"""The paper's grid at CPU scale: split a Pile-format corpus, train a SentencePiece tokenizer of the
config's `model.vocab_size` on the training split and tokenise, then train, convert and evaluate every
variant with one seed, data order and token budget, and compare them against TIED.

Every step is a `megatron-lev` command run through `StepRunner`, so an interrupted grid resumes
where it stopped (finished steps are skipped; a half-finished training resumes from its checkpoint).
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_lev.config import load_config
from megatron_lev.demo.steps import Step, StepRunner, read_marker
from megatron_lev.errors import ConfigError
from megatron_lev.experiments.grid import SMALL_CONFIG, variant_label
from megatron_lev.model.embeddings import REGISTRY
from megatron_lev.plan import validate_config
from megatron_lev.resources import config_path
from megatron_lev.utils.io import atomic_write_text


def tokenizer_type_of(path: Path) -> str:
    """The `data.tokenizer_type` of a tokenizer file, by its name: .model, .json, else tiktoken."""
    suffix = Path(path).suffix
    return {".model": "sentencepiece", ".json": "hf"}.get(suffix, "tiktoken")


@dataclass
class SmallGrid:
    """Where the small grid reads and writes, and what it runs."""

    data_dir: Path
    out: Path
    tokenizer: Path | None = None  # None: train a SentencePiece model of the config's model.vocab_size
    variants: list[str] = field(default_factory=lambda: list(REGISTRY))
    config: Path = SMALL_CONFIG
    overrides: list[str] = field(default_factory=list)  # applied to every variant's training
    nproc: int = 1  # training processes (torchrun --standalone when > 1)
    zero_shot_subset: str = "Wikipedia (en)"
    max_chars_per_subset: int = 1_000_000
    valid_every: int = 20
    zero_shot_max_chars: int = 300_000
    eval_max_docs: int | None = None
    threads: int | None = None  # CPU threads per process (default: cores / nproc)

    def __post_init__(self) -> None:
        self.config = config_path(self.config)  # as given, else the packaged copy (outside the repo)

    def check(self, variants: bool = True) -> None:
        """Refuse a grid that cannot run, before any step starts; errors name the flag. `variants`:
        also each variant's run config at the grid's defaults through the trainer's validation (a
        plan whose runs override the variants' sizes validates its runs instead)."""
        if variants and "tied" not in self.variants:  # the grid's report compares against TIED
            raise ConfigError("--variants must include tied: every variant is compared against TIED")
        unknown = [v for v in self.variants if v not in REGISTRY]
        if unknown:
            raise ConfigError(f"--variants: unknown {unknown}; choose from {', '.join(REGISTRY)}")
        if not Path(self.data_dir).is_dir():
            raise ConfigError(
                f"--data-dir {self.data_dir}: not a directory of Pile-format *.jsonl[.zst] files"
            )
        if not any(p.name.endswith((".jsonl", ".jsonl.zst")) for p in Path(self.data_dir).iterdir()):
            raise ConfigError(
                f"--data-dir {self.data_dir}: no *.jsonl or *.jsonl.zst files in it (Pile format: "
                'one {"text": ..., "meta": {"pile_set_name": ...}} per line)'
            )
        if self.tokenizer is not None and not Path(self.tokenizer).is_file():
            raise ConfigError(f"--tokenizer {self.tokenizer}: file not found")
        if self.tokenizer is None and not self.vocab_size:
            raise ConfigError(
                f"{self.config} sets no model.vocab_size: the grid trains a SentencePiece tokenizer of "
                "that size (or give --tokenizer)"
            )
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ConfigError(f"--out {self.out}: exists and is not a directory; give a directory")
        for flag, value, lo in (
            ("--nproc", self.nproc, 1),
            ("--valid-every", self.valid_every, 2),
            ("--max-chars-per-subset", self.max_chars_per_subset, 1),
            ("--zero-shot-max-chars", self.zero_shot_max_chars, 1),
            ("--eval-max-docs", self.eval_max_docs, 1),
            ("--threads", self.threads, 1),
        ):
            if value is not None and value < lo:
                raise ConfigError(f"{flag} {value}: must be an integer >= {lo}")
        import torch

        from megatron_lev.plan import validate_run

        if not variants:
            return
        vocab = self.tokenizer_vocab()
        for variant in self.variants:  # the trainer's own checks, before hours of work start
            # with --tokenizer the vocabulary is the file's: the variant's width rules at its size too
            validate_run(
                self.run_config(variant), self.nproc, cuda=torch.cuda.is_available(), tokenizer_vocab=vocab
            )

    def tokenizer_vocab(self) -> int | None:
        """The given tokenizer's vocabulary (None when the grid trains its own)."""
        if self.tokenizer is None:
            return None
        from megatron_lev.data.tokenizers import build_tokenizer

        return build_tokenizer(tokenizer_type_of(self.tokenizer), self.tokenizer).vocab_size

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary of the SentencePiece model the grid trains: the config's model.vocab_size."""
        return load_config(self.config, validate=False).model.vocab_size

    @property
    def tokenizer_file(self) -> Path:
        return (
            Path(self.tokenizer) if self.tokenizer is not None else self.data / f"spm{self.vocab_size}.model"
        )

    @property
    def tokenizer_type(self) -> str:
        return tokenizer_type_of(self.tokenizer_file)

    # ------------------------------------------------------------------ paths

    @property
    def data(self) -> Path:
        return self.out / "data"

    def prefix(self, part: str) -> Path:
        return self.data / f"{part}_text_document"

    def run_dir(self, variant: str) -> Path:
        return self.out / "runs" / variant

    def eval_json(self, variant: str) -> Path:
        return self.run_dir(variant) / "eval" / "eval.json"

    @property
    def results(self) -> Path:
        return self.out / "results"

    # ------------------------------------------------------------------ commands

    def train_overrides(
        self, variant: str, run: Path | None = None, extra: list[str] | tuple[str, ...] = ()
    ) -> list[str]:
        """The training overrides of `variant` in `run` (default: the variant's run directory), then
        the grid's own overrides, then `extra` (a study run's)."""
        run = self.run_dir(variant) if run is None else Path(run)
        base = [
            f"model.embedding={variant}",
            f"data.data_path=[{self.prefix('train')}]",
            f"data.valid_data_path=[{self.prefix('valid')}]",
            f"data.tokenizer_path={self.tokenizer_file}",
            f"data.cache_dir={self.out / 'index-cache'}",
            f"train.save={run / 'checkpoints'}",
            f"logging.output_dir={run}",
            "logging.progress_bar=false",
        ]
        if self.tokenizer is not None:  # the model covers the given tokenizer's vocabulary
            base += [f"data.tokenizer_type={self.tokenizer_type}", "model.vocab_size=null"]
        if self.nproc > 1:  # the same global batch (and so the same data order) over nproc ranks
            micro = load_config(self.config, validate=False).train.micro_batch_size
            if micro % self.nproc:
                raise ConfigError(
                    f"--nproc {self.nproc} does not divide train.micro_batch_size={micro} of {self.config}"
                )
            base.append(f"train.micro_batch_size={micro // self.nproc}")
        return base + list(self.overrides) + list(extra)

    def run_config(self, variant: str, run: Path | None = None, extra: list[str] | tuple[str, ...] = ()):
        cfg = load_config(self.config, self.train_overrides(variant, run, extra), validate=False)
        return validate_config(cfg, self.nproc)

    def _python(self, *args: str) -> list[str]:
        return [sys.executable, "-m", *args]

    def _env(self) -> dict[str, str]:
        threads = self.threads or max(1, (os.cpu_count() or 1) // self.nproc)
        env = {"OMP_NUM_THREADS": str(threads)}
        if "DS_ACCELERATOR" not in os.environ:
            env["DS_ACCELERATOR"] = "cpu"
        return env

    def steps(self) -> list[Step]:
        """Every step of the grid, in order: data, then train/convert/evaluate per variant, then compare."""
        steps = self.data_steps()
        for v in self.variants:
            steps += self.run_steps(v, v, self.run_dir(v), label=variant_label(v))
        return steps + self.compare_steps()

    def data_steps(self) -> list[Step]:
        """Split the corpus, train the tokenizer (unless one is given), tokenise train and valid."""
        env = self._env()
        steps = [
            Step(
                "split",
                "hold out the zero-shot subset and a validation slice of every other subset",
                lambda: self._python(
                    "megatron_lev.experiments.corpus",
                    "--data-dir",
                    str(self.data_dir),
                    "--out",
                    str(self.data),
                    "--zero-shot-subset",
                    self.zero_shot_subset,
                    "--max-chars-per-subset",
                    str(self.max_chars_per_subset),
                    "--valid-every",
                    str(self.valid_every),
                    "--zero-shot-max-chars",
                    str(self.zero_shot_max_chars),
                ),
                lambda: [self.data / f"{p}.jsonl" for p in ("train", "valid", "zero_shot")],
            )
        ]
        if self.tokenizer is None:
            prefix = self.tokenizer_file.with_suffix("")
            steps.append(
                Step(
                    "tokenizer",
                    f"train a {self.vocab_size}-piece SentencePiece tokenizer on the training split",
                    lambda: self._python(
                        "megatron_lev",
                        "train-tokenizer",
                        "--input",
                        str(self.data / "train.jsonl"),
                        "--model-prefix",
                        str(prefix),
                        "--vocab-size",
                        str(self.vocab_size),
                        "--threads",
                        "1",
                    ),
                    lambda: [self.tokenizer_file],
                    env,
                )
            )
        for part in ("train", "valid"):
            steps.append(
                Step(
                    f"preprocess-{part}",
                    f"tokenise the {part} documents ({self.tokenizer_file.name})",
                    lambda part=part: self._python(
                        "megatron_lev",
                        "preprocess",
                        "--input",
                        str(self.data / f"{part}.jsonl"),
                        "--output-prefix",
                        str(self.prefix(part)),
                        "--tokenizer",
                        str(self.tokenizer_file),
                        "--tokenizer-type",
                        self.tokenizer_type,
                        "--workers",
                        "1",
                        "--no-progress",
                    ),
                    lambda part=part: [Path(f"{self.prefix(part)}.manifest.json")],
                    env,
                )
            )
        return steps

    def run_steps(
        self,
        name: str,
        variant: str,
        run: Path,
        extra: list[str] | tuple[str, ...] = (),
        label: str | None = None,
        lambada: Path | None = None,
        geometry: bool = False,
        env: dict[str, str] | None = None,
        stage: str = "",
        tag: str | None = None,
    ) -> list[Step]:
        """train-NAME, convert-NAME, evaluate-NAME (and geometry-NAME) of one run of `variant` in `run`
        with the overrides `extra`; evaluation on the validation shard (by frequency), the zero-shot
        documents and, with `lambada`, LAMBADA-format passages.

        `stage` (e.g. "-i2000"): one stage of a run trained in stages in the same directory, each
        resuming the last and stopping where `extra` says (`train.exit_interval`); its steps are
        named NAME`stage` and its export and evaluation go to `hf<stage>` and `eval<stage>`
        (geometry: NAME alone).
        `tag`: the checkpoint the export converts (default: the latest)."""
        env = self._env() if env is None else env
        hf, evals = run / f"hf{stage}", run / f"eval{stage}"
        label = label or variant_label(variant)
        seq = load_config(self.config, validate=False).model.seq_length
        extra = list(extra)
        what = "validation (by frequency), zero-shot" + (", LAMBADA-style passages" if lambada else "")
        steps = [
            Step(
                f"train-{name}{stage}",
                f"train {label} ({self.nproc} process(es))",
                lambda: self._train_command(variant, run, extra),
                lambda: [run / "checkpoints" / "latest", run / "metrics.jsonl"],
                env,
            ),
            Step(
                f"convert-{name}{stage}",
                f"export {label} to a validated Hugging Face model",
                lambda: self._python(
                    "megatron_lev",
                    "convert",
                    str(run / "checkpoints"),
                    str(hf),
                    "--overwrite",
                    "--no-progress",
                    *(["--tag", tag] if tag else []),
                ),
                lambda: [hf / "config.json"],
                env,
            ),
            Step(
                f"evaluate-{name}{stage}",
                f"perplexity of {label}: {what}",
                lambda: self._python(
                    "megatron_lev",
                    "evaluate",
                    str(hf),
                    "--data",
                    str(self.prefix("valid")),
                    "--text",
                    str(self.data / "zero_shot.jsonl"),
                    *(["--lambada", str(lambada)] if lambada is not None else []),
                    "--counts",
                    f"{self.prefix('train')}.counts.npy",
                    "--seq-len",
                    str(seq),
                    "--name",
                    label,
                    "--out",
                    str(evals),
                    *(["--max-docs", str(self.eval_max_docs)] if self.eval_max_docs else []),
                ),
                lambda: [evals / "eval.json"],
                env,
            ),
        ]
        if geometry:
            steps.append(
                Step(
                    f"geometry-{name}",
                    f"embedding geometry of {label} at every saved checkpoint",
                    lambda: self._python(
                        "megatron_lev", "geometry", str(run), "--out", str(run / "geometry")
                    ),
                    lambda: [run / "geometry" / "geometry.json"],
                    env,
                )
            )
        return steps

    def compare_steps(self) -> list[Step]:
        """compare-validation, compare-zero-shot, compare-training: every variant against TIED."""
        env = self._env()
        steps = []
        for corpus, label in (
            ("valid_text_document", "validation"),
            ("zero_shot", "zero-shot"),
            ("valid_text_document", "training"),
        ):
            out = self.results / label.replace("-", "_")
            what = (
                "training-loss curves against TIED's final training loss"
                if label == "training"
                else f"{label} perplexity of every variant against TIED"
            )
            steps.append(
                Step(
                    f"compare-{label}",
                    what,
                    lambda corpus=corpus, out=out, label=label: self._compare_command(corpus, out, label),
                    lambda out=out: [out / "compare.md"],
                    env,
                )
            )
        return steps

    def _train_command(
        self, variant: str, run: Path | None = None, extra: list[str] | tuple[str, ...] = ()
    ) -> list[str]:
        args = [
            "megatron_lev",
            "train",
            "--config",
            str(self.config),
            *self.train_overrides(variant, run, extra),
        ]
        if self.nproc == 1:
            return self._python(*args)
        return self._python(
            "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}", "-m", *args
        )

    def _compare_command(self, corpus: str, out: Path, label: str) -> list[str]:
        cfg = self.run_config("tied")
        tokens_per_step = (
            cfg.train.global_batch_size or cfg.train.micro_batch_size * self.nproc
        ) * cfg.model.seq_length
        cmd = self._python(
            "megatron_lev",
            "compare",
            *(f"{variant_label(v)}={self.eval_json(v)}" for v in self.variants),
            "--corpus",
            corpus,
            "--out",
            str(out),
        )
        if label in ("validation", "training"):  # loss curves and tokens-to-target from the trainer's log:
            # validation loss (every train.eval_interval steps) or training loss (every log_interval steps)
            cmd += [
                "--curves",
                *(f"{variant_label(v)}={self.run_dir(v) / 'tensorboard'}" for v in self.variants),
                "--tokens-per-step",
                str(tokens_per_step),
                "--tag",
                "valid/loss" if label == "validation" else "train/loss",
            ]
        return cmd


def check_finished_steps(state_dir: Path, steps: list[Step]) -> None:
    """A finished step is skipped only if it ran the same command (interpreter aside). A changed
    comparison (e.g. a variant added) just runs again; any other changed step is refused."""
    for step in steps:
        marker = Path(state_dir) / f"{step.name}.json"
        recorded = (read_marker(marker) or {}).get("command")
        if not isinstance(recorded, list):  # not finished, or a damaged marker: the step runs again
            continue
        now = step.command()
        if recorded[1:] != now[1:] and step.name.startswith("compare-"):
            marker.unlink()
        elif recorded[1:] != now[1:]:
            raise ConfigError(
                f"step '{step.name}' already finished in {state_dir.parent} with another command "
                f"(flags or overrides changed): was `{shlex.join(recorded)}`, now "
                f"`{shlex.join(now)}`; use another --out, or delete {state_dir.parent} to start over"
            )


def run_small_grid(grid: SmallGrid, force: bool = False, log=print) -> Path:
    """Run (or resume) every step, then write `results/README.md` (the table) and `results/COMMANDS.md`."""
    from megatron_lev.experiments.summary import commands_markdown, grid_summary, summary_markdown

    grid.check()
    steps = grid.steps()
    runner = StepRunner(grid.out, force=force, log=log)
    if not force:
        check_finished_steps(runner.state_dir, steps)
    try:
        runner.run(steps)
    finally:  # the commands that did run are worth keeping even when a later step failed
        atomic_write_text(grid.results / "COMMANDS.md", commands_markdown(runner.state_dir, steps))
    summary = grid_summary({variant_label(v): (grid.run_dir(v), grid.eval_json(v)) for v in grid.variants})
    table = summary_markdown(summary, grid.data / "split.json")
    atomic_write_text(grid.results / "README.md", table)
    log(table)
    log(f"results in {grid.results} (README.md, validation/, zero_shot/, COMMANDS.md)")
    return grid.results / "README.md"
