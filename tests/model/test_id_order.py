"""Token-id order (`model.lev.id_order`): bpe, random, frequency; a permutation stored with the model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron_lev.config import LevConfig, ModelConfig, load_config
from megatron_lev.errors import CheckpointDataError, ConfigError
from megatron_lev.model.canonical import canonical_state_dict_spec, parameter_specs
from megatron_lev.model.embeddings import build_input_embedding
from megatron_lev.model.embeddings.id_order import frequency_ranks, random_ranks
from megatron_lev.model.embeddings.lev import LevEmbedding, digit_base
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.testing import run_distributed

VOCAB = 48  # divisible by 2 for the TP test
SMALL = LevConfig(k=2, d_seed=6, heads=2, kappa=5, rank=3, chunk_size=5, recompute=False, residual=True)
ORDERS = ("bpe", "random", "frequency")
VARIANTS = ("lev", "factorized_mlp")  # the two variants built on the compositional index


@pytest.fixture
def counts_file(tmp_path):
    """Training counts of a 40-id tokenizer (shorter than the padded vocabulary: the rest count 0)."""
    counts = np.random.default_rng(0).integers(0, 50, size=40).astype(np.int64)
    counts[17] = 10_000  # the most frequent id
    counts[[3, 5, 30]] = 7  # a tie, broken by id
    path = tmp_path / "train_text_document.counts.npy"
    np.save(path, counts)
    return path


def _lev(order: str, counts=None, seed: int = 0, **overrides) -> LevConfig:
    return dataclasses.replace(
        SMALL,
        id_order=order,
        id_order_seed=seed,
        id_order_counts=str(counts) if order == "frequency" else None,
        **overrides,
    )


def _build(variant: str, lev: LevConfig, vocab: int = VOCAB, seed: int = 0):
    torch.manual_seed(seed)
    return build_input_embedding(ModelConfig(hidden_size=8, embedding=variant, lev=lev), vocab).double()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("order", ORDERS)
def test_forward_equals_lookup_into_materialized_table(order, variant, counts_file):
    emb = _build(variant, _lev(order, counts_file))
    table = emb.materialize(chunk_size=7)
    assert table.shape == (VOCAB, 8)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(emb(ids), table[ids], rtol=1e-12, atol=1e-12)
    assert ("codebooks.id_rank" in emb.state_dict()) == (order != "bpe")


@pytest.mark.parametrize("variant", VARIANTS)
def test_bpe_is_the_model_without_the_key(variant):
    """The default stores nothing and computes exactly what a config without the key computes; the
    other orders draw every parameter as bpe does and give token i the row bpe gives id_rank[i]."""
    base = LevConfig(k=2, d_seed=6, heads=2, kappa=5, rank=3, chunk_size=5, recompute=False, residual=True)
    plain = _build(variant, base)
    bpe = _build(variant, dataclasses.replace(base, id_order="bpe"))
    assert list(plain.state_dict()) == list(bpe.state_dict())
    ids = torch.arange(VOCAB).view(4, -1)
    assert torch.equal(plain(ids), bpe(ids))
    assert torch.equal(plain.materialize(), bpe.materialize())

    permuted = _build(variant, _lev("random", seed=3))
    for name, tensor in plain.state_dict().items():  # the permutation's draw leaves the others alone
        assert torch.equal(tensor, permuted.state_dict()[name]), name
    rank = permuted.codebooks.id_rank
    torch.testing.assert_close(permuted.materialize(), plain.materialize()[rank], rtol=0, atol=1e-12)


def test_random_order_is_a_seeded_bijection():
    a, b = random_ranks(VOCAB, 0), random_ranks(VOCAB, 0)
    assert torch.equal(a, b) and a.dtype == torch.int64
    assert torch.equal(a.sort().values, torch.arange(VOCAB))
    assert not torch.equal(a, random_ranks(VOCAB, 1)) and not torch.equal(a, torch.arange(VOCAB))
    # the module's buffer is this permutation, whatever the global RNG state
    torch.manual_seed(123)
    emb = LevEmbedding(VOCAB, 8, _lev("random", seed=0))
    assert torch.equal(emb.codebooks.id_rank, a)


def test_frequency_order_ranks_by_count_most_frequent_first(counts_file):
    counts = np.load(counts_file)
    rank = frequency_ranks(counts, VOCAB)
    assert torch.equal(rank.sort().values, torch.arange(VOCAB))  # a bijection of the padded vocabulary
    assert int(rank[17]) == 0  # the most frequent id gets the first rank (digits 0, 0)
    assert int(rank[3]) + 1 == int(rank[5]) and int(rank[5]) + 1 == int(rank[30])  # ties by id
    by_rank = torch.empty(VOCAB, dtype=torch.int64)
    by_rank[rank] = torch.arange(VOCAB)
    padded = np.concatenate([counts, np.zeros(VOCAB - len(counts), dtype=np.int64)])
    assert (np.diff(padded[by_rank.numpy()]) <= 0).all()  # counts never increase along the ranks
    assert torch.equal(rank[40:], torch.arange(40, VOCAB))  # padding ids count 0 and come last, by id
    emb = LevEmbedding(VOCAB, 8, _lev("frequency", counts_file))
    assert torch.equal(emb.codebooks.id_rank, rank)
    again = LevEmbedding(VOCAB, 8, _lev("frequency", counts_file))  # deterministic: the same order
    assert torch.equal(again.codebooks.id_rank, rank)
    with pytest.raises(
        ConfigError, match=r"counts 50 token ids but the model's \(padded\) vocabulary has 48"
    ):
        frequency_ranks(np.ones(50, dtype=np.int64), VOCAB, "other.counts.npy")
    assert torch.equal(
        frequency_ranks(np.r_[np.ones(VOCAB), np.zeros(5)].astype(np.int64), VOCAB), torch.arange(VOCAB)
    )


def test_digits_follow_the_rank():
    """LEV.md step 1 with the order: token i takes the digits of rank[i]."""
    emb = LevEmbedding(VOCAB, 8, _lev("random", seed=5))
    rank = emb.codebooks.id_rank
    base = digit_base(VOCAB, SMALL.k)
    C = emb.codebooks.weight.detach().view(SMALL.k, base, SMALL.d_seed)
    for i in (0, 7, 47):
        r = int(rank[i])
        z = sum(C[j, (r // base**j) % base] for j in range(SMALL.k))
        torch.testing.assert_close(emb.codebooks(torch.tensor([i]))[0], z)


def test_a_frequency_model_without_its_counts_waits_for_a_checkpoint(counts_file, tmp_path):
    trained = _build("lev", _lev("frequency", counts_file), seed=1)
    lev = _lev("frequency", tmp_path / "elsewhere.counts.npy")  # not on this machine
    cfg = ModelConfig(hidden_size=8, embedding="lev", lev=lev, input_init_rms=0.05)
    from megatron_lev.model.stages import EmbeddingStage

    stage = EmbeddingStage(cfg, VOCAB, seed=0)  # builds (the equal-scale rescale waits for the weights)
    emb = stage.embedding.double()
    assert emb.awaits_checkpoint
    with pytest.raises(ConfigError, match=r"^model.lev.id_order=frequency: the model has no token order"):
        emb(torch.tensor([[1, 2]]))
    emb.load_state_dict(trained.state_dict())
    assert not emb.awaits_checkpoint
    ids = torch.tensor([[1, 2, 17, 40]])
    assert torch.equal(emb(ids), trained(ids))
    bad = dict(trained.state_dict(), **{"codebooks.id_rank": torch.zeros(VOCAB, dtype=torch.int64)})
    with pytest.raises(
        CheckpointDataError, match="codebooks.id_rank: the stored token order is not a permutation"
    ):
        _build("lev", lev).load_state_dict(bad)
    with pytest.raises(RuntimeError, match="Unexpected key.*codebooks.id_rank"):  # a bpe model refuses it
        _build("lev", SMALL).load_state_dict(trained.state_dict())


@pytest.mark.parametrize("order", ORDERS)
def test_canonical_spec_lists_the_order_as_a_replicated_buffer(order, counts_file):
    cfg = ModelConfig(hidden_size=8, num_attention_heads=2, embedding="lev", lev=_lev(order, counts_file))
    specs = canonical_state_dict_spec(cfg, VOCAB)
    spec = specs.get("embedding.codebooks.id_rank")
    if order == "bpe":
        assert spec is None and specs == parameter_specs(specs)
    else:
        assert spec.buffer and spec.partition_dim is None and spec.shape == (VOCAB,)
        assert "embedding.codebooks.id_rank" not in parameter_specs(specs)


def test_reshard_repads_the_order_as_a_permutation():
    """Another padded vocabulary: real ids keep their ranks (their rows are unchanged), padding ids
    take the ranks left over; a real id ranked past the new size is refused."""
    from megatron_lev.convert.reshard import adapt_rows
    from megatron_lev.engine.checkpoint_files import CheckpointError

    name, vocab = "embedding.codebooks.id_rank", 50
    rank = random_ranks(64, 0)
    for padded in (64, 128):
        new = adapt_rows(name, rank, (padded,), vocab)
        assert torch.equal(new[:vocab], rank[:vocab]) and torch.equal(new.sort().values, torch.arange(padded))
    assert int(rank[:vocab].max()) >= 52
    with pytest.raises(CheckpointError, match="does not fit the new padded vocabulary of 52"):
        adapt_rows(name, rank, (52,), vocab)
    ordered = frequency_ranks(np.arange(1, vocab + 1), 64)  # every real id seen: ranks 0..49
    assert torch.equal(
        adapt_rows(name, ordered, (52,), vocab), torch.cat([ordered[:vocab], torch.tensor([50, 51])])
    )


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["model.lev.id_order=frequncy"],
            r"^model.lev.id_order='frequncy' is not one of bpe, random, frequency "
            r"\(did you mean 'frequency'\?\)$",
        ),
        (
            ["model.lev.id_order_seed=-1"],
            r"^model.lev.id_order_seed=-1 is out of range: must be an integer in \[0, 4294967295\]",
        ),
        (["model.lev.id_order_seed=abc"], r"^model.lev.id_order_seed must be an integer, got 'abc'$"),
        (["model.lev.id_order_seed=1.5"], r"^model.lev.id_order_seed must be an integer, got 1.5$"),
        (
            ["model.lev.id_order=random", "model.lev.id_order_counts=x.counts.npy"],
            r"^model.lev.id_order_counts='x.counts.npy' is set but model.lev.id_order='random': .*set "
            r"model.lev.id_order=frequency or unset model.lev.id_order_counts$",
        ),
        (["model.lev.id_order_counts=x.counts.npy"], r"model.lev.id_order='bpe'"),
        (
            ["model.lev.id_order=frequency", "model.lev.id_order_counts=' '"],
            r"^model.lev.id_order_counts is an empty string",
        ),
    ],
)
def test_config_errors_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config([], overrides)
    assert "\n" not in str(info.value)


def test_config_accepts_the_orders():
    cfg = load_config([], ["model.lev.id_order=random", "model.lev.id_order_seed=7"])
    assert (cfg.model.lev.id_order, cfg.model.lev.id_order_seed) == ("random", 7)
    assert load_config([], []).model.lev.id_order == "bpe"
    assert load_config([], ["model.lev.id_order=frequency"]).model.lev.id_order_counts is None


def _run_cfg(tmp_path, *over):
    items = [
        f"data.data_path=[{tmp_path}/train_text_document]",
        "data.tokenizer_path=tok.json",
        f"logging.output_dir={tmp_path}/run",
        *over,
    ]
    return load_config(None, items, validate=False)


def test_the_plan_fills_the_counts_from_the_first_training_prefix(tmp_path, counts_file):
    from megatron_lev.plan import validate_run

    plan = validate_run(_run_cfg(tmp_path, "model.lev.id_order=frequency"), 1, cuda=False)
    assert plan.cfg.model.lev.id_order_counts == str(counts_file)
    assert f"id_order_counts: {counts_file}" in plan.cfg.to_yaml()  # what the run records
    blend = _run_cfg(
        tmp_path,
        "model.lev.id_order=frequency",
        f"data.data_path=[0.3, {tmp_path}/train_text_document, 0.7, b]",
    )
    assert validate_run(blend, 1, cuda=False).cfg.model.lev.id_order_counts == str(counts_file)
    for order in ("bpe", "random"):  # nothing to fill
        cfg = _run_cfg(tmp_path, f"model.lev.id_order={order}")
        assert validate_run(cfg, 1, cuda=False).cfg.model.lev.id_order_counts is None


def test_the_plan_refuses_missing_counts_in_one_line(tmp_path):
    from megatron_lev.plan import validate_run

    data = tmp_path / "train_text_document"
    # the data is not there yet (a grid checks its runs before preprocessing): nothing to refuse yet
    validate_run(_run_cfg(tmp_path, "model.lev.id_order=frequency"), 1, cuda=False)
    (tmp_path / "train_text_document.idx").write_bytes(b"")  # the data is there, its counts are not
    with pytest.raises(ConfigError) as info:
        validate_run(_run_cfg(tmp_path, "model.lev.id_order=frequency"), 1, cuda=False)
    msg = str(info.value)
    assert "\n" not in msg and f"model.lev.id_order_counts='{data}.counts.npy'" in msg
    assert "has no train_text_document.counts.npy" in msg and "rerun `megatron-lev preprocess`" in msg
    with pytest.raises(ConfigError, match=r"model.lev.id_order_counts='nowhere.npy': it is not there"):
        validate_run(
            _run_cfg(tmp_path, "model.lev.id_order=frequency", "model.lev.id_order_counts=nowhere.npy"),
            1,
            cuda=False,
        )
    # a run that resumes takes its order from the checkpoint: the counts file is not needed
    tag = tmp_path / "run" / "checkpoints" / "iter_0000002"
    tag.mkdir(parents=True)
    (tag / "complete").write_text("{}")
    cfg = _run_cfg(tmp_path, "model.lev.id_order=frequency", "model.lev.id_order_counts=nowhere.npy")
    assert validate_run(cfg, 1, cuda=False).cfg.model.lev.id_order_counts == "nowhere.npy"


def test_seed_and_counts_are_free_on_resume_and_the_order_is_fixed():
    from megatron_lev.ckpt.record import TRAINING_ONLY_MODEL_KEYS
    from megatron_lev.training.resume import kind_of

    assert kind_of("model.lev.id_order_seed") == kind_of("model.lev.id_order_counts") == "free"
    assert kind_of("model.lev.id_order") == "fixed"
    assert {"lev.id_order_seed", "lev.id_order_counts"} <= TRAINING_ONLY_MODEL_KEYS
    assert "lev.id_order" not in TRAINING_ONLY_MODEL_KEYS


# ----------------------------------------------------------------------------- tensor parallel


def _tp_run(lev: LevConfig, ids: torch.Tensor, probe: torch.Tensor, layout=SINGLE):
    torch.manual_seed(0)
    emb = LevEmbedding(VOCAB, 8, lev, layout=layout).double()
    out = emb(ids)
    (out * probe).sum().backward()
    return out.detach().numpy(), emb.materialize(chunk_size=7).numpy(), emb.codebooks.id_rank.numpy()


def _tp_worker(configs, ids, probe):
    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(tensor_model_parallel_size=2)
    return {order: _tp_run(lev, ids, probe, layout) for order, lev in configs.items()}


@pytest.mark.multiprocess
def test_tensor_parallel_matches_one_process(counts_file):
    configs = {"random": _lev("random", seed=9), "frequency": _lev("frequency", counts_file)}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
    probe = torch.randn(2, 9, 8, generator=gen, dtype=torch.float64)
    ranks = run_distributed(_tp_worker, world_size=2, args=(configs, ids, probe), timeout=240)
    for order, lev in configs.items():
        out, table, rank = _tp_run(lev, ids, probe)
        for r, res in enumerate(ranks):
            got_out, got_table, got_rank = res[order]
            np.testing.assert_array_equal(got_rank, rank, err_msg=f"{order} rank {r}")  # replicated
            np.testing.assert_allclose(got_out, out, rtol=1e-12, atol=1e-12, err_msg=f"{order} rank {r}")
            np.testing.assert_allclose(got_table, table, rtol=1e-12, atol=1e-12, err_msg=f"{order} rank {r}")
            np.testing.assert_allclose(got_table[ids.numpy()], got_out, rtol=1e-12, atol=1e-12)
