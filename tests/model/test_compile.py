"""`model.compile`: each decoder block compiled in place (`engine.compile.apply_compile`) trains the eager
model's loss and gradients, under the eager model's parameter names (so checkpoints do not change)."""

from __future__ import annotations

import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.engine.compile import apply_compile
from megatron_lev.model.block import TransformerBlock
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec

SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.seq_length=32",
    "model.embedding=untied",
]


def _run(compiled: bool):
    cfg = load_config(None, [*SMALL, f"model.compile={str(compiled).lower()}"])
    model = apply_compile(build_model(model_spec(cfg, 200), SINGLE), cfg.model)
    ids = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0))
    loss = model(ids[:, :-1], ids[:, 1:], reduction="mean")
    loss.backward()
    return model, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_blocks_train_the_eager_loss_and_gradients_under_the_same_names():
    model, loss, grads = _run(True)
    _, ref_loss, ref_grads = _run(False)
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    assert len(blocks) == 2 and all(getattr(b, "_compiled_call_impl", None) for b in blocks)
    assert list(grads) == list(ref_grads)  # no `_orig_mod.` in any name
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, ref in ref_grads.items():
        scale = float(ref.abs().max())
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_compile_with_activation_checkpointing_is_refused_in_one_line():
    from megatron_lev.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.compile=true with model\.activation_checkpointing=true"):
        load_config(None, [*SMALL, "model.compile=true", "model.activation_checkpointing=true"])


def test_compile_is_off_by_default_and_applying_it_twice_changes_nothing():
    cfg = load_config(None, SMALL)
    assert cfg.model.compile is False
    model = apply_compile(build_model(model_spec(cfg, 200), SINGLE), cfg.model)
    assert not any(getattr(m, "_compiled_call_impl", None) for m in model.modules())
