"""The training dynamics at every log line (`training.dynamics`, `engine.step_probe`).

- On one rank (ZeRO-0, fp32) the logged gradient norms, weight norms, update ratios, clipping flag
  and input-table statistics equal a direct computation: the same tiny model built again, stepped
  by hand with torch's AdamW and `clip_grad_norm_` on the same batches, the table taken from
  `materialize()` and its effective rank from `torch.linalg.svdvals`. TensorBoard holds the same
  numbers.
- On two ranks, TP = 2, PP = 2, ZeRO-1, ZeRO-2 and ZeRO-3 (data-parallel 2) log the one-rank numbers:
  the norms are of the full tensors whatever holds them.
- A real `megatron-lev train` run has the keys at every log line, and with the sample covering the
  whole vocabulary its table statistics are those `megatron-lev geometry` computes on the checkpoint.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.testing.distributed import run_distributed
from tests.training.conftest import TINY, run_train, tiny_overrides
from tests.training.synthetic import synthetic_batches, train_synthetic

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

VOCAB, SEQ, MICRO, GLOBAL, ITERS, SAMPLE = 500, 16, 2, 4, 3, 64
REL = 1e-5  # one rank against the hand computation (both fp32, the same operations)
LAYOUT_REL = 2e-4  # other layouts: sums in another order (TP reductions, partitions)
LEV_TENSORS = ("codebooks.weight", "proj", "norm_weight", "norm_bias", "delta", "out_proj")
TABLE = ("rms", "mean_row_ratio", "effective_rank", "effective_rank_centred", "update_ratio")
LAYOUTS = {  # in this order: DeepSpeed cannot build a plain engine without `mpu` after a pipeline
    "zero1": {"parallel.zero_stage": 1},
    "zero2": {"parallel.zero_stage": 2},
    "zero3": {"parallel.zero_stage": 3},
    "tp2": {"parallel.tensor_model_parallel_size": 2},
    "pp2": {"parallel.pipeline_model_parallel_size": 2, "parallel.zero_stage": 1},
    # DeepSpeed's own ZeRO-0 pipeline clipping counted a tied table twice; the project's clipper
    # (engine.clipping) makes this layout follow one process like the others
    "pp2-zero0": {"parallel.pipeline_model_parallel_size": 2, "parallel.zero_stage": 0},
}


def _cfg(embedding: str, **over):
    base = {
        "model.embedding": embedding,
        "model.num_layers": 2,
        "model.hidden_size": 32,
        "model.num_attention_heads": 2,
        "model.seq_length": SEQ,
        "model.lev.d_seed": 8,
        "model.lev.heads": 2,
        "model.lev.rank": 4,
        "model.lev.kappa": 4,
        "parallel.zero_stage": 0,
        "train.micro_batch_size": MICRO,
        "train.global_batch_size": GLOBAL,
        "train.train_iters": ITERS,
        "train.lr": 1e-2,
        "train.lr_warmup_iters": 1,
        "train.clip_grad": 1.0,
        "logging.log_interval": 1,
        "logging.progress_bar": False,
        "logging.dynamics_sample_ids": SAMPLE,
        "data.data_path": "[unused]",
        "data.tokenizer_path": "unused",
    }
    base.update(over)
    return load_config([TINY], [f"{k}={v}" for k, v in base.items()])


def _batches(dp: int, dp_rank: int):
    """The same global batches in every layout: micro-batch k goes to data-parallel rank k % dp."""
    return synthetic_batches(dp, dp_rank, VOCAB, MICRO, SEQ)


def _train(cfg, out: str) -> list[dict] | None:
    """Train `cfg` with the run's default callbacks on these ranks; rank 0 returns its train lines."""
    return train_synthetic(cfg, out, VOCAB)


# ---------------------------------------------------------------- one rank, by hand


