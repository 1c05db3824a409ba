"""Absurd sizes: what cannot fit is refused before it is allocated, and one huge document does not
take memory in proportion to the tokenizer's bookkeeping.

`train` estimates its memory per process from the model shape, the sequence length and the
micro-batch (`plan.memory`) before the model or the data indices are built: on CPU it refuses in
one line naming the keys to change what this machine cannot hold; on GPU it warns. The trainings
that could run away run under an address-space limit, so that a regression fails the case with
a MemoryError instead of waking the kernel's OOM killer on a shared machine.

`preprocess` encodes a document longer than `PreprocessOptions.piece_chars` (1 MiB of text) in
pieces cut before single spaces, which regex pre-tokenizers (GPT-NeoX's byte-level BPE, tiktoken)
never let a token cross, so the ids are the same as for the whole document.
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from megatron_lev.config import load_config
from megatron_lev.errors import ConfigError
from tests.reliability.harness import ROOT, Outcome, expect_error, expect_ok
from tests.tiny_run import CONFIG_SCHEDULE, tiny_overrides

pytestmark = pytest.mark.timeout(600)

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
ADDRESS_SPACE = 8 << 30  # a training of the tiny model needs under 3 GiB of it

# runs argv[1:] and prints the largest resident set of that child (bytes) last on stderr
PEAK_RSS = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "print(f'peak-rss {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def run_measured(argv: list, timeout: float = 300) -> tuple[Outcome, int]:
    """`python -m megatron_lev *argv` under ADDRESS_SPACE; its outcome and peak resident set (bytes)."""

    env = {**os.environ, **ENV}
    env.pop("MEGATRON_LEV_NO_MEMORY_CHECK", None)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    proc = subprocess.Popen(
        [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "megatron_lev", *map(str, argv)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a timeout kills the run too, not only the wrapper
        preexec_fn=limit,  # noqa: PLW1509 - before any thread exists in the child
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"megatron-lev {argv[0]} ran for {timeout}s: {err[-2000:]}")
    lines = err.rstrip().splitlines()
    peak = int(lines[-1].split()[1]) if lines and lines[-1].startswith("peak-rss") else -1
    return Outcome(proc.returncode, out, "\n".join(lines[:-1])), peak


@pytest.fixture(scope="module")
def wiki_lines(shared_data) -> list[str]:
    lines = []
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            lines.append(line)
            if len(lines) == 300:
                break
    return lines


@pytest.fixture(scope="module")
def neox(shared_data) -> str:
    return str(shared_data / "tokenizers" / "gpt-neox-20b.json")


@pytest.fixture(scope="module")
def shard(tmp_path_factory, wiki_lines, neox) -> str:
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    work = tmp_path_factory.mktemp("memdata")
    (work / "docs.jsonl").write_text("".join(wiki_lines))
    prefix = work / "wiki_text_document"
    preprocess(
        PreprocessOptions([str(work / "docs.jsonl")], str(prefix), "hf", neox, workers=1, progress=False)
    )
    return str(prefix)


def train_argv(shard: str, neox: str, out: Path, **extra) -> list:
    extra = {**CONFIG_SCHEDULE, "train.train_iters": 2, "train.save_interval": 0, **extra}
    return ["train", "--config", TINY, *tiny_overrides(shard, neox, out, cache=out / "cache", **extra)]


# ------------------------------------------------------------------ train: refused before allocating

TRAIN_REFUSED = [
    # overrides, fragments of the one-line refusal
    pytest.param(
        {"model.seq_length": 2_000_000},
        [
            r"needs about [\d,.]+ GiB per process",
            r"available",
            r"model\.seq_length",
            r"train\.micro_batch_size",
        ],
        id="seq-length-2M-on-cpu",
    ),
    pytest.param(
        {"model.seq_length": 200_000, "train.micro_batch_size": 64, "model.fused_loss": False},
        [
            r"logits and loss",
            r"lower train\.micro_batch_size or model\.seq_length",
            r"model\.fused_loss=true",
        ],
        id="micro-batch-64-x-seq-200k-unfused-on-cpu",
    ),
    pytest.param(  # fused, the loss is small: what is refused is the activations
        {"model.seq_length": 200_000, "train.micro_batch_size": 64},
        [r"activations", r"lower model\.seq_length or train\.micro_batch_size"],
        id="micro-batch-64-x-seq-200k-on-cpu",
    ),
    pytest.param(
        {
            "model.hidden_size": 8192,
            "model.num_attention_heads": 64,
            "model.num_layers": 64,
            "model.lev.heads": 64,
        },
        [r"weights, gradients and Adam", r"smaller model", r"parallel\.zero_stage"],
        id="model-of-50B-parameters-on-cpu",
    ),
]


@pytest.mark.parametrize("extra, fragments", TRAIN_REFUSED)
def test_train_refuses_what_cannot_fit_before_allocating(extra, fragments, shard, neox, tmp_path):
    res, peak = run_measured(train_argv(shard, neox, tmp_path / "run", **extra), timeout=180)
    expect_error(res, *fragments, r"MEGATRON_LEV_NO_MEMORY_CHECK=1")
    assert peak < 2 << 30, f"peak resident set {peak / 2**30:.1f} GiB: it allocated before refusing"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_memory_estimate_is_close_to_the_measured_peak(shard, neox, tmp_path):
    """The estimate the run logs is within 25% of the peak resident set it then reaches."""
    extra = {
        "model.seq_length": 512,
        "train.micro_batch_size": 4,
        "model.num_layers": 4,
        "model.hidden_size": 128,
    }
    extra["model.num_attention_heads"] = 4
    res, peak = run_measured(train_argv(shard, neox, tmp_path / "run", **extra))
    expect_ok(res)
    m = re.search(r"memory estimate: about ([\d,.]+) GiB per process", res.err)
    assert m, res.err[-2000:]
    estimate = float(m.group(1).replace(",", "")) * 2**30
    assert 0.75 * peak <= estimate <= 1.25 * peak, (estimate / 2**30, peak / 2**30)


def test_gpu_runs_are_warned_not_refused_and_the_check_can_be_skipped(monkeypatch):
    from megatron_lev.plan.memory import check_memory, estimate_memory

    cfg = load_config([TINY], ["model.seq_length=2000000"])
    est = estimate_memory(cfg, 1, 50304, cuda=True)
    warning = check_memory(est, cfg, cuda=True, device_bytes=80 << 30)
    assert warning and "may not fit on the GPU" in warning and "model.seq_length" in warning
    assert (
        check_memory(
            estimate_memory(load_config([TINY]), 1, 50304, cuda=True), cfg, cuda=True, device_bytes=80 << 30
        )
        is None
    )
    with pytest.raises(ConfigError, match="model.seq_length"):
        check_memory(estimate_memory(cfg, 1, 50304, cuda=False), cfg, cuda=False)
    monkeypatch.setenv("MEGATRON_LEV_NO_MEMORY_CHECK", "1")
    assert check_memory(estimate_memory(cfg, 1, 50304, cuda=False), cfg, cuda=False) is None


def test_config_prints_the_estimate():
    from megatron_lev.commands.config_cmd import memory_comment

    assert re.match(
        r"# memory estimate \(1 process\(es\).*\): about [\d.]+ GiB per process",
        memory_comment(load_config([TINY]), 1),
    )
    assert "a CPU run here would be refused" in memory_comment(
        load_config([TINY], ["model.seq_length=2000000"]), 1
    )


# ------------------------------------------------------------------ preprocess: one huge document

HUGE_MB = 20


@pytest.fixture(scope="module")
def huge_document(tmp_path_factory, wiki_lines) -> Path:
    """One JSON line holding a 20 MB document (real Wikipedia text, repeated)."""
    body = "\n\n".join(json.loads(line)["text"] for line in wiki_lines)
    text = (body * (HUGE_MB * 10**6 // len(body) + 1))[: HUGE_MB * 10**6]
    path = tmp_path_factory.mktemp("huge") / "huge.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    return path


def test_preprocess_of_one_huge_document_stays_bounded(huge_document, neox, tmp_path):
    """A 20 MB one-line document: the peak stays near 0.2 GB + 7 bytes per byte of the document
    (it was about 100 bytes per byte: 2.2 GB here, 5.4 GB for 50 MB)."""
    res, peak = run_measured(
        [
            "preprocess",
            "--input",
            huge_document,
            "--output-prefix",
            tmp_path / "huge",
            "--tokenizer",
            neox,
            "--workers",
            "1",
            "--no-progress",
        ],
        timeout=500,
    )
    expect_ok(res)
    assert peak < (200 + 8 * HUGE_MB) << 20, f"peak resident set {peak / 2**20:.0f} MiB"


def test_pieces_give_the_ids_of_the_whole_document(wiki_lines, neox, tmp_path):
    """The real corpus cut every ~200 characters (hundreds of cuts) gives the same shard bytes."""
    from megatron_lev.data.preprocess import PreprocessOptions, preprocess
    from megatron_lev.data.tokenizers import cut_points

    (tmp_path / "docs.jsonl").write_text("".join(wiki_lines))
    outs = {}
    for name, piece in (("whole", 1 << 30), ("pieces", 200)):
        prefix = tmp_path / name
        opts = PreprocessOptions([str(tmp_path / "docs.jsonl")], str(prefix), "hf", neox, progress=False)
        opts.piece_chars = piece
        preprocess(opts)
        outs[name] = (Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes())
    assert outs["pieces"] == outs["whole"]
    assert sum(len(cut_points(json.loads(x)["text"], 200)) for x in wiki_lines) > 300  # the cuts were many


def test_cut_points_and_which_tokenizers_allow_them(neox, tmp_path):
    from megatron_lev.data.tokenizers import HFTokenizer, cut_points

    text = "ab  cd ef\ngh ij"
    assert cut_points(text, 2) == [6, 12]  # never inside "  ", never next to "\n"
    assert cut_points("x" * 100, 10) == []  # nothing to cut at: one piece
    assert HFTokenizer(neox).cuts_at_spaces
    spec = json.loads(Path(neox).read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = True  # every piece would start with a space
    (tmp_path / "prefix.json").write_text(json.dumps(spec))
    assert not HFTokenizer(tmp_path / "prefix.json").cuts_at_spaces
