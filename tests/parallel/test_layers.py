"""Column/row-parallel linear layers and the vocabulary-parallel cross-entropy vs. the single-process ops."""

import pytest
import torch
import torch.nn.functional as F

from megatron_lev.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.testing import run_distributed


def _column_row(x, seed, tp):
    from megatron_lev.parallel import state
    from megatron_lev.parallel.layers import ColumnParallelLinear, RowParallelLinear

    layout = state.initialize_model_parallel(tp) if tp > 1 else SINGLE
    torch.manual_seed(seed)
    col = ColumnParallelLinear(8, 12, layout=layout)
    row = RowParallelLinear(12, 6, layout=layout)
    fused = ColumnParallelLinear(8, 12, part_sizes=(4, 8), layout=layout)  # two parts, each split over ranks
    x = x.clone().requires_grad_(True)
    y = row(F.silu(col(x)))
    (y * torch.arange(6.0)).sum().backward()
    out = (
        y.detach(),
        x.grad,
        col.weight.detach(),
        col.weight.grad,
        row.weight.detach(),
        row.weight.grad,
        fused.weight.detach(),
        fused(x).detach(),
    )
    return tuple(t.numpy() for t in out)  # by value: shared-memory tensors can vanish with the process


def _tp2_suite(x, logits, target, weights):
    """Both TP = 2 checks in one process group (spawning processes is the slow part)."""
    return _column_row(x, 7, 2), _vocab_ce(logits, target, weights, 2)


def _ce_inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 16, dtype=torch.float64, generator=g) * 4
    return (
        logits,
        torch.randint(0, 16, (2, 5), generator=g),
        torch.rand(2, 5, dtype=torch.float64, generator=g),
    )


X = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(_tp2_suite, world_size=2, args=(X, *_ce_inputs()))


@pytest.mark.multiprocess
def test_column_row_parallel_linear_match_nn_linear(tp2_results):
    x = X
    ref_y, ref_gx, ref_a, ref_ga, ref_b, ref_gb, ref_f, ref_fy = map(torch.from_numpy, _column_row(x, 7, 1))
    # the single-process layers are plain linear maps with the seed's weights
    lin_a, lin_b = torch.nn.Linear(8, 12, bias=False), torch.nn.Linear(12, 6, bias=False)
    with torch.no_grad():
        lin_a.weight.copy_(ref_a)
        lin_b.weight.copy_(ref_b)
    torch.testing.assert_close(lin_b(F.silu(lin_a(x))), ref_y)
    for rank, result in enumerate(r[0] for r in tp2_results):
        y, gx, a, ga, b, gb, f, fy = map(torch.from_numpy, result)
        torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, ref_gx, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, ref_a.chunk(2)[rank])
        torch.testing.assert_close(ga, ref_ga.chunk(2)[rank], rtol=1e-5, atol=1e-6)
        # fused shard = [part0 slice r ; part1 slice r], and so is its output's last dim
        torch.testing.assert_close(f, torch.cat([ref_f[0:4].chunk(2)[rank], ref_f[4:12].chunk(2)[rank]]))
        part0, part1 = ref_fy[..., 0:4].chunk(2, -1)[rank], ref_fy[..., 4:12].chunk(2, -1)[rank]
        torch.testing.assert_close(fy, torch.cat([part0, part1], -1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, ref_b.chunk(2, dim=1)[rank])
        torch.testing.assert_close(gb, ref_gb.chunk(2, dim=1)[rank], rtol=1e-5, atol=1e-6)


def _vocab_ce(logits, target, weights, tp):
    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(tp)
    shard = logits.chunk(tp, dim=-1)[layout.tp_rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, layout=layout)
    (loss * weights).sum().backward()
    return loss.detach().numpy(), shard.grad.numpy()


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(tp, request):
    logits, target, weights = _ce_inputs()
    full = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction="none").view(2, 5)
    (ref * weights).sum().backward()
    if tp == 2:
        results = [r[1] for r in request.getfixturevalue("tp2_results")]
    else:
        results = run_distributed(_vocab_ce, world_size=tp, args=(logits, target, weights, tp))
    for rank, result in enumerate(results):
        loss, grad = map(torch.from_numpy, result)
        torch.testing.assert_close(loss, ref.detach().float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, full.grad.chunk(tp, dim=-1)[rank], rtol=1e-5, atol=1e-6)


def test_cross_entropy_single_process_bf16_grad_dtype():
    logits = torch.randn(4, 32).bfloat16().requires_grad_(True)
    target = torch.randint(0, 32, (4,))
    loss = vocab_parallel_cross_entropy(logits, target, layout=SINGLE)
    assert loss.dtype == torch.float32
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target, reduction="none"))


def test_cross_entropy_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(torch.randn(2, 3, 8), torch.zeros(2, 4, dtype=torch.long), layout=SINGLE)
