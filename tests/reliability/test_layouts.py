"""Every layout the config accepts trains the objective of one process; the non-finite guard.

Three spawned gloo groups do all the training, each started once: one rank (the references,
and the guard cases through the CLI), two ranks (every accepted TP x PP x ZeRO x precision
with TP x PP <= 2, plus the TP = 2 padded-vocabulary checks) and four ranks (TP2 x PP2).
A group that hangs is killed at its timeout; every run writes its result as soon as it ends,
so the hung or failing layout is the one whose case fails. Layouts the config refuses are
checked in this process, with the key the message must name.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_lev.config import load_config
from megatron_lev.errors import ConfigError
from megatron_lev.testing.distributed import DistributedTestError, run_distributed
from tests.tiny_run import tiny_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "configs" / "tiny.yaml"
MICRO = ROOT / "pretrain" / "configs" / "micro.yaml"  # the smallest model (gpu_acceptance.py's too)
TOKENIZER_VOCAB = 50277  # gpt-neox-20b: padded to 50,304 rows at TP = 1 and 50,432 at TP = 2
ITERS = 3
FP32_TOL, BF16_TOL = 2e-4, 5e-2  # |loss - one-process loss| per iteration


# ---------------------------------------------------------------- the layouts


def _layout_id(tp, pp, zero, precision, offload=False):
    return f"tp{tp}-pp{pp}-zero{zero}{'-offload' if offload else ''}-{precision}"


def _layout_overrides(tp, pp, zero, precision, offload=False) -> dict:
    return {
        "parallel.tensor_model_parallel_size": tp,
        "parallel.pipeline_model_parallel_size": pp,
        "parallel.zero_stage": zero,
        "parallel.cpu_offload": offload,
        "train.precision": precision,
    }


def _world(tp, pp):
    return 4 if tp * pp == 4 else 2


def _refusal(tp, pp, zero, precision, offload=False) -> str | None:
    """The key the config names when it refuses this layout on CPU, else None."""
    from megatron_lev.plan import validate_run

    over = [f"{k}={v}" for k, v in _layout_overrides(tp, pp, zero, precision, offload).items()]
    over += [
        "data.data_path=[unused]",
        "data.tokenizer_path=unused",
        "model.num_attention_heads=2",
        "model.hidden_size=32",
        "model.lev.heads=2",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
    ]
    try:
        validate_run(load_config([TINY], over, validate=False), _world(tp, pp), cuda=False)
    except ConfigError as exc:
        return str(exc)
    return None


REFUSED = {  # layout -> what the one-line message must name
    **{
        (tp, pp, zero, "fp16"): "train.precision=fp16 needs CUDA"
        for tp, pp, zero in itertools.product((1, 2), (1, 2), (0, 1, 2, 3))
    },
    **{
        (
            tp,
            2,
            zero,
            precision,
        ): f"parallel.zero_stage={zero} cannot be combined with pipeline"  # checked first
        for tp, zero, precision in itertools.product((1, 2), (2, 3), ("fp32", "bf16", "fp16"))
    },
    **{(tp, 2, 0, "bf16"): "bf16 with pipeline parallelism needs parallel.zero_stage=1" for tp in (1, 2)},
}
ACCEPTED = [
    (tp, pp, zero, precision)
    for tp, pp, zero, precision in itertools.product((1, 2), (1, 2), (0, 1, 2, 3), ("fp32", "bf16"))
    if (tp, pp, zero, precision) not in REFUSED
]
WORLD2 = [(*lay, False) for lay in ACCEPTED if _world(*lay[:2]) == 2] + [(1, 1, 3, "fp32", True)]
WORLD4 = [(*lay, False) for lay in ACCEPTED if _world(*lay[:2]) == 4]


def _overrides(prefix: str, tok: str, out: Path, **extra) -> list[str]:
    return tiny_overrides(
        prefix,
        tok,
        out,
        **{
            "data.split": "100,0,0",
            "train.global_batch_size": 4,
            "train.train_iters": ITERS,
            "train.lr_warmup_iters": 1,
            "train.keep_last": None,
            **extra,
        },
    )


def _write_result(path: Path, value) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        path.write_text(json.dumps(value))


def _train_layouts(prefix: str, tok: str, out: str, layouts: list) -> None:
    """Train every layout in turn (every rank); rank 0 writes `<id>.json` when one ends."""
    from tests.training.suites import pretrain_config

    for layout in layouts:
        name = _layout_id(*layout)
        over = _overrides(prefix, tok, Path(out) / name, **_layout_overrides(*layout))
        try:
            res = pretrain_config(load_config([TINY], over))
            value = {
                "exit": res.exit_code,
                "losses": {str(k): v for k, v in res.losses.items()},
                "skipped": res.skipped_steps,
            }
        except Exception as exc:  # noqa: BLE001 - recorded for this layout's case, the others go on
            value = {"error": f"{type(exc).__name__}: {exc}"}
        _write_result(Path(out) / f"{name}.json", value)


# ---------------------------------------------------------------- padded vocabulary


def _tiny_model_config(embedding: str, tp: int):
    return load_config(
        [TINY, MICRO],
        [
            f"model.embedding={embedding}",
            f"parallel.tensor_model_parallel_size={tp}",
            "train.seed=7",
        ],
    )


def _padded_vocab_probe(embedding: str, layout=None) -> dict:
    """First loss, the loss over the tokenizer's rows only, and the gradient of the padding rows."""
    from megatron_lev.engine.build import build_model
    from megatron_lev.parallel.layers import vocab_range
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_spec

    layout = layout or SINGLE
    tp = layout.tp
    model = build_model(model_spec(_tiny_model_config(embedding, tp), TOKENIZER_VOCAB, tp), layout)
    ids = torch.randint(0, TOKENIZER_VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    loss.backward()
    tied = not hasattr(model, "output_head")  # tied: the head is the embedding stage's table
    table = model.embedding.tied_output_weight() if tied else model.output_head.weight  # (V/tp, D)
    vocab_start, vocab_end = vocab_range(model.vocab_size, layout.tp_rank, tp)
    pad_from = max(TOKENIZER_VOCAB - vocab_start, 0)
    out = {
        "loss": loss.item(),
        "padded_rows": max(vocab_end - max(vocab_start, TOKENIZER_VOCAB), 0),
        "pad_grad_max": table.grad[pad_from:].abs().max().item() if pad_from < table.shape[0] else 0.0,
        "real_grad_max": table.grad[:pad_from].abs().max().item(),
    }
    if tp == 1:
        with torch.no_grad():
            logits = model(ids[:, :-1])[..., :TOKENIZER_VOCAB]  # what an export keeps
            out["export_loss"] = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).item()
    return out


