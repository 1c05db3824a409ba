import pytest
import torch

from megatron_lev.model.embeddings.spline import active_basis, quadratic_bspline, spline_basis


@pytest.mark.parametrize("kappa", [3, 4, 16, 32])
def test_basis_is_a_partition_of_unity_with_three_nonzeros(kappa):
    u = torch.cat(
        [torch.linspace(0, 1, 2001, dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)]
    )
    basis = spline_basis(u, kappa)
    assert basis.min() >= 0
    assert int((basis > 0).sum(-1).max()) <= 3
    torch.testing.assert_close(basis.sum(-1), torch.ones_like(u), rtol=0, atol=1e-12)


def test_basis_values_by_hand():
    # kappa = 4: x = 3u; raw beta(0) = 0.75, beta(1) = 0.125 -> normalised 6/7, 1/7 at u = 0
    u = torch.tensor([0.0, 0.1, 0.5, 1.0], dtype=torch.float64)
    expected = torch.tensor(
        [
            [6 / 7, 1 / 7, 0, 0],
            [0.66 / 0.98, 0.32 / 0.98, 0, 0],  # x = 0.3: beta(0.3) = 0.66, beta(0.7) = 0.32
            [0, 0.5, 0.5, 0],  # x = 1.5, midway between knots 1 and 2
            [0, 0, 1 / 7, 6 / 7],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(spline_basis(u, 4), expected, rtol=0, atol=1e-12)
    assert quadratic_bspline(torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0])).tolist() == [0.75, 0.5, 0.125, 0.0, 0.0]


def test_active_basis_equals_dense_basis():
    kappa = 16
    u = torch.rand(500, dtype=torch.float64)
    u[:3] = torch.tensor([0.0, 1.0, 0.5])
    index, weight = active_basis(u, kappa)
    assert index.shape == (500, 3) and int(index.min()) >= 0 and int(index.max()) < kappa
    dense = torch.zeros(500, kappa, dtype=torch.float64).scatter_add_(-1, index, weight)
    torch.testing.assert_close(dense, spline_basis(u, kappa), rtol=0, atol=1e-12)
