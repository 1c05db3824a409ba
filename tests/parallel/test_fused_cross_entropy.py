"""The fused head + vocabulary-parallel cross-entropy == the logits path: loss and gradients, at one
process, TP = 2 and PP = 2 (`parallel/fused_cross_entropy.py`)."""

import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.model.canonical import canonical_state_dict_spec, merge_tp_shards
from megatron_lev.model.loss import masked_mean, token_losses
from megatron_lev.parallel.fused_cross_entropy import chunk_tokens_for, fused_linear_cross_entropy
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec
from megatron_lev.testing import run_distributed

B, S, D, ROWS = 3, 17, 32, 256
REL = 1e-6  # fp32: relative to the largest entry of each gradient


def _close(got, ref, rel=REL, what=""):
    scale = float(ref.detach().abs().max())
    torch.testing.assert_close(got, ref, rtol=rel, atol=rel * scale, msg=lambda m: f"{what}: {m}")


def _tensors(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(ROWS, D, generator=g) * 0.3).to(dtype).requires_grad_()
    return hidden, weight, g


def _unfused(hidden, weight, target, vocab, mask):
    return masked_mean(token_losses(hidden @ weight.t(), target, vocab, layout=SINGLE), mask)


@pytest.mark.parametrize("vocab", [ROWS, 250], ids=["no-padding", "6-padding-rows"])
@pytest.mark.parametrize("masked", ["none", "some", "all"])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_fused_loss_and_gradients_equal_the_logits_path(vocab, masked, chunk):
    hidden, weight, g = _tensors()
    target = torch.randint(0, vocab, (B, S), generator=g)
    mask = {"none": None, "some": torch.rand(B, S, generator=g) > 0.3, "all": torch.zeros(B, S)}[masked]
    ref = _unfused(hidden, weight, target, vocab, mask)
    ref_grads = torch.autograd.grad(
        ref * 0.37, (hidden, weight)
    )  # 0.37: an upstream scale (1 / accumulation)
    mean, losses = fused_linear_cross_entropy(
        hidden, weight, target, vocab, layout=SINGLE, loss_mask=mask, chunk_tokens=chunk
    )
    grads = torch.autograd.grad(mean * 0.37, (hidden, weight))
    _close(mean, ref, what="loss")
    assert not losses.requires_grad and losses.shape == (B, S)
    _close(losses, token_losses(hidden @ weight.t(), target, vocab, layout=SINGLE).detach(), what="per-token")
    for got, want, name in zip(grads, ref_grads, ("hidden", "weight"), strict=True):
        _close(got, want, what=name)
    if vocab < ROWS:  # the padding rows take no part: no gradient at all
        assert (grads[1][vocab:] == 0).all()


def test_without_a_gradient_only_the_losses_are_computed():
    hidden, weight, g = _tensors(1)
    target = torch.randint(0, ROWS, (B, S), generator=g)
    with torch.inference_mode():
        mean, losses = fused_linear_cross_entropy(hidden, weight, target, layout=SINGLE, chunk_tokens=5)
        ref = token_losses(hidden @ weight.t(), target, layout=SINGLE)
    assert torch.equal(losses, ref)  # row by row the same operations
    assert mean.item() == pytest.approx(ref.mean().item(), rel=1e-6)


def test_bf16_is_within_bf16_tolerance_of_fp32():
    hidden, weight, g = _tensors(2)
    target = torch.randint(0, ROWS, (B, S), generator=g)
    ref = _unfused(hidden, weight, target, ROWS, None)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    h16, w16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    mean, _ = fused_linear_cross_entropy(h16, w16, target, layout=SINGLE, chunk_tokens=8)
    grads = torch.autograd.grad(mean, (h16, w16))
    assert mean.dtype == torch.float32 and grads[0].dtype == grads[1].dtype == torch.bfloat16
    _close(mean, ref, rel=2e-2, what="loss")
    for got, want, name in zip(grads, ref_grads, ("hidden", "weight"), strict=True):
        _close(got.float(), want, rel=3e-2, what=name)


def test_the_chunk_fits_its_budget_and_bad_shapes_are_refused():
    assert chunk_tokens_for(200_064, 16_384) == (256 << 20) // (4 * 200_064)  # 335 tokens of 800 KB
    assert chunk_tokens_for(8, 100) == 100  # never more tokens than there are
    assert chunk_tokens_for(10**12, 100) == 1
    hidden, weight, _ = _tensors()
    with pytest.raises(ValueError, match="disagree"):
        fused_linear_cross_entropy(hidden, weight, torch.zeros(B, S + 1, dtype=torch.long), layout=SINGLE)


# ------------------------------------------------------------------ the model: fused vs logits path

VOCAB, TOKENS = 208, 200  # 200 real tokens pad to 200 rows at TP 1 and 208 at TP 2
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=16",
    "model.make_vocab_size_divisible_by=8",
    "model.lev.d_seed=16",
    "model.lev.heads=4",
    "model.lev.kappa=8",
    "model.lev.rank=8",
    "model.lev.chunk_size=16",
    "train.seed=5",
]
EMBEDDINGS = ("tied", "untied", "lev")