def _by_hand(embedding: str) -> list[dict]:
    """The same model, batches and schedule, stepped with torch's AdamW; every logged number computed
    directly from the tensors."""
    from megatron_lev.engine.build import build_model
    from megatron_lev.optim import param_groups
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_spec
    from megatron_lev.training.schedule import learning_rate

    cfg = _cfg(embedding)
    t = cfg.train
    model = build_model(model_spec(cfg, VOCAB), SINGLE)
    groups = param_groups(model, t.weight_decay)
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    names = {id(p): n for n, p in model.named_parameters()}
    pick = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:SAMPLE].sort().values
    gas, batches, rows = GLOBAL // MICRO, _batches(1, 0), []
    for it in range(ITERS):
        for g in opt.param_groups:
            g["lr"] = learning_rate(it, t, ITERS)
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            table_before = model.embedding.materialize()[pick].double()
        for _ in range(gas):
            x, y = next(batches)
            (model(x, labels=y).mean() / gas).backward()
        row, before = {}, {}
        for g in groups:
            grads = [p.grad.double() for p in g["params"]]
            row[f"grad_norm/group/{g['name']}"] = math.sqrt(sum(float(x.square().sum()) for x in grads))
            row[f"param_norm/group/{g['name']}"] = math.sqrt(
                sum(float(p.double().square().sum()) for p in g["params"])
            )
        for n, p in model.named_parameters():
            before[n] = p.detach().double().clone()
            if n.startswith("embedding."):
                row[f"grad_norm/{n}"] = float(p.grad.double().norm())
                row[f"param_norm/{n}"] = float(before[n].norm())
        norm = math.sqrt(sum(row[f"grad_norm/group/{g['name']}"] ** 2 for g in groups))
        row["grad_norm/global"], row["clipped"] = norm, int(norm > t.clip_grad)
        row["clip_factor/global"] = min(1.0, t.clip_grad / (norm + 1e-6))
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        opt.step()
        after = {n: p.detach().double() for n, p in model.named_parameters()}
        for g in groups:
            dw = math.sqrt(
                sum(float((after[names[id(p)]] - before[names[id(p)]]).square().sum()) for p in g["params"])
            )
            row[f"update_ratio/group/{g['name']}"] = dw / row[f"param_norm/group/{g['name']}"]
        for n in after:
            if n.startswith("embedding."):
                w = float(before[n].norm())
                row[f"update_ratio/{n}"] = float((after[n] - before[n]).norm()) / w if w > 0 else math.nan
        with torch.no_grad():
            table = model.embedding.materialize()[pick].double()
        centred = table - table.mean(0)
        for key, x in (("effective_rank", table), ("effective_rank_centred", centred)):
            sv = torch.linalg.svdvals(x)
            p = sv / sv.sum()
            row[f"input_table/{key}"] = math.exp(float(-(p * p.log()).sum()))
        row["input_table/rms"] = float(table.square().mean().sqrt())
        row["input_table/mean_row_ratio"] = float(table.mean(0).norm() / table.norm(dim=1).mean())
        row["input_table/update_ratio"] = float((table - table_before).norm() / table_before.norm())
        rows.append(row)
    return rows


