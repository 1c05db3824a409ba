"""Resuming a DP = 2 run on 1 and 4 processes, directly and through `megatron-lev reshard`.

A resume on another data-parallel size keeps the checkpoint's global batch (sequences per
optimizer step) by changing gradient accumulation, says so in one line, and continues the
sampler at the same global sample; a layout that cannot make the global batch, and a direct DP
change under ZeRO >= 1 (whose optimizer files are split by DP rank), are refused in one line
naming what works.

Two uninterrupted DP = 2 runs (ZeRO-0 and ZeRO-1, 4 iterations, checkpoints at 2 and 4) are
the references; each case resumes a copy of iteration 2 (or its reshard) and trains 3 and 4.
Every rank runs the real CLI (`cli.main`) in a gloo group of real processes.

Tolerance: the resumed steps see the same samples as the reference's (the sampler's order is
global: step k takes samples [k G, (k + 1) G), whatever micro-batch x DP x accumulation makes
G) and the same weights and Adam state, so the losses agree up to the order in which the
gradient is summed (all-reduce over ranks vs accumulation over micro-batches): `LOSS_TOL`
(fp32, measured: identical to the last bit on this model).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from megatron_lev.testing.distributed import run_distributed
from tests.reliability.harness import ROOT, expect_ok, run_cli_process, tiny_run_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

TINY = ROOT / "tests" / "configs" / "tiny.yaml"
IT2 = "iter_0000002"
LOSS_TOL = 1e-5
GLOBAL_BATCH = 4  # the references: micro-batch 2 x DP 2 x accumulation 1
ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}


def overrides(data: dict, out: Path, **extra) -> list[str]:
    return tiny_run_overrides(
        data["prefix"], data["tokenizer"], data["cache"], out, **{"train.keep_last": 4, **extra}
    )


def _cli_rank(argv: list[str]) -> dict:
    """`megatron-lev *argv` on this rank: exit status and stderr (an escaping exception is a
    traceback in `err`, as a user would see it)."""
    from megatron_lev.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - what the user would see
            traceback.print_exc()
            rc = 1
    return {"rc": rc, "err": err.getvalue()}


def train(nproc: int, argv: list[str]) -> list[dict]:
    """`megatron-lev train *argv` on `nproc` gloo ranks; each rank's exit status and stderr."""
    return run_distributed(_cli_rank, world_size=nproc, args=(["train", *map(str, argv)],), timeout=600)


def metrics_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["iteration"]: r["loss"] for r in rows if r.get("kind") == "train"}


def consumed_samples(tag_dir: Path) -> int:
    state = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return int(state["train_state"]["consumed_samples"])


# ------------------------------------------------------------------ shared inputs


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared_data) -> dict:
    """300 real Wikipedia documents in one shard set, GPT-NeoX tokenizer."""
    import zstandard

    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    work = tmp_path_factory.mktemp("dpdata")
    lines = []
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        for line in io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8"):
            lines.append(line)
            if len(lines) == 300:
                break
    (work / "docs.jsonl").write_text("".join(lines))
    tok = str(shared_data / "tokenizers" / "gpt-neox-20b.json")
    preprocess(
        PreprocessOptions(
            [str(work / "docs.jsonl")], str(work / "wiki_text_document"), "hf", tok, workers=1, progress=False
        )
    )
    return {"prefix": str(work / "wiki_text_document"), "tokenizer": tok, "cache": work / "cache"}


@pytest.fixture(scope="module")
def references(data, tmp_path_factory) -> dict[int, Path]:
    """zero stage -> the output directory of an uninterrupted DP = 2 run (checkpoints 2 and 4)."""
    runs = {}
    for zero in (0, 1):
        out = tmp_path_factory.mktemp(f"dp2-zero{zero}") / "run"
        res = train(2, ["--config", TINY, *overrides(data, out, **{"parallel.zero_stage": zero})])
        assert all(r["rc"] == 0 for r in res), res[0]["err"][-3000:]
        assert set(metrics_losses(out)) == {1, 2, 3, 4}
        runs[zero] = out
    return runs


@pytest.fixture(scope="module")
def resharded(references, tmp_path_factory) -> dict[int, Path]:
    """dp -> iteration 2 of the ZeRO-1 reference, resharded for that DP size (a save directory)."""
    made = {}

    def make(dp: int) -> Path:
        if dp not in made:
            src = tmp_path_factory.mktemp(f"src-dp{dp}") / "ckpt"
            _copy_iteration_2(references[1] / "ckpt", src)
            out = src.parent / f"resharded-dp{dp}"
            res = run_cli_process(
                ["reshard", src, out, "--tp", "1", "--pp", "1", "--dp", dp, "--skip-validation"],
                timeout=600,
                env=ENV,
            )
            expect_ok(res)
            made[dp] = out
        return made[dp]

    return make


def _copy_iteration_2(src_ckpt: Path, dst_ckpt: Path) -> None:
    dst_ckpt.mkdir(parents=True)
    shutil.copytree(src_ckpt / IT2, dst_ckpt / IT2)
    (dst_ckpt / "latest").write_text(IT2 + "\n")


