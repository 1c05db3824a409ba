import pytest
import torch

from megatron_lev.config import LevConfig, ModelConfig
from megatron_lev.errors import ConfigError
from megatron_lev.model.embeddings import (
    REGISTRY,
    baseline_sizes,
    build_input_embedding,
    embedding_class,
    lev_parameter_count,
    parameter_counts,
)

PILE_V, D = 50277, 1024


def small_cfg(variant, **kw):
    return ModelConfig(
        hidden_size=16, embedding=variant, lev=LevConfig(k=2, d_seed=8, heads=2, kappa=5, rank=4), **kw
    )


@pytest.mark.parametrize("variant", list(REGISTRY))
def test_every_variant_embeds_materializes_and_counts_its_parameters(variant):
    cfg = small_cfg(variant)
    torch.manual_seed(0)
    emb = build_input_embedding(cfg, 96)
    ids = torch.randint(0, 96, (2, 7))
    out = emb(ids)
    assert out.shape == (2, 7, 16)
    torch.testing.assert_close(out, emb.materialize(chunk_size=40)[ids], rtol=1e-6, atol=1e-6)
    counts = parameter_counts(variant, 96, 16, cfg)
    assert counts["input"] == sum(p.numel() for p in emb.parameters())
    assert counts["output"] == (0 if embedding_class(variant).ties_output_head else 96 * 16)
    assert counts["total_embedding"] == counts["input"] + counts["output"]
    tied = emb.tied_output_weight()
    assert (tied is not None) == embedding_class(variant).ties_output_head
    if tied is not None:
        assert tied is emb.table.weight and tied.shape == (96, 16)


@pytest.mark.parametrize("variant", ["flat_mlp", "factorized_mlp"])
@pytest.mark.parametrize("vocab", [PILE_V, 50304, 200019])
def test_mlp_baselines_match_lev_within_one_percent(variant, vocab):
    cfg = ModelConfig(hidden_size=D, embedding=variant)
    target = lev_parameter_count(vocab, D, cfg.lev)
    count = parameter_counts(variant, vocab, D, cfg)["input"]
    assert abs(count - target) / target < 0.01


def test_albert_width_is_the_closest_match():
    # one unit of e costs V + D parameters (3% of LEV here): the nearest e is the best match
    cfg = ModelConfig(hidden_size=D, embedding="albert")
    target = lev_parameter_count(PILE_V, D, cfg.lev)
    dim, _ = baseline_sizes("albert", PILE_V, D, cfg)
    assert dim == 34
    gaps = [abs((PILE_V + D) * e - target) for e in (dim - 1, dim, dim + 1)]
    assert gaps[1] == min(gaps) and gaps[1] <= (PILE_V + D) / 2


def test_explicit_widths_override_matching():
    cfg = ModelConfig(hidden_size=D, embedding="flat_mlp", baseline_dim=64, baseline_hidden=256)
    assert baseline_sizes("flat_mlp", PILE_V, D, cfg) == (64, 256)
    assert parameter_counts("flat_mlp", PILE_V, D, cfg)["input"] == PILE_V * 64 + 64 * 256 + 256 * D
    with pytest.raises(ConfigError, match="model.embedding='lev' has no sizes"):
        baseline_sizes("lev", PILE_V, D, cfg)


def test_dense_counts_and_unknown_variant():
    cfg = ModelConfig(hidden_size=D)
    assert parameter_counts("tied", PILE_V, D, cfg) == {
        "input": PILE_V * D,
        "output": 0,
        "total_embedding": PILE_V * D,
    }
    assert parameter_counts("untied", PILE_V, D, cfg)["total_embedding"] == 2 * PILE_V * D
    assert parameter_counts("lev", PILE_V, D, cfg)["input"] == 1_720_192
    cfg.embedding = "dense"
    with pytest.raises(ConfigError, match="model.embedding='dense'"):
        build_input_embedding(cfg, 128)


def _narrow_cfg(**kw) -> ModelConfig:
    kw.setdefault("lev", LevConfig(k=3, d_seed=32, heads=4, kappa=16, rank=16))
    return ModelConfig(hidden_size=128, num_attention_heads=4, **kw)


@pytest.mark.parametrize("variant", ["albert", "flat_mlp"])
def test_a_degenerate_bottleneck_is_refused_and_the_message_says_what_fits(variant):
    """The tiny shape with GPT-NeoX's vocabulary: LEV has 48,864 parameters, so the matched ALBERT /
    FLAT-MLP tables are 1 wide. The smallest `model.lev.heads` named in the message does fit."""
    cls = embedding_class(variant)
    cfg = _narrow_cfg()
    assert cls.widths(cfg, 50304)[0] == 1 and cls.narrow_widths(cfg, 50304)[0][1] == 1
    with pytest.raises(ConfigError) as info:
        cls.check_vocab(cfg, 50304)
    msg = str(info.value)
    for fragment in (f"model.embedding={variant}", "is 1, below model.min_compressed_width=16", "50,304"):
        assert fragment in msg, msg
    heads = int(msg.split("model.lev.heads=")[1].split()[0])
    fits = _narrow_cfg()
    fits.lev.heads = heads
    cls.check_vocab(fits, 50304)
    fits.lev.heads = heads - 1
    with pytest.raises(ConfigError):
        cls.check_vocab(fits, 50304)
    cls.check_vocab(_narrow_cfg(min_compressed_width=1), 50304)  # the key lowers the bar
    cls.check_vocab(cfg, 1024)  # a small vocabulary: LEV's budget buys wider tables


def test_the_width_rule_names_the_key_to_raise_and_skips_dense_and_lev():
    with pytest.raises(
        ConfigError, match=r"seed width e \(model\.lev\.d_seed\) is 8.*set model\.lev\.d_seed to at least 16"
    ):
        embedding_class("factorized_mlp").check_vocab(_narrow_cfg(lev=LevConfig(d_seed=8)), 2048)
    with pytest.raises(ConfigError, match=r"is 4, below.*set model\.baseline_dim to at least 16"):
        embedding_class("albert").check_vocab(_narrow_cfg(baseline_dim=4), 2048)
    for variant in ("tied", "untied", "lev"):
        embedding_class(variant).check_vocab(_narrow_cfg(), 50304)  # no widths: nothing to refuse
    # with model.vocab_size set the config itself is refused; unset, the trainer checks the tokenizer's
    from megatron_lev.config import load_config
    from megatron_lev.plan import validate_config

    with pytest.raises(ConfigError, match="model.embedding=albert"):
        validate_config(
            load_config(None, ["model.embedding=albert", "model.vocab_size=50277", "model.lev.heads=1"])
        )
    validate_config(load_config(None, ["model.embedding=albert", "model.lev.heads=1"]))
