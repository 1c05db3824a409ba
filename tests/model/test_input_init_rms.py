"""Equal-scale initialisation (`model.input_init_rms`): every variant's input layer starts at the
same output RMS, by a rescale of its final linear map only (no new parameters or buffers)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lev.config import LevConfig, ModelConfig
from megatron_lev.errors import ConfigError
from megatron_lev.model.embeddings import REGISTRY, base
from megatron_lev.model.stages import EmbeddingStage
from megatron_lev.training.callbacks import EmbeddingProbe

LEV = LevConfig(k=2, d_seed=8, heads=2, kappa=5, rank=4, chunk_size=64, recompute=False)
VOCAB, TARGET = 256, 0.05


def _cfg(variant, rms=None, **lev):
    return ModelConfig(
        hidden_size=32, embedding=variant, lev=dataclasses.replace(LEV, **lev), input_init_rms=rms
    )


class _Trainer:
    rank = 0


@pytest.mark.parametrize("variant", [*REGISTRY, "lev-centred"])
def test_first_step_rms_equals_the_target(variant):
    name, centred = variant.removesuffix("-centred"), variant.endswith("-centred")
    plain = EmbeddingStage(_cfg(name, centred=centred), VOCAB, seed=3).embedding
    scaled = EmbeddingStage(_cfg(name, TARGET, centred=centred), VOCAB, seed=3).embedding
    probe = EmbeddingProbe(scaled)
    scaled(torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0)))
    logged = probe.metrics(_Trainer(), 1)
    assert logged["input_embedding_table_rms"] == pytest.approx(TARGET, rel=1e-3)
    assert logged["input_embedding_rms"] > 0  # the first batch's RMS (not the vocabulary's)
    # only the final linear map changed, by one factor; same names and shapes (checkpoints unchanged)
    before, after = plain.state_dict(), scaled.state_dict()
    assert before.keys() == after.keys()
    factor = TARGET / plain.output_rms()
    for key, value in before.items():
        expected = value * factor if key in scaled.output_parameters else value
        torch.testing.assert_close(after[key], expected, rtol=1e-6, atol=0, msg=key)
    assert any(key in scaled.output_parameters for key in after)
    assert not list(scaled.buffers())


def test_null_keeps_each_variants_own_init():
    for variant in REGISTRY:
        a = EmbeddingStage(_cfg(variant), VOCAB, seed=3).embedding.state_dict()
        torch.manual_seed(3)  # the stage seeds itself: the global state does not matter
        b = EmbeddingStage(_cfg(variant, None), VOCAB, seed=3).embedding.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), variant


def test_large_vocabulary_uses_a_fixed_sample_of_ids(monkeypatch):
    monkeypatch.setattr(base, "RMS_SAMPLE_IDS", 100)
    emb = EmbeddingStage(_cfg("untied", TARGET), VOCAB, seed=3).embedding
    ids = emb.rms_ids()
    assert len(ids) == 100 and len(set(ids.tolist())) == 100 and torch.equal(ids, emb.rms_ids())
    table = emb.materialize()
    assert float(table[ids].double().pow(2).mean().sqrt()) == pytest.approx(TARGET, rel=1e-6)


def test_meta_device_build_skips_the_measurement():
    from megatron_lev.model.gpt import GPTModel

    with torch.device("meta"):  # how the converters build a model before loading weights
        model = GPTModel(_cfg("lev", TARGET), VOCAB)
    assert model.embedding.out_proj.is_meta


def test_a_variant_without_a_final_linear_map_is_refused():
    emb = EmbeddingStage(_cfg("untied"), VOCAB, seed=3).embedding
    emb.output_parameters = ()
    with pytest.raises(ConfigError, match="model.input_init_rms is set but model.embedding='untied'"):
        emb.rescale_output_(TARGET)


def test_the_key_is_range_checked():
    with pytest.raises(ConfigError, match=r"model\.input_init_rms=0"):
        _cfg("lev", 0.0).validate()
