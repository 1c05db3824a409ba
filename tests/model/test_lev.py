import dataclasses

import pytest
import torch

from megatron_lev.config import LevConfig, ModelConfig
from megatron_lev.model.embeddings import build_input_embedding, lev_parameter_count
from megatron_lev.model.embeddings.lev import (
    LevEmbedding,
    digit_base,
    separable_product,
    spline_product,
    token_digits,
)
from megatron_lev.model.embeddings.spline import active_basis

SMALL = LevConfig(k=2, d_seed=6, heads=2, kappa=5, rank=3, chunk_size=4, recompute=False)


def make_lev(vocab=40, hidden=8, seed=0, **overrides):
    torch.manual_seed(seed)
    return LevEmbedding(vocab, hidden, dataclasses.replace(SMALL, **overrides)).double()


def test_digit_base_is_exact_integer_ceil_root():
    assert digit_base(50277, 3) == 37 and digit_base(200019, 3) == 59
    assert digit_base(27, 3) == 3 and digit_base(28, 3) == 4
    assert digit_base(10**18, 2) == 10**9 and digit_base(10**18 + 1, 2) == 10**9 + 1


def test_digits_round_trip_every_id_of_the_pile_vocabulary():
    vocab, k = 50277, 3
    base = digit_base(vocab, k)
    ids = torch.arange(vocab)
    digits = token_digits(ids, base, k)  # (V, k)
    assert int(digits.min()) >= 0 and int(digits.max()) < base
    rebuilt = (digits * base ** torch.arange(k)).sum(-1)
    assert torch.equal(rebuilt, ids)


def test_bad_token_ids_raise_clear_errors():
    emb = make_lev()
    with pytest.raises(IndexError, match="token id 40 is outside the vocabulary"):
        emb(torch.tensor([[1, 40]]))
    with pytest.raises(IndexError, match="token id -1"):
        emb(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="integer"):
        emb(torch.tensor([[1.0]]))