def _one_rank(out: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results = {}
    for embedding in ("lev", "tied"):
        run = os.path.join(out, embedding)
        logged = _train(_cfg(embedding, **{"logging.tensorboard": True}), run)
        acc = EventAccumulator(os.path.join(run, "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()
        board = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
        results[embedding] = {"logged": logged, "board": board, "direct": _by_hand(embedding)}
    return results


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamics1")
    (res,) = run_distributed(_one_rank, world_size=1, args=(str(out),), timeout=400)
    return res


def _keys(embedding: str) -> list[str]:
    tensors = [f"embedding.{n}" for n in LEV_TENSORS] if embedding == "lev" else ["embedding.table.weight"]
    names = ["group/decay", "group/no_decay", *tensors]
    return [
        *(f"{kind}/{n}" for kind in ("grad_norm", "param_norm", "update_ratio") for n in names),
        "grad_norm/global",
        "clipped",
        "clip_factor/global",
        *(f"input_table/{k}" for k in TABLE),
    ]


@pytest.mark.parametrize("embedding", ["lev", "tied"])
def test_logged_values_equal_a_direct_computation(one_rank, embedding):
    r = one_rank[embedding]
    assert [row["iteration"] for row in r["logged"]] == list(range(1, ITERS + 1))
    for row, direct in zip(r["logged"], r["direct"], strict=True):
        for key in _keys(embedding):
            want = direct[key]
            if isinstance(want, float) and math.isnan(want):  # LayerNorm bias: zero before the first step
                assert math.isnan(row[key]), key
                continue
            assert row[key] == pytest.approx(want, rel=REL, abs=1e-12), (row["iteration"], key)
        # the norm that clipped the step is the one logged
        assert row["grad_norm"] == row["grad_norm/global"]


def test_the_dynamics_show_lev_s_step_moving_w_out_far_more_than_delta(one_rank):
    first = one_rank["lev"]["logged"][0]
    out_proj, delta = first["update_ratio/embedding.out_proj"], first["update_ratio/embedding.delta"]
    assert out_proj > 5 * delta  # what the numbers are for: W_out moves, the spline barely does
    clipped = [row["clipped"] for row in one_rank["lev"]["logged"]]
    assert set(clipped) == {0, 1}  # the direct check covered both outcomes


@pytest.mark.parametrize("embedding", ["lev", "tied"])
def test_tensorboard_holds_the_same_numbers(one_rank, embedding):
    r = one_rank[embedding]
    for row in r["logged"]:
        for key in _keys(embedding):
            value = r["board"][f"train/{key}"][row["iteration"]]  # float32 in the event file
            assert value == pytest.approx(row[key], rel=1e-6, abs=1e-30, nan_ok=True), key


# ---------------------------------------------------------------- two ranks


def _layouts(out: str) -> dict:
    results = {}
    for name, over in LAYOUTS.items():
        for embedding in ("lev", "tied"):
            results[f"{embedding}-{name}"] = _train(
                _cfg(embedding, **over), os.path.join(out, embedding, name)
            )
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamics2")
    return run_distributed(_layouts, world_size=2, args=(str(out),), timeout=500)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("embedding", ["lev", "tied"])
def test_every_layout_logs_the_one_rank_values(one_rank, two_ranks, embedding, layout):
    reference, rows = one_rank[embedding]["logged"], two_ranks[f"{embedding}-{layout}"]
    assert [row["iteration"] for row in rows] == list(range(1, ITERS + 1))
    keys = _keys(embedding)
    for row, ref in zip(rows, reference, strict=True):
        for key in keys:
            assert row[key] == pytest.approx(ref[key], rel=LAYOUT_REL, abs=1e-9, nan_ok=True), (
                layout,
                row["iteration"],
                key,
            )
        assert row["grad_norm"] == row["grad_norm/global"]


# ---------------------------------------------------------------- a real run and `geometry`


def test_a_run_logs_them_at_every_line_and_geometry_agrees(minipile_prefix, tokenizer_path, tmp_path):
    from megatron_lev.analysis.geometry import run_geometry
    from megatron_lev.training.metrics import read_metrics

    out = tmp_path / "run"
    extra = {
        "train.train_iters": 4,
        "logging.log_interval": 2,
        "logging.tensorboard": True,
        "logging.dynamics_sample_ids": 60000,  # more than the vocabulary: every id, as geometry takes
        "parallel.zero_stage": 0,  # DeepSpeed reports no gradient norm: the measured one is logged
    }
    proc = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, out, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl", "train")
    assert [r["iteration"] for r in rows] == [2, 4]
    for row in rows:
        assert set(_keys("lev")) <= set(row), sorted(set(_keys("lev")) - set(row))
        assert all(isinstance(row[k], (int, float)) for k in _keys("lev"))
    geometry = {r.iteration: r for r in run_geometry(out) if r.matrix == "input"}
    last = rows[-1]
    assert last["input_table/effective_rank"] == pytest.approx(geometry[4].effective_rank, rel=1e-4)
    assert last["input_table/mean_row_ratio"] == pytest.approx(geometry[4].mean_row_ratio, rel=1e-4)
    log_text = proc.stderr + proc.stdout
    assert "grad norm nan" not in log_text and "grad norm " in log_text
    json.dumps(rows)  # plain numbers only


# ---------------------------------------------------------------- configuration


def test_the_sample_is_fixed_distinct_and_inside_the_vocabulary():
    from megatron_lev.training.dynamics import sample_ids

    ids = sample_ids(50277, 1024)
    assert torch.equal(ids, sample_ids(50277, 1024))  # the same in every run and on every rank
    assert len(ids.unique()) == 1024 and int(ids.min()) >= 0 and int(ids.max()) < 50277
    assert torch.equal(sample_ids(300, 1024), torch.arange(300))  # a small vocabulary: every id


def test_the_dynamics_can_be_switched_off_and_the_sample_size_is_checked(tmp_path):
    from megatron_lev.errors import ConfigError
    from megatron_lev.training.dynamics import TrainingDynamics
    from megatron_lev.training.metrics import MetricsWriter
    from megatron_lev.training.run import default_callbacks

    writer = MetricsWriter(tmp_path, False, False)
    on = default_callbacks(_cfg("lev"), writer, None)
    off = default_callbacks(_cfg("lev", **{"logging.train_dynamics": False}), writer, None)
    assert sum(isinstance(cb, TrainingDynamics) for cb in on) == 1
    assert not any(isinstance(cb, TrainingDynamics) for cb in off)
    with pytest.raises(ConfigError, match=r"logging\.dynamics_sample_ids"):
        _cfg("lev", **{"logging.dynamics_sample_ids": 1})