def _two_rank_suite(prefix: str, tok: str, out: str) -> dict:
    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(2, 1)
    probes = {emb: _padded_vocab_probe(emb, layout) for emb in ("lev", "tied")}
    _train_layouts(prefix, tok, out, WORLD2)
    return probes


def _four_rank_suite(prefix: str, tok: str, out: str) -> None:
    _train_layouts(prefix, tok, out, WORLD4)


# ---------------------------------------------------------------- the guard (one rank, through the CLI)


def _cli(argv: list[str], env: dict[str, str]) -> dict:
    """`megatron-lev *argv` in this rank with `env` set; exit status and stderr."""
    from megatron_lev.cli import main

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"rc": rc, "err": err.getvalue()}


def _checkpoint_state(ckpt: Path) -> dict:
    """Tags on disk, `latest`, and whether every saved tensor is finite."""
    tags = sorted(p.name for p in ckpt.glob("iter_*")) if ckpt.is_dir() else []
    finite = True
    for f in ckpt.rglob("*.pt") if ckpt.is_dir() else []:
        blob = torch.load(f, map_location="cpu", weights_only=False)
        stack = [blob]
        while stack:
            x = stack.pop()
            if isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif torch.is_tensor(x) and x.is_floating_point() and not torch.isfinite(x).all():
                finite = False
    latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
    return {"tags": tags, "latest": latest, "finite": finite}


