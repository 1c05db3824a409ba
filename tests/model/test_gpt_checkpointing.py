"""Activation checkpointing, applied from outside the model, replays both RNG streams (dropout masks
match) and changes no parameter name; bf16 runs close to fp32."""

import torch

from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.engine.recompute import CheckpointedStages, apply_activation_checkpointing
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec

BASE = [
    "model.embedding=untied",
    "model.hidden_size=64",
    "model.make_vocab_size_divisible_by=8",
    "model.num_kv_heads=2",
    "model.num_layers=3",
]


def _loss_and_grads(overrides, ids):
    cfg = load_config(None, BASE + overrides)
    model = apply_activation_checkpointing(build_model(model_spec(cfg, 96), SINGLE), cfg.model)
    runs = []  # one per block forward: recomputation runs a checkpointed block again in backward
    for block in model.layers:
        block.register_forward_pre_hook(lambda *_: runs.append(1))
    torch.manual_seed(9)  # the same masks on both runs: this stream, and the new model's own TP stream
    loss = model(ids[:, :-1], ids[:, 1:]).mean()
    loss.backward()
    assert len(runs) == len(model.layers) * (2 if cfg.model.activation_checkpointing else 1)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_checkpointed_blocks_equal_plain_blocks_with_dropout():
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    dropout = ["model.hidden_dropout=0.2", "model.attention_dropout=0.2"]
    ref_loss, ref_grads = _loss_and_grads(dropout, ids)
    loss, grads = _loss_and_grads(
        dropout + ["model.activation_checkpointing=true", "model.checkpoint_num_layers=2"], ids
    )
    torch.testing.assert_close(loss, ref_loss)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")
    no_dropout_loss, _ = _loss_and_grads([], ids)
    assert not torch.allclose(no_dropout_loss, ref_loss)  # dropout was really active


def test_checkpointing_groups_blocks_and_keeps_names():
    cfg = load_config(None, BASE + ["model.activation_checkpointing=true", "model.checkpoint_num_layers=2"])
    model = build_model(model_spec(cfg, 96), SINGLE)
    names, params = list(model.state_dict()), dict(model.named_parameters())
    assert apply_activation_checkpointing(model, cfg.model) is model
    apply_activation_checkpointing(model, cfg.model)  # a second time changes nothing
    groups = [len(s.stages) for s in model.stages if isinstance(s, CheckpointedStages)]
    assert groups == [2, 1]  # 3 blocks in groups of 2, from the first block
    assert list(model.state_dict()) == names
    after = dict(model.named_parameters())
    assert list(after) == list(params) and all(p is params[n] for n, p in after.items())
    model.eval()
    assert not any(s.training for s in model.stages if isinstance(s, torch.nn.Module))


def test_bf16_forward_backward_close_to_fp32():
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(2))
    model = build_model(model_spec(load_config(None, BASE), 96), SINGLE)
    ref = model(ids[:, :-1], ids[:, 1:])
    model = model.to(torch.bfloat16)
    loss = model(ids[:, :-1], ids[:, 1:])
    assert loss.dtype == torch.float32 and model(ids).dtype == torch.bfloat16
    loss.mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    torch.testing.assert_close(loss.mean(), ref.mean().detach(), rtol=2e-2, atol=2e-2)
