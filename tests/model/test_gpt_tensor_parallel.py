"""TP = 2 GPT == TP = 1 GPT with the same seed: logits, per-token loss and every gradient."""

import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.engine.recompute import apply_activation_checkpointing
from megatron_lev.model.canonical import canonical_state_dict_spec, merge_tp_shards
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec
from megatron_lev.testing import run_distributed

VOCAB = 208  # already a multiple of 8 x TP: TP = 1 and TP = 2 pad it alike
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
CASES = {  # name -> overrides
    "lev": ["model.embedding=lev"],
    "tied": ["model.embedding=tied"],
    "untied_gqa_ckpt": [
        "model.embedding=untied",
        "model.num_kv_heads=2",
        "model.activation_checkpointing=true",
    ],
}


def _config(case, tp):
    return load_config(None, SMALL + CASES[case] + [f"parallel.tensor_model_parallel_size={tp}"])


def _run(case, tp, ids, layout=SINGLE):
    """Logits (full vocabulary), loss and {name: grad shard} on this rank."""
    from megatron_lev.parallel.mappings import gather_from_tensor_parallel_region

    cfg = _config(case, tp)
    model = apply_activation_checkpointing(build_model(model_spec(cfg, VOCAB, tp), layout), cfg.model)
    logits = model(ids)
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.mean().backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    return gather_from_tensor_parallel_region(logits.detach(), layout).numpy(), loss.detach().numpy(), grads


def _tp_worker(ids):
    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(2)
    return {case: _run(case, 2, ids, layout) for case in CASES}


def _assert_outputs(got, ref) -> None:
    """A TP rank's gathered logits and per-token loss equal one process's."""
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(r), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_tp2_matches_tp1_logits_loss_and_gradients():
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    results = run_distributed(_tp_worker, world_size=2, args=(ids,))
    for case in CASES:
        ref_logits, ref_loss, ref_grads = _run(case, 1, ids)
        spec = canonical_state_dict_spec(_config(case, 1).model, 208)
        assert set(spec) == set(ref_grads)
        for rank in range(2):
            _assert_outputs(results[rank][case][:2], (ref_logits, ref_loss))
        for name, ref in ref_grads.items():
            merged = merge_tp_shards(
                spec[name], [torch.from_numpy(results[r][case][2][name]) for r in range(2)]
            )
            assert merged.shape == spec[name].shape, (case, name)
            scale = float(abs(ref).max())
            torch.testing.assert_close(
                merged,
                torch.from_numpy(ref),
                rtol=1e-5,
                atol=1e-5 * scale,
                msg=lambda m, n=name, c=case: f"{c} {n}: {m}",
            )


TOKENS = 200  # pads to 200 rows at TP = 1 and to 208 at TP = 2 (multiples of 8 x TP)
PADDED_CASES = {  # what derives from the vocabulary besides the rows of a vocab-parallel table
    "lev_reference_random_order": [  # LEV's reference ids, digit base and token order
        "model.embedding=lev",
        "model.lev.centre_reference=16",
        "model.lev.id_order=random",
    ],
    "albert": ["model.embedding=albert"],  # a width matched to LEV's parameter count
    "tied_rms": ["model.embedding=tied", "model.input_init_rms=0.05"],  # the RMS over the real rows
}


def _run_padded(case, tp, ids, layout=SINGLE):
    cfg = load_config(None, SMALL + PADDED_CASES[case] + [f"parallel.tensor_model_parallel_size={tp}"])
    from megatron_lev.parallel.mappings import gather_from_tensor_parallel_region

    spec = model_spec(cfg, TOKENS, tp)
    model = build_model(spec, layout)
    logits = model(ids)
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.mean().backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    full = gather_from_tensor_parallel_region(logits.detach(), layout)[..., :TOKENS]
    return spec.padded_vocab, full.numpy(), loss.detach().numpy(), grads


def _padded_worker(ids):
    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(2)
    return {case: _run_padded(case, 2, ids, layout) for case in PADDED_CASES}


@pytest.mark.multiprocess
def test_tp2_matches_tp1_when_the_padding_differs():
    """The padding rows differ (200 vs 208), the model does not: LEV's reference ids, digit base and
    token order, and a matched baseline's width, come from the one-process vocabulary."""
    ids = torch.randint(0, TOKENS, (2, 16), generator=torch.Generator().manual_seed(1))
    results = run_distributed(_padded_worker, world_size=2, args=(ids,))
    for case in PADDED_CASES:
        padded1, ref_logits, ref_loss, ref_grads = _run_padded(case, 1, ids)
        cfg2 = load_config(None, SMALL + PADDED_CASES[case] + ["parallel.tensor_model_parallel_size=2"])
        padded2 = results[0][case][0]
        assert (padded1, padded2) == (200, 208)
        spec = canonical_state_dict_spec(cfg2.model, padded2, true_vocab_size=TOKENS)
        for rank in range(2):
            _assert_outputs(results[rank][case][1:3], (ref_logits, ref_loss))
        for name, ref in ref_grads.items():
            merged = merge_tp_shards(
                spec[name], [torch.from_numpy(results[r][case][3][name]) for r in range(2)]
            )
            ref = torch.from_numpy(ref)
            if merged.shape != ref.shape:  # a vocab-parallel table: the padding rows have no gradient
                assert merged.shape[0] == 208 and ref.shape[0] == 200, (case, name)
                assert float(merged[200:].abs().max()) == 0.0
                merged = merged[:200]
            scale = float(abs(ref).max())
            torch.testing.assert_close(
                merged, ref, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name, c=case: f"{c} {n}: {m}"
            )