def _reference_modes(emb: LevEmbedding, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec written out directly for token i (dense basis, explicit product over coordinates,
    fp64): its modes `M (h, r)` and its seed `z`."""
    lev, kappa = emb.lev, emb.lev.kappa
    base = digit_base(emb.vocab_size, lev.k)
    C = emb.codebooks.weight.detach().view(lev.k, base, lev.d_seed)
    z = sum(C[j, (i // base**j) % base] for j in range(lev.k))
    modes = []
    for h in range(lev.heads):
        y = emb.proj[h].detach() @ z
        y = (y - y.mean()) / torch.sqrt(y.var(unbiased=False) + 1e-5)
        u = torch.sigmoid(y * emb.norm_weight[h].detach() + emb.norm_bias[h].detach())
        t = (kappa - 1) * u[:, None] - torch.arange(kappa, dtype=torch.float64)  # (d, kappa)
        raw = torch.where(
            t.abs() < 0.5,
            0.75 - t**2,
            torch.where(t.abs() < 1.5, 0.5 * (1.5 - t.abs()) ** 2, torch.zeros_like(t)),
        )
        basis = raw / raw.sum(-1, keepdim=True)
        phi = torch.einsum("jm,jmr->jr", basis, 1 + emb.delta[h].detach())  # (d, r)
        modes.append(phi.prod(dim=0))
    return torch.stack(modes), z


def reference_id_list(emb: LevEmbedding) -> list[int]:
    """The reference ids by their definition (LevConfig.centre_reference): R evenly spaced ids."""
    v, count = emb.vocab_size, emb.lev.centre_reference
    return list(range(v)) if count >= v else [((2 * j + 1) * v) // (2 * count) for j in range(count)]


def _reference(emb: LevEmbedding, ids: list[int]) -> torch.Tensor:
    """G by the spec, with the centring options: `centred` subtracts 1 from every mode,
    `centre_reference` subtracts the mean modes of the evenly spaced reference ids."""
    lev = emb.lev
    offset = 0.0
    if lev.centred:
        offset = 1.0
    elif lev.centre_reference:
        offset = torch.stack([_reference_modes(emb, j)[0] for j in reference_id_list(emb)]).mean(dim=0)
    rows = []
    for i in ids:
        modes, z = _reference_modes(emb, i)
        g = torch.einsum("hr,hrd->d", modes - offset, emb.out_proj.detach())
        if emb.residual is not None:
            g += emb.residual.weight.detach() @ z
        rows.append(g)
    return torch.stack(rows)


# the readout's centring: the spec's, `lev.centred` (M - 1), `lev.centre_reference` (M - mean over R ids)
CENTRING = {"spec": {}, "centred": {"centred": True}, "reference": {"centre_reference": 16}}


@pytest.mark.parametrize("centring", CENTRING)
@pytest.mark.parametrize("residual", [False, True])
def test_forward_matches_reference_implementation(residual, centring):
    emb = make_lev(residual=residual, **CENTRING[centring])
    with torch.no_grad():  # larger delta so phi moves far from 1 and some factors turn negative
        emb.delta.normal_(0.0, 1.5)
        emb.norm_bias.normal_(0.0, 2.0)
    ids = [0, 5, 39, 17, 5, 22]
    out = emb(torch.tensor([ids]))[0]
    torch.testing.assert_close(out, _reference(emb, ids), rtol=1e-5, atol=1e-5)


def test_separable_product_gradcheck_with_negative_factors():
    torch.manual_seed(1)
    weight = torch.rand(3, 2, 5, 3, dtype=torch.float64)
    weight = (weight / weight.sum(-1, keepdim=True)).requires_grad_()
    index = torch.randint(0, 4, (3, 2, 5, 3))
    delta = (2 * torch.randn(2, 5, 4, 6, dtype=torch.float64)).requires_grad_()  # phi of both signs
    assert torch.autograd.gradcheck(separable_product, (weight, index, delta))


@pytest.mark.parametrize("centring", CENTRING)
def test_lev_layer_gradcheck(centring):
    emb = make_lev(
        vocab=20,
        hidden=3,
        residual=True,
        chunk_size=3,
        recompute=True,
        d_seed=3,
        kappa=4,
        rank=2,
        **({"centre_reference": 7} if centring == "reference" else CENTRING[centring]),
    )
    names = [n for n, _ in emb.named_parameters()]
    ids = torch.tensor([[0, 3, 19, 3, 7, 12]])

    def fn(*params):
        return torch.func.functional_call(emb, dict(zip(names, params)), (ids,))

    params = tuple(p.detach().clone().requires_grad_() for p in emb.parameters())
    # fast mode: checks random projections of the full Jacobian of every parameter (incl. through recompute)
    assert torch.autograd.gradcheck(fn, params, fast_mode=True)


def _value_and_grads(emb, ids, seed=3):
    out = emb(ids)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * probe).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in emb.named_parameters()}


@pytest.mark.parametrize(
    "change",
    [dict(dedupe=False), dict(chunk_size=1000), dict(recompute=True)],
    ids=["unique-vs-full", "chunked-vs-unchunked", "recompute-vs-stored"],
)
@pytest.mark.parametrize("centring", CENTRING)
def test_execution_paths_agree(change, centring):
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(0))
    ref_out, ref_grads = _value_and_grads(make_lev(**CENTRING[centring]), ids)
    if "dedupe" in change:
        emb = make_lev(**CENTRING[centring])
        emb.dedupe = False
    else:
        emb = make_lev(**CENTRING[centring], **change)
    out, grads = _value_and_grads(emb, ids)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("centring", CENTRING)
def test_forward_equals_lookup_into_materialized_table(centring):
    emb = make_lev(residual=True, **CENTRING[centring])
    table = emb.materialize(chunk_size=7)
    assert table.shape == (40, 8) and not table.requires_grad
    ids = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(emb(ids), table[ids], rtol=1e-12, atol=1e-12)


def test_centre_reference_keeps_the_reference_rows_centred_through_training():
    """Without the residual path, the rows of the reference ids average to zero: at init and after
    AdamW steps that moved every parameter (the mean is recomputed from the current weights)."""
    emb = make_lev(centre_reference=16)
    ref = torch.tensor(reference_id_list(emb))
    assert len(set(ref.tolist())) == 16 and int(ref.min()) >= 0 and int(ref.max()) < 40
    opt = torch.optim.AdamW(emb.parameters(), lr=0.05)
    for step in range(4):
        table = emb.materialize()
        assert float(table[ref].mean(0).norm()) < 1e-12 * float(table.norm()), step
        opt.zero_grad()
        emb(torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
    # the spec's layer: a shared vector of about the rows' own size (every mode is close to 1)
    shared = make_lev().materialize()
    assert float(shared.mean(0).norm()) > 0.5 * float(shared.norm(dim=1).mean())


def test_seed_init_scale_changes_gradients_not_the_function_beyond_the_norm_eps():
    """G depends on the scale of the codebooks and W_l only through the LayerNorm's eps (1e-5): at
    the spec's init (std 0.02, d_seed 6) the variance of W_l z is below eps, so a larger init changes
    the table; between two inits large enough for eps not to matter (x100, x1000) the table is the same
    and their gradients are smaller by the scale."""
    base, x100, x1000 = make_lev(), make_lev(seed_init_scale=100.0), make_lev(seed_init_scale=1000.0)
    for name in ("codebooks.weight", "proj"):
        a, b = base.get_parameter(name), x100.get_parameter(name)
        torch.testing.assert_close(b, 100.0 * a, rtol=1e-6, atol=0)  # drawn in float32
    with torch.no_grad():
        y = torch.einsum("nd,hed->nhe", base.codebooks(torch.arange(40)), base.proj)
    assert float(y.var(dim=-1).mean()) < 1e-5  # the spec's init: below the LayerNorm's eps
    table = x100.materialize()
    assert float((base.materialize() - table).norm()) > 0.01 * float(table.norm())
    torch.testing.assert_close(x1000.materialize(), table, rtol=1e-4, atol=1e-6)
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    _, g100 = _value_and_grads(x100, ids)
    _, g1000 = _value_and_grads(x1000, ids)
    for name in ("codebooks.weight", "proj"):
        torch.testing.assert_close(g1000[name], g100[name] / 10.0, rtol=1e-3, atol=1e-10)
    torch.testing.assert_close(g1000["delta"], g100["delta"], rtol=1e-3, atol=1e-10)


def test_parameter_count_matches_spec_formula():
    torch.manual_seed(0)
    emb = LevEmbedding(50277, 1024, LevConfig())
    count = sum(p.numel() for p in emb.parameters())
    assert count == lev_parameter_count(50277, 1024, LevConfig()) == 1_720_192
    assert lev_parameter_count(50277, 1024, LevConfig(residual=True)) == 1_720_192 + 128 * 1024
    centred = LevEmbedding(50277, 1024, LevConfig(centred=True))  # centring adds no parameter
    assert (
        sum(p.numel() for p in centred.parameters())
        == lev_parameter_count(50277, 1024, LevConfig(centred=True))
        == 1_720_192
    )


def test_init_scale_and_w_out_init_scale():
    torch.manual_seed(0)
    emb = LevEmbedding(50277, 1024, LevConfig())
    with torch.no_grad():
        rows = emb.embed_ids(torch.randint(0, 50277, (48,)))
    # spec: row norm about 7.4 at D = 1024 with the default initialisation
    assert 6.0 < float(rows.norm(dim=-1).mean()) < 9.0
    torch.manual_seed(0)
    scaled = LevEmbedding(50277, 1024, LevConfig(w_out_init_scale=0.1))
    with torch.no_grad():
        torch.testing.assert_close(scaled.out_proj, 0.1 * emb.out_proj)


@pytest.mark.parametrize("variant,changes", [("lev", True), ("factorized_mlp", True), ("untied", False)])
def test_absent_token_moves_only_with_shared_structure(variant, changes):
    cfg = ModelConfig(hidden_size=8, embedding=variant, lev=dataclasses.replace(SMALL))
    torch.manual_seed(0)
    emb = build_input_embedding(cfg, 40)
    absent = 33
    ids = torch.tensor([[1, 2, 3, 30, 31, 32, 34, 35]])  # shares digits with 33 (base 7), never 33 itself
    before = emb.materialize()[absent].clone()
    opt = torch.optim.SGD(emb.parameters(), lr=0.5, weight_decay=0.0)
    emb(ids).square().sum().backward()
    opt.step()
    after = emb.materialize()[absent]
    assert (not torch.equal(before, after)) == changes


def _spec_product(weight, index, delta):
    """LEV.md step 6 written out: phi = sum_m B_m (1 + delta_m), M = sign * exp(sum_j log(|phi_j| + 1e-9))."""
    n, h, d, _ = weight.shape
    rows = (1 + delta)[
        torch.arange(h).view(1, h, 1, 1), torch.arange(d).view(1, 1, d, 1), index
    ]  # (N,h,d,3,r)
    phi = (weight.unsqueeze(-1) * rows).sum(-2)  # (N, h, d, r)
    sign = 1.0 - 2.0 * ((phi < 0).sum(2) % 2).to(phi.dtype)
    return sign * torch.exp(torch.log(phi.abs() + 1e-9).sum(2))


def _latent_case(case, n=5, h=2, d=40, kappa=6, r=3, spread=1.5):
    """Latent coordinates u and a delta whose factors exercise one path of the grouped product."""
    gen = torch.Generator().manual_seed(7)
    u = torch.rand(n, h, d, generator=gen, dtype=torch.float64)
    delta = spread * torch.randn(h, d, kappa, r, generator=gen, dtype=torch.float64)  # 1.5: both signs
    if case == "tiny":  # |phi| = 1e-5 at a few (head, coordinate, rank): below SAFE_FACTOR
        delta[0, 3, :, 1] = -1 + 1e-5
        delta[1, 20, :, 0] = -1 - 1e-5
    elif case == "underflow":  # every factor 0.01: a group of 16 multiplies to 1e-32
        delta.fill_(-0.99)
    elif case == "overflow":  # every factor 100: a group of 16 multiplies to 1e32
        delta.fill_(99.0)
    return u, delta


def _basis_case(case, **kwargs):
    """Basis weights/indices (of `_latent_case`'s u) and its delta."""
    u, delta = _latent_case(case, **kwargs)
    index, weight = active_basis(u, delta.shape[2])
    return weight, index, delta


@pytest.mark.parametrize("mode", ["gather", "dense", "kernel"])
@pytest.mark.parametrize("case", ["mixed", "tiny", "underflow", "overflow"])
def test_grouped_product_matches_spec_formula(case, mode):
    """From u through the basis and the product, values and gradients (u and delta) against LEV.md."""
    u, delta = _latent_case(case)
    kappa = delta.shape[2]
    u1, d1 = u.clone().requires_grad_(), delta.clone().requires_grad_()
    u2, d2 = u.clone().requires_grad_(), delta.clone().requires_grad_()
    out = spline_product(u1, d1, kappa, mode)
    index, weight = active_basis(u2, kappa)
    weight.retain_grad()
    ref = _spec_product(weight, index, d2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0.0)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * probe).sum().backward()
    (ref * probe).sum().backward()
    # plain groups use the exact product (the eps moves a factor >= 1e-3 by < 1e-6 relative)
    # d/du sums terms of the size of d/dweight * (kappa - 1) that cancel where delta is flat over the knots
    u_scale = (kappa - 1) * float(weight.grad.abs().max())
    torch.testing.assert_close(u1.grad, u2.grad, rtol=1e-5, atol=1e-8 * u_scale)
    torch.testing.assert_close(d1.grad, d2.grad, rtol=1e-5, atol=1e-8 * float(d2.grad.abs().max()))
    with torch.no_grad():  # the no-grad path (eval, materialize) gives the same values
        torch.testing.assert_close(spline_product(u, delta, kappa, mode), out.detach(), rtol=1e-12, atol=0.0)


def test_fused_kernel_gradcheck_through_the_basis():
    gen = torch.Generator().manual_seed(2)
    u = torch.rand(
        4, 2, 20, generator=gen, dtype=torch.float64
    )  # 20 coordinates: one full and one short group
    u[0, 0, :3] = torch.tensor([0.0, 1.0, 0.5])  # the ends of [0, 1] and a knot
    delta = 1.5 * torch.randn(2, 20, 5, 3, generator=gen, dtype=torch.float64)  # both signs
    assert torch.autograd.gradcheck(
        lambda a, b: spline_product(a, b, 5, "kernel"), (u.requires_grad_(), delta.requires_grad_())
    )


@pytest.mark.parametrize(
    "case,expect", [("mixed", False), ("tiny", True), ("underflow", True), ("overflow", True)]
)
def test_grouped_product_falls_back_per_factor_exactly_where_needed(case, expect):
    from megatron_lev.model.embeddings.lev import _group_product

    weight, index, delta = _basis_case(case, spread=0.1)  # phi near 1 except where the case sets it
    rows = (1 + delta)[torch.arange(2).view(1, 2, 1, 1), torch.arange(40).view(1, 1, 40, 1), index]
    phi = (weight.unsqueeze(-1) * rows).sum(-2).permute(1, 2, 0, 3)[:, :16]  # (h, 16, N, r): one group
    _, _, bad = _group_product(phi.contiguous())
    assert bool(bad.any()) == expect
    if case == "tiny":
        assert bool(bad[0, :, 1].all()) and int(bad.sum()) == 5  # only head 0, rank 1 (coordinate 3)


@pytest.mark.parametrize("centred", [False, True])
def test_phi_modes_agree_in_the_layer(centred):
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("gather", "dense", "kernel"):
        emb = make_lev(centred=centred)
        with torch.no_grad():
            emb.delta.normal_(0.0, 1.5)
        import megatron_lev.model.embeddings.lev as lev_module

        saved = dict(lev_module.PHI_MODE_BY_DEVICE)
        lev_module.PHI_MODE_BY_DEVICE["cpu"] = mode
        try:
            results[mode] = _value_and_grads(emb, ids)
        finally:
            lev_module.PHI_MODE_BY_DEVICE.update(saved)
    for other in ("dense", "kernel"):
        torch.testing.assert_close(results["gather"][0], results[other][0], rtol=1e-10, atol=1e-12)
        for name, grad in results["gather"][1].items():
            torch.testing.assert_close(
                grad, results[other][1][name], rtol=1e-10, atol=1e-12, msg=f"{other} {name}"
            )


def test_unknown_phi_mode_is_refused():
    weight, index, delta = _basis_case("mixed")
    with pytest.raises(ValueError, match="phi mode must be one of"):
        separable_product(weight, index, delta, "sparse")


def test_centred_is_the_default_minus_the_all_ones_term():
    """Same parameters: centred G = default G - sum_l 1^T W_out_l (one constant vector for every id)."""
    default, centred = make_lev(residual=True), make_lev(residual=True, centred=True)
    centred.load_state_dict(default.state_dict())
    shift = default.out_proj.detach().sum(dim=(0, 1))  # (D,)
    torch.testing.assert_close(centred.materialize(), default.materialize() - shift, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_centred_table_has_far_lower_mean_pairwise_cosine_at_init(seed):
    """The spec's layer at D = 128 (spec defaults otherwise): its rows share one dominant direction
    (mean pairwise cosine ~0.56); without the all-ones term they mostly do not (~0.15)."""
    from megatron_lev.analysis.cosine import gram_moments

    means = {}
    for centred in (False, True):
        torch.manual_seed(seed)
        emb = LevEmbedding(4096, 128, LevConfig(centred=centred))
        means[centred] = gram_moments(emb.materialize())[0]
    assert means[False] > 0.4 and means[True] < 0.2, means