FAULTS = {"train.callbacks": "[megatron_lev.testing.faults:FaultInjection]"}  # the variables say which
GUARD_CASES = {  # name -> (environment, extra overrides)
    "nan_loss": ({"MEGATRON_LEV_INJECT_NAN_AT_STEP": "2"}, FAULTS),
    "nan_grads": ({"MEGATRON_LEV_INJECT_NAN_GRAD_AT_STEP": "2"}, FAULTS),
    "inf_weights": ({"MEGATRON_LEV_INJECT_INF_WEIGHTS_AT_STEP": "2"}, {**FAULTS, "train.save_interval": 1}),
    "all_skipped": ({"MEGATRON_LEV_INJECT_NAN_AT_STEP": "1,2,3"}, FAULTS),
    "all_grads_skipped": (
        {"MEGATRON_LEV_INJECT_NAN_GRAD_AT_STEP": "1,2,3"},
        {**FAULTS, "parallel.zero_stage": 0},
    ),
}


def _one_rank_suite(prefix: str, tok: str, out: str) -> dict:
    from megatron_lev.training.metrics import read_metrics

    _train_layouts(prefix, tok, out, [(1, 1, 0, "fp32", False), (1, 1, 1, "bf16", False)])
    guard = {}
    for name, (env, extra) in GUARD_CASES.items():
        run = Path(out) / name
        res = _cli(["train", "--config", str(TINY), *_overrides(prefix, tok, run, **extra)], env)
        res["ckpt"] = _checkpoint_state(run / "ckpt")
        metrics = run / "metrics.jsonl"
        res["train"] = (
            {r["iteration"]: (r["loss"], r["skipped_in_window"]) for r in read_metrics(metrics, kind="train")}
            if metrics.exists()
            else {}
        )
        guard[name] = res
    return guard


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def shard(tmp_path_factory, shared_data) -> tuple[str, str]:
    """200 Wikipedia documents preprocessed with the GPT-NeoX tokenizer: (prefix, tokenizer)."""
    import zstandard

    from megatron_lev.data.preprocess import PreprocessOptions, preprocess

    work = tmp_path_factory.mktemp("layouts-data")
    tok = str(shared_data / "tokenizers" / "gpt-neox-20b.json")
    lines = []
    with open(shared_data / "minipile" / "Wikipedia_en.jsonl.zst", "rb") as f:
        reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8")
        lines = list(itertools.islice(reader, 200))
    (work / "wiki.jsonl").write_text("".join(lines))
    prefix = work / "wiki_text_document"
    preprocess(
        PreprocessOptions([str(work / "wiki.jsonl")], str(prefix), "hf", tok, workers=1, progress=False)
    )
    return str(prefix), tok


