"""A seventh embedding variant is one class and one registry entry: nothing else needs an edit."""

import pytest
import torch
from torch import nn

from megatron_lev.cli import main as cli_main
from megatron_lev.commands.params import rows
from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.model.embeddings import REGISTRY, InputEmbedding, check_token_ids
from megatron_lev.model.flops import parameter_count
from megatron_lev.parallel.layers import VocabParallelEmbedding
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec


class ScaledEmbedding(InputEmbedding):
    """A dense table times one learned scalar (the tied subclass shares the table with the head)."""

    name, label = "scaled", "SCALED"

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float, layout=SINGLE, base_vocab=None):
        super().__init__()
        self.vocab_size, self.hidden_size, self.base_vocab = vocab_size, hidden_size, base_vocab
        self.table = VocabParallelEmbedding(
            vocab_size, hidden_size, init_std=init_std, layout=layout, init_rows=base_vocab
        )
        self.scale = nn.Parameter(torch.ones(()))

    @classmethod
    def from_config(cls, model_cfg, vocab_size, layout=SINGLE, base_vocab=None):
        return cls(vocab_size, model_cfg.hidden_size, model_cfg.init_std, layout, base_vocab)

    @classmethod
    def parameter_count(cls, model_cfg, vocab_size):
        return vocab_size * model_cfg.hidden_size + 1

    def forward(self, input_ids):  # (B, S) -> (B, S, D)
        check_token_ids(input_ids, self.vocab_size)
        return self.scale * self.table(input_ids)

    def tied_output_weight(self):
        return self.table.weight if self.ties_output_head else None


class TiedScaledEmbedding(ScaledEmbedding):
    name, label, ties_output_head = "scaled_tied", "SCALED-TIED", True


@pytest.fixture
def registered(monkeypatch):
    for cls in (ScaledEmbedding, TiedScaledEmbedding):
        monkeypatch.setitem(REGISTRY, cls.name, cls)


@pytest.mark.parametrize("variant", ["scaled", "scaled_tied"])
def test_a_new_variant_validates_builds_trains_and_counts(registered, variant, capsys):
    assert cli_main(["config", f"model.embedding={variant}"]) == 0
    assert f"embedding: {variant}" in capsys.readouterr().out
    cfg = load_config(None, [f"model.embedding={variant}", "model.make_vocab_size_divisible_by=64"])
    torch.manual_seed(0)
    model = build_model(model_spec(cfg, 1000), SINGLE)
    assert isinstance(model.embedding, REGISTRY[variant])
    tied = REGISTRY[variant].ties_output_head
    assert hasattr(model, "output_head") != tied  # tied: no head module, the embedding stage's table
    ids = torch.randint(0, 1000, (2, 16))
    model(ids, labels=ids).mean().backward()  # per-token losses
    assert model.embedding.scale.grad is not None
    counts = parameter_count(cfg.model, 1024)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["output"] == (0 if tied else 1024 * cfg.model.hidden_size)
    (row,) = rows(["tiny"], 1000, 1, [variant])  # what `megatron-lev params --variants ...` prints
    assert row["input"] % row["vocab"] == 1 and (row["output"] == 0) == tied


def test_an_unregistered_variant_is_refused_with_the_choices(capsys):
    assert cli_main(["config", "model.embedding=scaled"]) == 2
    err = capsys.readouterr().err
    assert "model.embedding='scaled' is not one of" in err and "lev" in err and "tied" in err
