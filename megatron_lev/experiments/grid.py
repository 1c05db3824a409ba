"""The paper's experiment grid: six embedding variants x three model sizes, and the command for each run.

Every run of a size shares one config file (`pretrain/configs/experiments/paper/<size>.yaml`);
a variant differs only in `model.embedding`. The data locations are not in the files: the
commands read them from shell variables the user exports before submitting.

The grid's vocabulary is `o200k_base` (the paper's ~200k; its UNTIED is 611M at 400M). The
vocabulary study (50k GPT-NeoX, 100k cl100k_base) runs the same configs with another tokenizer
(`PaperRun.vocab`): same model body and token budget, its own data variables.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from megatron_lev.model.embeddings import REGISTRY, embedding_class
from megatron_lev.resources import config_path


def variant_label(variant: str) -> str:
    """model.embedding -> the paper's name for the variant (the compare tables use these)."""
    return embedding_class(variant).label


# As written in the commands, which run from the repository root; `resources.config_path` finds the
# packaged copy when that path does not exist (an installed package, another directory).
PAPER_DIR = Path("pretrain/configs/experiments/paper")
SMALL_CONFIG = Path("pretrain/configs/experiments/small/small.yaml")
GPUS_PER_NODE = 8
TOKENS_PER_STEP = 256 * 2048  # global batch x sequence of every paper config

# vocabulary -> (data.tokenizer_type, suffix of its shell variables); the first is the grid's own
VOCABS: dict[str, tuple[str, str]] = {
    "o200k_base": ("tiktoken", ""),
    "cl100k_base": ("tiktoken", "_CL100K"),
    "neox": ("hf", "_NEOX"),
}
DEFAULT_VOCAB = "o200k_base"
# size -> nodes of 8 GPUs the size's config is laid out for (global batch 256 = micro x DP x accumulation)
PAPER_SIZES: dict[str, int] = {"200m": 1, "400m": 2, "1.2b": 4}
# Shell variables the paper commands read; the user exports them before the submission loop.
DATA_VARIABLES = {
    "PILE_DATA": "preprocessed Pile training prefix(es), e.g. data/pile/pile_train_text_document "
    "(a list: '[0.5,a_text_document,0.5,b_text_document]')",
    "PILE_VALID": "preprocessed Pile validation prefix, e.g. data/pile/pile_val_text_document",
    "PILE_TOKENIZER": "the tokenizer file: o200k_base.tiktoken (cl100k_base.tiktoken for the 100k study, "
    "the GPT-NeoX-20B tokenizer.json for the 50k one)",
}
# Optional for the evaluation jobs: training token counts (<train prefix>.counts.npy) for frequency buckets.
COUNTS_VARIABLE = "PILE_COUNTS"


@dataclass(frozen=True)
class PaperRun:
    """One training run of the paper grid."""

    size: str
    variant: str  # a model.embedding value
    vocab: str = DEFAULT_VOCAB  # a key of VOCABS

    @property
    def name(self) -> str:
        return (
            f"{self.group}-{self.variant}" if self.vocab != DEFAULT_VOCAB else f"{self.size}-{self.variant}"
        )

    @property
    def group(self) -> str:
        """The runs compared with each other: a size, or a size of the vocabulary study."""
        return self.size if self.vocab == DEFAULT_VOCAB else f"{self.size}-{self.vocab}"

    def variable(self, name: str) -> str:
        """The shell variable of this run's vocabulary: `PILE_DATA`, or e.g. `PILE_DATA_NEOX`."""
        return name + VOCABS[self.vocab][1]

    @property
    def nodes(self) -> int:
        return PAPER_SIZES[self.size]

    @property
    def world_size(self) -> int:
        return self.nodes * GPUS_PER_NODE

    @property
    def config(self) -> Path:
        return PAPER_DIR / f"{self.size}.yaml"

    def overrides(self, save_root: str = "ckpt/paper", runs_root: str = "runs/paper") -> list[str]:
        """The run's dotted overrides; data paths are left as `$VARIABLE` references for the shell."""
        tokenizer_type = VOCABS[self.vocab][0]
        return [
            f"model.embedding={self.variant}",
            f"data.data_path=${self.variable('PILE_DATA')}",
            f"data.valid_data_path=${self.variable('PILE_VALID')}",
            f"data.tokenizer_path=${self.variable('PILE_TOKENIZER')}",
            *(
                [f"data.tokenizer_type={tokenizer_type}"]
                if tokenizer_type != VOCABS[DEFAULT_VOCAB][0]
                else []
            ),
            f"train.save={save_root}/{self.name}",
            f"logging.output_dir={runs_root}/{self.name}",
        ]

    def sbatch_command(self, save_root: str = "ckpt/paper", runs_root: str = "runs/paper") -> str:
        """`sbatch ... slurm/pretrain.sbatch --config FILE overrides`, with `$VARIABLE`s left to the shell."""
        head = [
            "sbatch",
            f"--nodes={self.nodes}",
            f"--job-name=lev-{self.name}",
            "slurm/pretrain.sbatch",
            "--config",
            str(self.config),
        ]
        words = [shlex.quote(w) for w in head]
        for item in self.overrides(save_root, runs_root):
            key, _, value = item.partition("=")
            # "$VAR" expands in the shell but stays one word; literal values are quoted as needed
            words.append(f'{key}="{value}"' if value.startswith("$") else shlex.quote(item))
        return " ".join(words)

    def convert_eval_command(self, save_root: str = "ckpt/paper") -> str:
        """The follow-up export + evaluation job (slurm/convert_eval.sbatch) for this run."""
        counts = self.variable(COUNTS_VARIABLE)
        return (
            f'CHECKPOINT={save_root}/{self.name} EVAL_DATA="${self.variable("PILE_VALID")}" '
            f'EVAL_ARGS="--name {variant_label(self.variant)} --seq-len 2048'
            f'${{{counts}:+ --counts ${counts}}}" '
            f"sbatch --job-name=eval-{self.name} slurm/convert_eval.sbatch"
        )