def _model_grads(embedding, fused, tp=1, layout=SINGLE, chunk=5):
    cfg = load_config(
        None,
        SMALL
        + [
            f"model.embedding={embedding}",
            f"model.fused_loss={str(fused).lower()}",
            f"model.loss_chunk_tokens={chunk}",
            f"parallel.tensor_model_parallel_size={tp}",
        ],
    )
    model = build_model(model_spec(cfg, TOKENS, tp), layout)
    ids = torch.randint(0, TOKENS, (2, 17), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16)
    mask[1, 5:9] = 0
    loss = model(ids[:, :-1], ids[:, 1:], loss_mask=mask, reduction="mean")
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_the_model_trains_the_same_loss_and_gradients_fused(embedding):
    loss, grads = _model_grads(embedding, True)
    ref_loss, ref_grads = _model_grads(embedding, False)
    assert loss == pytest.approx(ref_loss, rel=REL)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        _close(grads[name], ref, what=f"{embedding} {name}")


def _tp_worker():
    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(2)
    return {e: [_model_grads(e, fused, 2, layout) for fused in (True, False)] for e in EMBEDDINGS}


@pytest.mark.multiprocess
def test_tp2_fused_matches_the_logits_path_and_one_process():
    """At TP = 2 (208 padded rows, 8 of them padding) fused == unfused within 1e-6; and fused at TP = 2
    == one process (200 rows) unfused within the layouts' tolerance (another reduction order, 1e-5)."""
    results = run_distributed(_tp_worker, world_size=2)
    for embedding in EMBEDDINGS:
        ref_loss, ref_grads = _model_grads(embedding, False)
        for rank in range(2):
            (loss, grads), (tp_loss, tp_grads) = results[rank][embedding]
            assert loss == pytest.approx(tp_loss, rel=REL) and loss == pytest.approx(ref_loss, rel=1e-5)
            for name, ref in tp_grads.items():
                _close(grads[name], ref, what=f"TP=2 rank {rank} {embedding} {name}")
        cfg = load_config(
            None, SMALL + [f"model.embedding={embedding}", "parallel.tensor_model_parallel_size=2"]
        )
        spec = canonical_state_dict_spec(cfg.model, VOCAB, true_vocab_size=TOKENS)
        for name, ref in ref_grads.items():
            merged = merge_tp_shards(spec[name], [results[r][embedding][0][1][name] for r in range(2)])
            if merged.shape != ref.shape:  # a vocabulary-parallel table: its padding rows differ
                merged = merged[: ref.shape[0]]
            _close(merged, ref, rel=1e-5, what=f"TP=2 vs one process {embedding} {name}")


class _GradRecorder(torch.optim.Optimizer):
    """Takes no step; keeps a copy of each gradient the engine hands it."""

    def __init__(self, params):
        super().__init__(params, {})
        self.seen: list[torch.Tensor] = []

    def step(self, closure=None):
        self.seen = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]


def _pp_worker(embeddings):
    import deepspeed

    from megatron_lev.engine.pipeline import stage_modules
    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(1, 2)
    ids = torch.randint(0, TOKENS, (2, 2, 17), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 2, 16)
    mask[0, 1, 3:11] = 0
    batches = [((t[:, :-1],), (t[:, 1:], m)) for t, m in zip(ids, mask, strict=True)]  # 2 micro-batches
    out = {}
    for embedding, precision in embeddings:
        for fused in (True, False):
            cfg = load_config(
                None,
                SMALL
                + [
                    f"model.embedding={embedding}",
                    f"model.fused_loss={str(fused).lower()}",
                    "model.loss_chunk_tokens=7",
                    "parallel.pipeline_model_parallel_size=2",
                    "parallel.partition_method=uniform",
                    f"train.precision={precision}",
                    "parallel.zero_stage=1",
                ],
            )
            pipe = build_model(model_spec(cfg, TOKENS, 2), layout)
            ds_config = {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
                "train_batch_size": 4,
                "zero_optimization": {"stage": 0 if precision == "fp32" else 1},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**6,
                "gradient_clipping": 0.0,
            }
            if precision == "bf16":  # the pipeline template's: bf16 weights, fp32 gradient accumulation
                ds_config |= {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
            recorder = _GradRecorder(pipe.parameters())  # under bf16, what DeepSpeed's optimizer wraps
            engine, *_ = deepspeed.initialize(
                model=pipe, optimizer=recorder, config=ds_config, dist_init_required=False
            )
            loss = engine.train_batch(iter(batches)).item()
            names = [n for stage in stage_modules(pipe) for n, _ in stage.named_parameters()]
            out[(embedding, precision, fused)] = (loss, len(names), [g.float() for g in recorder.seen])
    return out


PP_CASES = (("tied", "fp32"), ("untied", "fp32"), ("untied", "bf16"))


@pytest.mark.multiprocess
def test_pp2_fused_matches_the_logits_path():
    """PP = 2 with a loss mask and 2 accumulation steps: the fused loss_fn (the head's rows an output of
    the last stage, tied copy or own) gives the unfused pipeline's loss and every gradient on both
    stages; in bf16 with fp32 accumulation too, where DeepSpeed's bf16 optimizer drops a gradient that
    reaches a weight before the stage's outputs (the head's, when loss_fn read it from the module)."""
    results = run_distributed(_pp_worker, world_size=2, args=(PP_CASES,), timeout=400)
    for rank, result in enumerate(results):
        for embedding, precision in PP_CASES:
            (loss, n, grads), (ref_loss, ref_n, ref_grads) = (
                result[(embedding, precision, True)],
                result[(embedding, precision, False)],
            )
            rel = REL if precision == "fp32" else 2e-2
            assert (
                loss == pytest.approx(ref_loss, rel=rel) and n == ref_n and len(grads) == len(ref_grads) > 0
            )
            for i, (got, ref) in enumerate(zip(grads, ref_grads, strict=True)):
                _close(got, ref, rel=rel, what=f"PP=2 {precision} rank {rank} {embedding} parameter {i}")
