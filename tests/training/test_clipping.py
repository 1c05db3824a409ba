"""Gradient clipping follows the one-process run in every layout (`engine/clipping.py`).

30 steps of a tiny model with `train.clip_grad=0.3`, so that most steps clip, TIED, LEV and LEV with
its seed side clipped on its own (`model.lev.seed_clip_grad`), each layout against the same run on one
process (ZeRO-0): the loss at every step within 1e-5 relative, the same `clipped` flags, the logged
global norm within 1e-3 (and the clip factors). The layouts: TP = 2, PP = 2 with ZeRO-0 and ZeRO-1,
DP = 2 with ZeRO-1, 2, 3 and ZeRO-3 with CPU offload, and TP = 2 x PP = 2 on four processes; one
process under ZeRO-1 too.

A group clip equals a hand computation on one process: the factor applied to exactly the named
tensors, the others clipped by the norm of the rest.
"""

from __future__ import annotations

import math
import os

import pytest

from megatron_lev.config import load_config
from megatron_lev.testing.distributed import run_distributed
from tests.training.conftest import TINY
from tests.training.synthetic import train_synthetic

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

VOCAB, ITERS, CLIP = 500, 30, 0.3
LOSS_REL, NORM_REL = 1e-5, 1e-3
VARIANTS = {
    "tied": {"model.embedding": "tied"},
    "lev": {"model.embedding": "lev"},
    "lev-seedclip": {"model.embedding": "lev", "model.lev.seed_clip_grad": 0.02},
}
EMBEDDINGS = tuple(VARIANTS)
ONE = {"one-zero1": {"parallel.zero_stage": 1}}
TWO = {  # DeepSpeed cannot build a plain engine without `mpu` after a pipeline: plain layouts first
    "dp2-zero1": {"parallel.zero_stage": 1},
    "dp2-zero2": {"parallel.zero_stage": 2},
    "dp2-zero3": {"parallel.zero_stage": 3},
    "dp2-zero3-offload": {"parallel.zero_stage": 3, "parallel.cpu_offload": True},
    "tp2": {"parallel.tensor_model_parallel_size": 2},
    "pp2-zero1": {"parallel.pipeline_model_parallel_size": 2, "parallel.zero_stage": 1},
    "pp2-zero0": {"parallel.pipeline_model_parallel_size": 2, "parallel.zero_stage": 0},
}
FOUR = {
    "tp2-pp2": {
        "parallel.tensor_model_parallel_size": 2,
        "parallel.pipeline_model_parallel_size": 2,
        "parallel.zero_stage": 1,
    }
}


def clip_cfg(variant: str, **over):
    base = {
        **VARIANTS[variant],
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.num_attention_heads": 4,
        "model.num_kv_heads": 2,
        "model.seq_length": 32,
        "model.lev.d_seed": 8,
        "model.lev.heads": 2,
        "model.lev.rank": 4,
        "model.lev.kappa": 4,
        "parallel.zero_stage": 0,
        "train.micro_batch_size": 2,
        "train.global_batch_size": 4,
        "train.train_iters": ITERS,
        "train.lr": 3e-3,
        "train.lr_warmup_iters": 2,
        "train.clip_grad": CLIP,
        "logging.log_interval": 1,
        "logging.progress_bar": False,
        "logging.tensorboard": False,
        "logging.dynamics_sample_ids": 16,
        "data.data_path": "[unused]",
        "data.tokenizer_path": "unused",
    }
    base.update(over)
    return load_config([TINY], [f"{k}={v}" for k, v in base.items()])


def _runs(out: str, layouts: dict) -> dict:
    return {
        f"{embedding}-{name}": train_synthetic(
            clip_cfg(embedding, **over), os.path.join(out, embedding, name), VOCAB
        )
        for name, over in layouts.items()
        for embedding in EMBEDDINGS
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("clipping"))
    result = {}
    result.update(run_distributed(_runs, world_size=1, args=(out, {"one-zero0": {}, **ONE}), timeout=600)[0])
    result.update(run_distributed(_runs, world_size=2, args=(out, TWO), timeout=800)[0])
    result.update(run_distributed(_runs, world_size=4, args=(out, FOUR), timeout=600)[0])
    return result


def differences(rows: list[dict], reference: list[dict]) -> dict:
    """Worst relative loss and norm differences, and the steps whose `clipped` flags differ."""
    loss = max(abs(r["loss"] - q["loss"]) / abs(q["loss"]) for r, q in zip(rows, reference, strict=True))
    norm = max(
        abs(r["grad_norm/global"] - q["grad_norm/global"]) / q["grad_norm/global"]
        for r, q in zip(rows, reference, strict=True)
    )
    flags = [r["iteration"] for r, q in zip(rows, reference, strict=True) if r["clipped"] != q["clipped"]]
    factor = max(
        abs(r[k] - q[k]) / q[k]
        for r, q in zip(rows, reference, strict=True)
        for k in q
        if k.startswith("clip_factor/")
    )
    return {"loss": loss, "norm": norm, "flags": flags, "factor": factor}