def chinchilla_tokens(size: str, vocab: str = DEFAULT_VOCAB, tokens_per_param: int = 20) -> int:
    """20 tokens per parameter of the size's TIED model at the grid's vocabulary: the one budget every
    variant of the size trains on (the vocabulary study too)."""
    from megatron_lev.config import load_config
    from megatron_lev.data.tokenizers import KNOWN_VOCABULARIES
    from megatron_lev.model.flops import parameter_count
    from megatron_lev.model.vocab import padded_vocab_size

    cfg = load_config(config_path(PAPER_DIR / f"{size}.yaml"), validate=False)
    vocab_size = KNOWN_VOCABULARIES[vocab]
    vocab = padded_vocab_size(vocab_size, cfg.model, cfg.parallel.tensor_model_parallel_size)
    return tokens_per_param * parameter_count(cfg.model, vocab, "tied")["total"]


def paper_runs(
    sizes: list[str] | None = None, variants: list[str] | None = None, vocabs: list[str] | None = None
) -> list[PaperRun]:
    """The 18 runs (or a subset), size-major in the paper's order; `vocabs` adds the vocabulary study's
    runs (vocabulary-major, the grid's own first)."""
    sizes = list(sizes or PAPER_SIZES)
    variants = list(variants or REGISTRY)
    vocabs = list(vocabs or [DEFAULT_VOCAB])
    for v in vocabs:
        if v not in VOCABS:
            raise ValueError(f"unknown vocabulary {v!r}; the paper grid has {', '.join(VOCABS)}")
    for s in sizes:
        if s not in PAPER_SIZES:
            raise ValueError(f"unknown size {s!r}; the paper grid has {', '.join(PAPER_SIZES)}")
    for v in variants:
        if v not in REGISTRY:
            raise ValueError(f"unknown variant {v!r}; choose from {', '.join(REGISTRY)}")
    return [PaperRun(s, v, vocab) for vocab in vocabs for s in sizes for v in variants]


def data_variables(runs: list[PaperRun]) -> dict[str, str]:
    """The shell variables `runs` read, with what each holds."""
    out = {}
    for suffix in dict.fromkeys(VOCABS[r.vocab][1] for r in runs):
        vocab = next(k for k, v in VOCABS.items() if v[1] == suffix)
        for var, what in DATA_VARIABLES.items():
            out[var + suffix] = what if not suffix else f"{what} ({vocab} tokenisation)"
    return out


def submission_script(runs: list[PaperRun]) -> str:
    """A bash script that checks the data variables and submits every run, one sbatch a line."""
    lines = [
        "#!/usr/bin/env bash",
        "# The paper grid: submit from the repository root after exporting the data variables.",
        "# Generated by `megatron-lev grid --grid paper --print-sbatch`; do not edit by hand.",
        "set -euo pipefail",
    ]
    for var, what in data_variables(runs).items():
        lines.append(f': "${{{var}:?export {var}: {what}}}"')
    lines += [run.sbatch_command() for run in runs]
    return "\n".join(lines) + "\n"


def evaluation_script(runs: list[PaperRun]) -> str:
    """A bash script that submits the export + evaluation job of every run, then the compare per size."""
    lines = [
        "#!/usr/bin/env bash",
        "# After training: export and evaluate every run of the paper grid (slurm/convert_eval.sbatch).",
        "# Generated by `megatron-lev grid --grid paper --print-eval`; do not edit by hand.",
        "set -euo pipefail",
    ]
    for suffix in dict.fromkeys(VOCABS[r.vocab][1] for r in runs):
        lines += [
            f': "${{PILE_VALID{suffix}:?export PILE_VALID{suffix}: '
            'the preprocessed Pile validation prefix}"',
            f"# optional: export {COUNTS_VARIABLE}{suffix}=<train prefix>.counts.npy for perplexity by token "
            "frequency",
        ]
    lines += [run.convert_eval_command() for run in runs]
    lines.append("# when the jobs have finished, the paper's table per size:")
    for size in dict.fromkeys(r.group for r in runs):
        of_size = [r for r in runs if r.group == size]
        results = " ".join(
            f"{variant_label(r.variant)}=ckpt/paper/{r.name}/hf/eval/eval.json" for r in of_size
        )
        curves = " ".join(f"{variant_label(r.variant)}=runs/paper/{r.name}/tensorboard" for r in of_size)
        lines.append(
            f"# megatron-lev compare {results} --curves {curves} --tokens-per-step {TOKENS_PER_STEP} "
            f"--out results/paper/{size}"
        )
    return "\n".join(lines) + "\n"


def manifest_markdown(runs: list[PaperRun], tokens: dict[str, int]) -> str:
    """The table of runs (size, variant, nodes, token budget, checkpoint) for docs and review."""
    head = (
        "| run | variant | config | nodes x GPUs | training tokens | checkpoint |\n"
        "|---|---|---|---|---|---|\n"
    )
    rows = [
        f"| {r.name} | {variant_label(r.variant)} | `{r.config}` | {r.nodes} x {GPUS_PER_NODE} | "
        f"{tokens[r.size]:,} | `ckpt/paper/{r.name}` |"
        for r in runs
    ]
    return head + "\n".join(rows) + "\n"