def _spawn(fn, world: int, shard, out: Path, timeout: float):
    """Run a suite; a hang or crash becomes `{"spawn_error": ...}` so finished layouts still count."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        return run_distributed(fn, world_size=world, args=(*shard, str(out)), timeout=timeout)
    except DistributedTestError as exc:
        return {"spawn_error": str(exc)[-3000:]}


@pytest.fixture(scope="module")
def one_rank(shard, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts-1")
    res = _spawn(_one_rank_suite, 1, shard, out, timeout=240)
    return out, res


@pytest.fixture(scope="module")
def two_ranks(shard, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts-2")
    return out, _spawn(_two_rank_suite, 2, shard, out, timeout=360)


@pytest.fixture(scope="module")
def four_ranks(shard, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts-4")
    return out, _spawn(_four_rank_suite, 4, shard, out, timeout=240)


def _result(run, layout) -> dict:
    out, spawn = run
    path = out / f"{_layout_id(*layout)}.json"
    if not path.exists():
        why = spawn.get("spawn_error", "no result") if isinstance(spawn, dict) else "no result"
        pytest.fail(f"{_layout_id(*layout)} did not finish (hang or crash): {why}")
    res = json.loads(path.read_text())
    assert "error" not in res, f"{_layout_id(*layout)} failed: {res['error']}"
    return res


def _guard(one_rank, name) -> dict:
    _, spawn = one_rank
    if isinstance(spawn, dict):
        pytest.fail(f"the one-rank suite did not finish: {spawn['spawn_error']}")
    return spawn[0][name]


# ---------------------------------------------------------------- the matrix


def _check_against_reference(res: dict, ref: dict, precision: str) -> None:
    assert res["exit"] == 0 and res["skipped"] == 0, res
    tol = BF16_TOL if precision == "bf16" else FP32_TOL
    assert sorted(res["losses"], key=int) == [str(i) for i in range(1, ITERS + 1)]
    for it, loss in res["losses"].items():
        assert math.isfinite(loss), (it, loss)
        assert abs(loss - ref["losses"][it]) <= tol, (it, loss, ref["losses"][it])


def _reference(one_rank, precision):
    return _result(one_rank, (1, 1, 0, "fp32", False) if precision == "fp32" else (1, 1, 1, "bf16", False))


@pytest.mark.parametrize("layout", WORLD2, ids=[_layout_id(*lay) for lay in WORLD2])
def test_two_rank_layout_matches_one_process(two_ranks, one_rank, layout):
    _check_against_reference(_result(two_ranks, layout), _reference(one_rank, layout[3]), layout[3])


@pytest.mark.parametrize("layout", WORLD4, ids=[_layout_id(*lay) for lay in WORLD4])
def test_four_rank_layout_matches_one_process(four_ranks, one_rank, layout):
    _check_against_reference(_result(four_ranks, layout), _reference(one_rank, layout[3]), layout[3])


@pytest.mark.parametrize("layout", sorted(REFUSED), ids=[_layout_id(*lay) for lay in sorted(REFUSED)])
def test_refused_layout_names_the_key(layout):
    message = _refusal(*layout)
    assert message is not None, f"{_layout_id(*layout)} was accepted"
    assert REFUSED[layout] in message and "\n" not in message, message


def test_every_layout_is_either_run_or_refused():
    for layout in itertools.product((1, 2), (1, 2), (0, 1, 2, 3), ("fp32", "bf16", "fp16")):
        assert (layout in REFUSED) == (_refusal(*layout) is not None), layout


# ---------------------------------------------------------------- padded vocabulary rows


@pytest.mark.parametrize("embedding", ["lev", "tied"])
def test_padding_rows_leave_the_loss_alone_at_any_tp(two_ranks, embedding):
    from megatron_lev.model.vocab import padded_vocab_size

    _, spawn = two_ranks
    if isinstance(spawn, dict):
        pytest.fail(f"the two-rank suite did not finish: {spawn['spawn_error']}")
    tp1 = _padded_vocab_probe(embedding)
    tp2 = [rank[embedding] for rank in spawn]
    cfg = _tiny_model_config(embedding, 1).model
    assert (padded_vocab_size(TOKENIZER_VOCAB, cfg, 1), padded_vocab_size(TOKENIZER_VOCAB, cfg, 2)) == (
        50304,
        50432,
    )
    assert tp1["padded_rows"] == 27 and [r["padded_rows"] for r in tp2] == [0, 155]
    for r in tp2:
        assert abs(r["loss"] - tp1["loss"]) <= 1e-6, (r["loss"], tp1["loss"])
    assert abs(tp1["loss"] - tp1["export_loss"]) <= 1e-6, "the training loss is not the exported model's"


@pytest.mark.parametrize("embedding", ["lev", "tied"])
def test_padding_rows_get_zero_gradient(two_ranks, embedding):
    _, spawn = two_ranks
    if isinstance(spawn, dict):
        pytest.fail(f"the two-rank suite did not finish: {spawn['spawn_error']}")
    for r in [_padded_vocab_probe(embedding), *(rank[embedding] for rank in spawn)]:
        assert r["pad_grad_max"] == 0.0 and r["real_grad_max"] > 0.0, r


def test_cross_entropy_masks_padding_columns():
    from megatron_lev.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron_lev.parallel.layout import SINGLE

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 5, 16, generator=g) * 3).requires_grad_()
    target = torch.randint(0, 11, (3, 5), generator=g)
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=11, layout=SINGLE)
    ref = F.cross_entropy(logits[..., :11].flatten(0, 1), target.flatten(), reduction="none").view(3, 5)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    loss.sum().backward()
    assert torch.all(logits.grad[..., 11:] == 0) and torch.isfinite(logits.grad).all()
    unmasked = vocab_parallel_cross_entropy(logits.detach(), target, layout=SINGLE)
    assert torch.all(unmasked > loss.detach()), "without vocab_size every row counts"


# ---------------------------------------------------------------- the guard


def test_nan_loss_step_is_skipped_and_the_run_finishes(one_rank):
    r = _guard(one_rank, "nan_loss")
    assert r["rc"] == 0, r["err"][-2000:]
    assert math.isnan(r["train"][2][0]) and r["train"][2][1] == 1 and r["train"][3][1] == 0
    assert r["ckpt"]["latest"] == f"iter_{ITERS:07d}" and r["ckpt"]["finite"]


def test_nan_gradients_with_a_finite_loss_are_skipped(one_rank):
    r = _guard(one_rank, "nan_grads")
    assert r["rc"] == 0, r["err"][-2000:]
    assert r["train"][2][1] == 1 and r["train"][1][1] == 0 and r["train"][3][1] == 0
    assert r["train"][3] == _guard(one_rank, "nan_loss")["train"][3], "the skipped step changed the state"
    assert r["ckpt"]["latest"] == f"iter_{ITERS:07d}" and r["ckpt"]["finite"]


def test_update_that_makes_weights_inf_stops_without_saving_them(one_rank):
    r = _guard(one_rank, "inf_weights")
    line = [x for x in r["err"].splitlines() if x.strip()][-1]
    assert r["rc"] == 3 and "Traceback" not in r["err"], r["err"][-2000:]
    assert line.startswith("megatron-lev train: error: iteration 2:") and "non-finite" in line, line
    assert "inf_weights/ckpt" in line and "train.lr" in line, line
    assert r["ckpt"]["tags"] == ["iter_0000001"] and r["ckpt"]["latest"] == "iter_0000001", r["ckpt"]
    assert r["ckpt"]["finite"], "the last good checkpoint holds non-finite weights"


@pytest.mark.parametrize("case", ["all_skipped", "all_grads_skipped"])
def test_run_whose_steps_were_all_skipped_fails(one_rank, case):
    r = _guard(one_rank, case)
    line = [x for x in r["err"].splitlines() if x.strip()][-1]
    assert r["rc"] == 3 and "Traceback" not in r["err"], r["err"][-2000:]
    assert line.startswith("megatron-lev train: error: all 3 steps") and "train.lr" in line, line
    assert r["ckpt"]["tags"] == [], "a run that learnt nothing saved a checkpoint"


TORCH_APIS = [  # torch functions taken away to run the guard as on an older torch (pyproject: torch>=2.3)
    pytest.param((), id="installed-torch"),
    pytest.param((("torch.nn.utils", "get_total_norm"),), id="torch-2.3-without-get-total-norm"),
]


@pytest.mark.parametrize("missing", TORCH_APIS)
def test_guard_flag_is_one_fused_test(missing, monkeypatch):
    import importlib

    from megatron_lev.optim import all_finite

    for module, name in missing:
        monkeypatch.delattr(importlib.import_module(module), name)
    big = torch.full((4,), 3e38)
    assert all_finite([big, big]).item(), "large finite values are finite (no overflowing sum or norm)"
    assert all_finite([]).item() and all_finite([None]).item()
    assert all_finite([torch.ones(3), torch.full((2,), 6e4, dtype=torch.float16), big.bfloat16()]).item()
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = torch.ones(5, dtype=dtype)
            t[3] = bad
            flag = all_finite([torch.ones(3), t, torch.ones(2, dtype=torch.bfloat16)])
            assert flag.dtype == torch.bool and flag.dim() == 0 and not flag.item()


def test_guarded_adamw_skips_and_leaves_state_untouched():
    from megatron_lev.optim import GuardedAdamW

    w = torch.nn.Parameter(torch.ones(4))
    opt = GuardedAdamW([w], lr=0.1)
    w.grad = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    opt.begin_iteration()
    opt.step()
    assert opt.iteration_skipped and torch.equal(w.detach(), torch.ones(4)) and not opt.state
    w.grad = torch.ones(4)
    opt.begin_iteration(force_skip=True)
    opt.step()
    assert opt.iteration_skipped and torch.equal(w.detach(), torch.ones(4))
    opt.begin_iteration()
    opt.step()
    assert not opt.iteration_skipped and not torch.equal(w.detach(), torch.ones(4))
