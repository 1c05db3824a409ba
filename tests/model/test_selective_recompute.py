"""`model.recompute_attention` (selective recompute): the attention core is recomputed in backward, not
stored. The same loss and gradients as storing it (dropout masks replayed), and less saved for backward
where the scores are materialised (a document mask on the scaled-dot-product path)."""

from __future__ import annotations

import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.engine.recompute import apply_activation_checkpointing
from megatron_lev.errors import ConfigError
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec

SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "model.embedding=untied",
    "model.attention_dropout=0.1",  # the replayed RNG is part of what is checked
    "train.seed=3",
]


def _run(extra):
    cfg = load_config(None, [*SMALL, *extra])
    model = apply_activation_checkpointing(build_model(model_spec(cfg, 200), SINGLE), cfg.model).train()
    ids = torch.randint(0, 200, (2, 65), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(64).repeat(2, 1) % 32  # two documents per row: a document mask
    document_ids = (torch.arange(64) // 32).repeat(2, 1)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    torch.manual_seed(7)  # attention dropout draws from the new model's own tensor-parallel stream
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(
            ids[:, :-1], ids[:, 1:], position_ids=position_ids, document_ids=document_ids, reduction="mean"
        )
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved[0]


def test_selective_recompute_gives_the_same_gradients_and_saves_less():
    data = ["data.reset_position_ids=true", "data.reset_attention_mask=true"]
    loss, grads, saved = _run(["model.recompute_attention=true", *data])
    ref_loss, ref_grads, ref_saved = _run(data)
    assert loss == ref_loss
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-6, atol=1e-7, msg=name)
    # the (B, H, S, S) probabilities of 2 layers are not kept: at least 2 x 2 x 4 x 64 x 64 x 4 bytes
    assert ref_saved - saved >= 2 * 2 * 4 * 64 * 64 * 4, (saved, ref_saved)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["model.activation_checkpointing=true"], "whole blocks are already recomputed"),
        (["model.compile=true"], "model.compile=true with model.recompute_attention=true"),
    ],
)
def test_selective_recompute_refuses_what_it_cannot_combine_with(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*SMALL, "model.recompute_attention=true", *extra])