# ------------------------------------------------------------------ the cases


@dataclass
class Case:
    zero: int  # the DP = 2 reference resumed (ZeRO-0 or ZeRO-1)
    route: str  # "direct": its own save directory; "reshard": `reshard --dp nproc` first
    nproc: int
    extra: dict = field(default_factory=dict)  # overrides of the resumed run
    allow: tuple = ()
    refusal: tuple = ()  # regexes of the one-line refusal; empty: the run continues
    line: str = ""  # regex of the batch line a continuing run prints (empty: none expected)


CASES = [
    pytest.param(
        Case(
            1,
            "direct",
            1,
            refusal=(r"saved on DP=2\) on DP=1", r"zero_stage=1", r"megatron-lev reshard .* --dp 1"),
        ),
        id="direct-zero1-dp1-refused-naming-reshard",
    ),
    pytest.param(
        Case(
            1,
            "direct",
            4,
            refusal=(r"on DP=4", r"zero_stage=1", r"megatron-lev reshard .* --dp 4", r"2 processes"),
        ),
        id="direct-zero1-dp4-refused-naming-reshard",
    ),
    pytest.param(
        Case(0, "direct", 1, line=r"keeping the global batch of 4 sequences with gradient accumulation 2"),
        id="direct-zero0-dp1-keeps-the-global-batch",
    ),
    pytest.param(
        Case(
            0,
            "direct",
            4,
            refusal=(
                r"global batch of 4 sequences is not a multiple of train.micro_batch_size x DP = 2 x 4",
                r"train.micro_batch_size=1",
                r"1 or 2 processes",
            ),
        ),
        id="direct-zero0-dp4-micro2-refused-naming-micro1",
    ),
    pytest.param(
        Case(
            0,
            "direct",
            4,
            extra={"train.micro_batch_size": 1},
            allow=("train.micro_batch_size",),
            line=r"keeping the global batch of 4 sequences with gradient accumulation 1 "
            r"\(micro-batch 1 x DP 4\b",
        ),
        id="direct-zero0-dp4-micro1",
    ),
    pytest.param(
        Case(
            0,
            "direct",
            1,
            extra={"train.global_batch_size": 2},
            allow=("train.global_batch_size",),
            line=r"with a global batch of 2 sequences",
        ),
        id="direct-zero0-dp1-smaller-batch-allowed",
    ),
    pytest.param(
        Case(1, "reshard", 1, line=""),
        id="reshard-dp1-keeps-the-global-batch",
    ),
    pytest.param(
        Case(
            1,
            "reshard",
            4,
            refusal=(
                r"global batch of 4 sequences is not a multiple of .* = 2 x 4",
                r"train.micro_batch_size=1",
            ),
        ),
        id="reshard-dp4-micro2-refused-naming-micro1",
    ),
    pytest.param(
        Case(
            1,
            "reshard",
            4,
            extra={"train.micro_batch_size": 1},
            allow=("train.micro_batch_size",),
            line=r"keeping the global batch of 4 sequences with gradient accumulation 1",
        ),
        id="reshard-dp4-micro1",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_resume_on_another_dp_size(case: Case, data, references, resharded, tmp_path):
    ref = references[case.zero]
    out = tmp_path / "run"
    if case.route == "direct":
        ckpt = out / "ckpt"
        _copy_iteration_2(ref / "ckpt", ckpt)
    else:
        ckpt = tmp_path / "resharded"
        shutil.copytree(resharded(case.nproc), ckpt)
    argv = [
        "--config",
        TINY,
        *overrides(data, out, **{"parallel.zero_stage": case.zero, "train.save": ckpt}, **case.extra),
    ]
    for key in case.allow:
        argv += ["--allow-change", key]
    res = train(case.nproc, argv)
    for r in res:
        assert "Traceback" not in r["err"], r["err"][-3000:]
    err0 = res[0]["err"]
    if case.refusal:
        assert all(r["rc"] != 0 for r in res), err0[-2000:]
        lines = [ln for ln in err0.splitlines() if ln.strip()]
        last = lines[-1]
        assert last.startswith("megatron-lev train:"), last
        for frag in case.refusal:
            assert re.search(frag, last), f"{frag!r} not in {last!r}"
        assert not (ckpt / "iter_0000004").exists()
        return
    assert all(r["rc"] == 0 for r in res), err0[-3000:]
    if case.line:
        assert re.search(case.line, err0), err0[-3000:]
    # the steps continue at iteration 3 with the reference's losses (same samples, same state)
    got, want = metrics_losses(out), metrics_losses(ref)
    assert set(got) == {3, 4}, got
    batch = case.extra.get("train.global_batch_size", GLOBAL_BATCH)
    if batch == GLOBAL_BATCH:
        for it in (3, 4):
            assert abs(got[it] - want[it]) <= LOSS_TOL, (it, got[it], want[it])
    # the sampler continued exactly: iterations 1-2 took 2 x 4 samples, 3-4 took 2 x batch
    assert consumed_samples(ckpt / "iter_0000004") == 2 * GLOBAL_BATCH + 2 * batch