def test_the_reference_clips_most_steps(runs):
    for embedding in EMBEDDINGS:
        rows = runs[f"{embedding}-one-zero0"]
        assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
        assert sum(r["clipped"] for r in rows) >= ITERS // 2, embedding  # the test is about clipped steps
    seed = runs["lev-seedclip-one-zero0"]
    assert sum(r["clip_factor/lev_seed"] < 1 for r in seed) >= ITERS // 2  # both groups clip
    assert all(r["clip_factor/lev_seed"] != r["clip_factor/global"] for r in seed)


@pytest.mark.parametrize("layout", [*ONE, *TWO, *FOUR])
@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_every_layout_follows_one_process(runs, embedding, layout):
    reference, rows = runs[f"{embedding}-one-zero0"], runs[f"{embedding}-{layout}"]
    assert [r["iteration"] for r in rows] == list(range(1, ITERS + 1))
    diff = differences(rows, reference)
    assert diff["flags"] == [], diff
    assert diff["loss"] <= LOSS_REL, diff
    assert diff["norm"] <= NORM_REL, diff
    assert diff["factor"] <= NORM_REL, diff
    for row in rows:  # one number: the norm that clipped the step is the one logged
        assert row["grad_norm"] == row["grad_norm/global"], row["iteration"]


def main() -> None:
    """`python -m tests.training.test_clipping`: the table of worst differences, every layout."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        results = runs.__wrapped__(type("F", (), {"mktemp": lambda self, name: out})())
    print("| layout | " + " | ".join(EMBEDDINGS) + " |")
    for layout in [*ONE, *TWO, *FOUR]:
        cells = []
        for embedding in EMBEDDINGS:
            d = differences(results[f"{embedding}-{layout}"], results[f"{embedding}-one-zero0"])
            ds = max(
                abs(r["grad_norm"] - r["grad_norm/global"]) / r["grad_norm/global"]
                for r in results[f"{embedding}-{layout}"]
            )
            cells.append(
                f"loss {d['loss']:.1e}, norm {d['norm']:.1e}, flags {d['flags']}, engine-vs-logged {ds:.1e}"
            )
        print(f"| {layout} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()


# ---------------------------------------------------------------- a group clip, by hand

HAND_ITERS = 6
HAND_GROUPS = {  # a LEV seed side at its own threshold and the output head as a user's clip group
    "model.lev.seed_clip_grad": 0.02,
    "train.clip_groups": "[{name: head, patterns: [output_head.*], max_norm: 0.2}]",
    "train.train_iters": HAND_ITERS,
}
GROUP_OF = {"lev_seed": ("embedding.codebooks.weight", "embedding.proj"), "head": ("output_head.weight",)}
THRESHOLD = {"global": CLIP, "lev_seed": 0.02, "head": 0.2}


def _by_hand() -> list[dict]:
    """The same model and batches stepped with torch's AdamW, each group's gradients scaled by hand."""
    import torch

    from megatron_lev.engine.build import build_model
    from megatron_lev.optim import param_groups
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan import model_spec
    from megatron_lev.training.schedule import learning_rate
    from tests.training.synthetic import synthetic_batches

    cfg = clip_cfg("lev", **HAND_GROUPS)
    t, m = cfg.train, cfg.model
    model = build_model(model_spec(cfg, VOCAB), SINGLE)
    groups = param_groups(model, t.weight_decay)
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    member = {n: g for g, names in GROUP_OF.items() for n in names}
    gas = t.global_batch_size // t.micro_batch_size
    batches, rows = synthetic_batches(1, 0, VOCAB, t.micro_batch_size, m.seq_length), []
    for it in range(HAND_ITERS):
        for g in opt.param_groups:
            g["lr"] = learning_rate(it, t, HAND_ITERS)
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for _ in range(gas):
            x, y = next(batches)
            mb = model(x, labels=y).mean()
            (mb / gas).backward()
            loss += float(mb) / gas
        squares = dict.fromkeys(THRESHOLD, 0.0)
        for n, p in model.named_parameters():
            squares[member.get(n, "global")] += float(p.grad.double().square().sum())
        norms = {g: math.sqrt(v) for g, v in squares.items()}
        factors = {g: min(1.0, THRESHOLD[g] / (norms[g] + 1e-6)) for g in THRESHOLD}
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.grad.mul_(factors[member.get(n, "global")])
        opt.step()
        row = {"loss": loss, "grad_norm/global": math.sqrt(sum(squares.values()))}
        row.update({f"clip_factor/{g}": f for g, f in factors.items()})
        row.update({f"grad_norm/clip/{g}": v for g, v in norms.items()})
        rows.append(row)
    return rows


def _hand(out: str) -> dict:
    return {"run": train_synthetic(clip_cfg("lev", **HAND_GROUPS), out, VOCAB), "direct": _by_hand()}


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("clip-hand"))
    return run_distributed(_hand, world_size=1, args=(out,), timeout=300)[0]


def test_a_group_clip_equals_a_hand_computation(hand):
    run, direct = hand["run"], hand["direct"]
    assert [r["iteration"] for r in run] == list(range(1, HAND_ITERS + 1))
    for row, want in zip(run, direct, strict=True):
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=1e-5), (row["iteration"], key)
    # the test can fail: every group was clipped, each by its own factor
    for group in THRESHOLD:
        assert all(w[f"clip_factor/{group}"] < 1 for w in direct), group
    assert len({round(direct[0][f"clip_factor/{g}"], 6) for g in THRESHOLD}) == 3


def test_a_clip_pattern_that_names_no_parameter_is_refused_in_one_line():
    from megatron_lev.errors import ConfigError
    from megatron_lev.plan import validate_run

    cfg = clip_cfg("lev", **{"train.clip_groups": "[{name: head, patterns: [output_heads.*]}]"})
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, 1, cuda=False)
    message = str(err.value)
    assert "train.clip_groups[0].patterns[0]='output_heads.*' matches no parameter" in message
    assert "\n" not in message


def test_a_resume_with_other_clip_groups_is_refused_and_the_same_ones_pass():
    """Other groups (patterns, names, a group added or dropped) split the optimizer's saved states
    otherwise: refused. The same groups with other thresholds move only the clipping, like
    `train.clip_grad`: refused without, allowed with `--allow-change KEY` (before, refused even with
    it, and the message advised a reshard that carries the old rules)."""
    from megatron_lev.training.resume import differences, judge

    stored = clip_cfg("lev", **HAND_GROUPS).to_dict()
    for over in (
        {"train.clip_groups": "[{name: head, patterns: [output_head.weight], max_norm: 0.2}]"},
        {"train.clip_groups": "[{name: tail, patterns: [output_head.*], max_norm: 0.2}]"},
        {"train.clip_groups": "[]"},
        {"model.lev.seed_clip_grad": "null"},
    ):
        changed = clip_cfg("lev", **{**HAND_GROUPS, **over}).to_dict()
        _, fixed, _ = judge(differences(stored, changed), set())
        assert fixed == [next(iter(over))], over  # refused: the optimizer's groups were saved with them
    for over in (
        {"train.clip_groups": "[{name: head, patterns: [output_head.*], max_norm: 0.3}]"},
        {"model.lev.seed_clip_grad": 0.5},
    ):
        key = next(iter(over))
        changed = clip_cfg("lev", **{**HAND_GROUPS, **over}).to_dict()
        _, fixed, exact = judge(differences(stored, changed), set())
        assert (fixed, exact) == ([], [key]), over  # inexact: named, with its --allow-change
        assert judge(differences(stored, changed), {key})[1:] == ([], [])
    same = clip_cfg("lev", **HAND_GROUPS).to_dict()
    assert differences(stored, same) == []


def test_a_resume_moves_a_clip_threshold_with_its_flag_and_clips_at_the_new_one(
    minipile_prefix, tokenizer_path, tmp_path
):
    """The seed side's threshold moved on a resume: refused in one line without the flag, trained with
    `--allow-change model.lev.seed_clip_grad`, and the steps after it clip at the new threshold."""
    from megatron_lev.training.metrics import read_metrics
    from tests.tiny_run import tiny_overrides
    from tests.training.conftest import run_train

    out = tmp_path / "run"
    base = {"model.lev.seed_clip_grad": 0.02, "train.train_iters": 2, "train.save_interval": 2}
    assert run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, out, **base)).returncode == 0
    moved = tiny_overrides(
        minipile_prefix,
        tokenizer_path,
        out,
        **{**base, "model.lev.seed_clip_grad": 0.05, "train.train_iters": 4},
    )
    refused = run_train(1, moved)
    assert refused.returncode != 0
    assert "--allow-change model.lev.seed_clip_grad" in refused.stderr.strip().splitlines()[-1]
    res = run_train(1, [*moved, "--allow-change", "model.lev.seed_clip_grad"])
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["iteration"]: r for r in read_metrics(out / "metrics.jsonl", kind="train")}
    assert sorted(rows) == [1, 2, 3, 4]
    for it in (3, 4):  # the factor is the new threshold's: min(1, 0.05 / norm)
        norm, factor = rows[it]["grad_norm/clip/lev_seed"], rows[it]["clip_factor/lev_seed"]
        assert factor == pytest.approx(min(1.0, 0.05 / (norm + 1e-6)), rel=1e-5), rows[it]
