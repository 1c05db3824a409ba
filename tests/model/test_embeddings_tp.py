"""Tensor parallel input embeddings reproduce the single-process outputs and gradients."""

import pytest
import torch

from megatron_lev.config import LevConfig, ModelConfig
from megatron_lev.model.embeddings import REGISTRY, build_input_embedding
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.testing import run_distributed

VOCAB = 48  # divisible by 4 for the vocab-parallel tables
SAMPLE = torch.tensor([0, 5, 17, 30, 47])  # `sample_rows`: distinct ids across the TP shards


TARGET_RMS = 0.05
# every variant, then the options: "lev+centred" (model.lev.centred), "lev+reference"
# (model.lev.centre_reference: each rank centres its own heads on the same reference ids) and
# "<variant>+rms" (equal-scale init: `rescale_output_` measures the full table, so every layout must
# scale by the same factor)
CASES = (*REGISTRY, "lev+centred", "lev+reference", *(f"{v}+rms" for v in REGISTRY))


def _cfg(case):
    # recompute is off: torch.utils.checkpoint's first call imports torch._dynamo (seconds per process);
    # recompute == stored is tested single-process in test_lev.py (the checkpoint is local to each rank)
    variant, _, option = case.partition("+")
    lev = LevConfig(
        k=2,
        d_seed=6,
        heads=4,
        kappa=5,
        rank=3,
        chunk_size=5,
        residual=True,
        recompute=False,
        centred=option == "centred",
        centre_reference=7 if option == "reference" else 0,
    )
    return ModelConfig(hidden_size=8, embedding=variant, lev=lev)


def _run(case, ids, probe, layout=SINGLE):
    """Build with seed 0, forward, backward of <out, probe>; return out, per-parameter grads, the
    materialised table and `sample_rows(SAMPLE)`."""
    torch.manual_seed(0)
    emb = build_input_embedding(_cfg(case), VOCAB, layout).double()
    if case.endswith("+rms"):
        emb.rescale_output_(TARGET_RMS)
    out = emb(ids)
    (out * probe).sum().backward()
    grads = {n: (p.grad, getattr(p, "tensor_model_parallel", False)) for n, p in emb.named_parameters()}
    return out.detach(), grads, emb.materialize(chunk_size=7), emb.sample_rows(SAMPLE)


def _to_numpy(result):
    """Plain arrays cross the process boundary safely (shared-memory tensors die with the child)."""
    out, grads, table, rows = result
    grads = {n: (g.numpy(), sharded) for n, (g, sharded) in grads.items()}
    return out.numpy(), grads, table.numpy(), rows.numpy()


def _tp_worker(tp, ids, probe):
    from megatron_lev.errors import ConfigError
    from megatron_lev.model.embeddings.lev import LevEmbedding
    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(tensor_model_parallel_size=tp)
    results = {case: _to_numpy(_run(case, ids, probe, layout)) for case in CASES}
    try:
        LevEmbedding(VOCAB, 8, LevConfig(heads=tp + 1), layout=layout)
        results["bad_heads_error"] = None
    except ConfigError as exc:
        results["bad_heads_error"] = str(exc)
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_single_process(tp):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    probe = torch.randn(2, 9, 8, generator=gen, dtype=torch.float64)
    ranks = run_distributed(_tp_worker, world_size=tp, args=(tp, ids, probe), timeout=240)
    for variant in CASES:
        ref_out, ref_grads, ref_table, ref_rows = _run(variant, ids, probe)
        torch.testing.assert_close(ref_rows, ref_table[SAMPLE], rtol=1e-12, atol=0, msg=f"{variant} rows")
        if variant.endswith("+rms"):
            assert float(ref_table.pow(2).mean().sqrt()) == pytest.approx(TARGET_RMS, rel=1e-12)
        for rank in ranks:
            out, grads, table, rows = (
                torch.from_numpy(x) if not isinstance(x, dict) else x for x in rank[variant]
            )
            torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12, msg=f"{variant} output")
            torch.testing.assert_close(table, ref_table, rtol=1e-10, atol=1e-12, msg=f"{variant} table")
            torch.testing.assert_close(rows, ref_rows, rtol=1e-10, atol=1e-12, msg=f"{variant} sample rows")
        for name, (ref_grad, sharded) in ref_grads.items():
            if sharded:  # per-head / per-vocab-row shards: gather along dim 0
                merged = torch.cat([torch.from_numpy(rank[variant][1][name][0]) for rank in ranks], dim=0)
                torch.testing.assert_close(merged, ref_grad, rtol=1e-10, atol=1e-12, msg=f"{variant} {name}")
            else:  # replicated: every rank holds the full gradient
                for rank in ranks:
                    torch.testing.assert_close(
                        torch.from_numpy(rank[variant][1][name][0]),
                        ref_grad,
                        rtol=1e-10,
                        atol=1e-12,
                        msg=f"{variant} {name}",
                    )
    assert all(f"model.lev.heads={tp + 1} is not divisible" in rank["bad_heads_error"] for rank in ranks)
