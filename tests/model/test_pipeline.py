"""Pipeline parallel (DeepSpeed engine, ZeRO-1) == the single-process model: training losses, tied copies."""

import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.engine.pipeline import stage_modules
from megatron_lev.errors import ConfigError
from megatron_lev.model.attention import ParallelAttention
from megatron_lev.model.canonical import canonical_state_dict_spec
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec
from megatron_lev.testing import run_distributed

VOCAB = 208  # a multiple of 8 x TP for TP 1 and 2, so every layout pads it alike
MICRO, ACCUM, SEQ, STEPS, LR = 2, 2, 16, 5, 1e-3
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    f"model.seq_length={SEQ}",
    "model.make_vocab_size_divisible_by=8",
    "model.lev.d_seed=16",
    "model.lev.heads=4",
    "model.lev.kappa=8",
    "model.lev.rank=8",
    "model.lev.chunk_size=16",
    "train.seed=3",
    "parallel.zero_stage=1",
    "parallel.partition_method=uniform",
]


def _config(embedding, tp, pp, extra=()):
    return load_config(
        None,
        SMALL
        + [
            f"model.embedding={embedding}",
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            *extra,
        ],
    )


def _batches():
    """The same global batch every step (so the loss must fall), as ACCUM micro-batches."""
    tokens = torch.randint(0, 200, (ACCUM, MICRO, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return [[((t[:, :-1],), t[:, 1:]) for t in tokens] for _ in range(STEPS)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _reference_losses(embedding):
    """PP = 1, TP = 1, plain torch: the mean per-token loss of each step's micro-batches."""
    model = build_model(model_spec(_config(embedding, 1, 1), VOCAB), SINGLE)
    opt, losses = _adamw(model.parameters()), []
    for step in _batches():
        opt.zero_grad()
        loss = sum(model(ids[0], labels).mean() for ids, labels in step) / ACCUM
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _pipeline_worker(tp, pp, embeddings, extra=()):
    import deepspeed
    import torch.distributed as dist

    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(tp, pp)
    out = {}
    for embedding in embeddings:
        cfg = _config(embedding, tp, pp, extra)
        pipe = build_model(model_spec(cfg, VOCAB, dist.get_world_size()), layout)
        attention = [m for m in pipe.modules() if isinstance(m, ParallelAttention)]
        assert attention and all(a.rng is pipe.rng for a in attention)  # the pipeline's own TP stream
        spec = canonical_state_dict_spec(cfg.model, VOCAB, layout)  # names and TP-local shapes map onto it
        for name, param in (kv for stage in stage_modules(pipe) for kv in stage.named_parameters()):
            entry = spec[name]
            local = list(entry.shape)
            if entry.partition_dim is not None:
                local[entry.partition_dim] //= tp
            assert tuple(param.shape) == tuple(local), (name, entry)
        ds_config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": ACCUM,
            "train_batch_size": MICRO * ACCUM,
            "zero_optimization": {"stage": 1},
            "steps_per_print": 10**6,
            "gradient_clipping": 0.0,
        }
        engine, *_ = deepspeed.initialize(
            model=pipe, optimizer=_adamw(pipe.parameters()), config=ds_config, dist_init_required=False
        )
        losses = [engine.train_batch(iter(step)).item() for step in _batches()]
        tied = [p.detach().clone() for p in pipe.tied_modules.parameters()] if embedding == "tied" else []
        # the first and last stage each hold a copy of the tied table: gather both to compare
        copies = []
        for t in tied:
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t)
            copies.append([p.numpy() for p in parts])
        out[embedding] = (losses, copies)
    return out


def _check(results, embeddings, tp, pp):
    for embedding in embeddings:
        ref = _reference_losses(embedding)
        for rank_result in results:
            losses, copies = rank_result[embedding]
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(ref),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, e=embedding: f"{e} TP={tp} PP={pp}: {m}",
            )
            assert losses[-1] < losses[0]
            for parts in copies:  # rank = pp * TP + tp: stage 0 and stage 1 of the same TP rank agree
                for t in range(tp):
                    assert (parts[t] == parts[tp + t]).all(), f"tied copies diverged on TP rank {t}"


@pytest.mark.multiprocess
def test_pp2_matches_single_process_and_tied_copies_stay_identical():
    embeddings = ("tied",)
    _check(
        run_distributed(_pipeline_worker, world_size=2, args=(1, 2, embeddings), timeout=400),
        embeddings,
        1,
        2,
    )


@pytest.mark.multiprocess
def test_tp2_pp2_matches_single_process():
    embeddings = (
        "lev",
    )  # LEV heads split over TP on the first stage; blocks checkpointed (the reference is not)
    results = run_distributed(
        _pipeline_worker,
        world_size=4,
        timeout=400,
        args=(2, 2, embeddings, ["model.activation_checkpointing=true"]),
    )
    _check(results, embeddings, 2, 2)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["parallel.tensor_model_parallel_size=3", "model.embedding=tied"],
            "num_attention_heads=4 is not divisible",
        ),
        (
            ["parallel.tensor_model_parallel_size=2", "model.num_attention_heads=8", "model.lev.heads=3"],
            "model.lev.heads=3 is not divisible",
        ),
        (
            ["parallel.pipeline_model_parallel_size=2", "parallel.zero_stage=2"],
            "cannot be combined with pipeline",
        ),
    ],
)
def test_bad_layouts_are_refused_before_any_process_group(overrides, match):
    import torch.distributed as dist

    cfg = load_config(None, SMALL + overrides, validate=False)
    p = cfg.parallel
    with pytest.raises(ConfigError, match=match):
        build_model(
            model_spec(cfg, VOCAB, p.tensor_model_parallel_size * p.pipeline_model_parallel_size), SINGLE
        )
    assert not dist.is_initialized()
