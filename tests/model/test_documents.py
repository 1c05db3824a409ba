"""Packed documents: positions restart at each EOD, attention stays inside each document, and the
loss can skip the targets that follow an EOD; off by default, and the same under pipeline parallelism."""

import pytest
import torch

import megatron_lev.model.attention as attention
from megatron_lev.config import load_config
from megatron_lev.data.batches import MicroBatch, token_batches
from megatron_lev.data.boundaries import DocumentLayout, document_positions
from megatron_lev.engine.build import build_model
from megatron_lev.engine.loss import micro_batch_loss
from megatron_lev.engine.pipeline import pipeline_batches, pipeline_loss
from megatron_lev.engine.recompute import apply_activation_checkpointing
from megatron_lev.model.documents import block_causal_mask, cu_seqlens
from megatron_lev.model.loss import masked_mean
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec
from megatron_lev.testing import run_distributed

EOD, VOCAB, SEQ = 0, 208, 24
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    f"model.seq_length={SEQ}",
    "model.make_vocab_size_divisible_by=8",
    "model.lev.d_seed=16",
    "model.lev.heads=4",
    "model.lev.kappa=8",
    "model.lev.rank=8",
    "model.lev.chunk_size=16",
    "train.seed=3",
]
DOCUMENTS = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]
CASES = {
    "lev": ["model.embedding=lev"],
    "untied_gqa_ckpt": [
        "model.embedding=untied",
        "model.num_kv_heads=2",
        "model.activation_checkpointing=true",
    ],
}


def _model(case, extra=()):
    """The plain model, checkpointed as the engine would when the case asks for it."""
    cfg = load_config(None, SMALL + CASES[case] + list(extra))
    return apply_activation_checkpointing(build_model(model_spec(cfg, VOCAB), SINGLE), cfg.model)


def _packed(lengths=(5, 9, 1, 13, 7, 8, 5), rows=2, seed=0):
    """`rows` samples of SEQ tokens cut from documents of `lengths` tokens, each followed by EOD."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.cat(
        [torch.cat([torch.randint(1, 200, (n,), generator=g), torch.tensor([EOD])]) for n in lengths]
    )
    assert stream.numel() >= rows * SEQ
    return stream[: rows * SEQ].view(rows, SEQ)


def _segments(ids):
    """(row, start, end) of every document piece of every row (a row's first token starts one)."""
    _, docs = document_positions(ids, EOD)
    out = []
    for r in range(ids.shape[0]):
        for d in docs[r].unique().tolist():
            where = (docs[r] == d).nonzero().flatten()
            out.append((r, int(where[0]), int(where[-1]) + 1))
    return out


@pytest.mark.parametrize("case", CASES)
def test_packed_documents_give_the_logits_of_each_document_alone(case):
    model = _model(case)
    ids = _packed()
    positions, docs = document_positions(ids, EOD)
    with torch.no_grad():
        packed = model(ids, position_ids=positions, document_ids=docs)  # (B, S, V)
        worst = 0.0
        for r, start, end in _segments(ids):
            alone = model(ids[r : r + 1, start:end])[0]  # (end - start, V)
            worst = max(worst, float((packed[r, start:end] - alone).abs().max()))
    print(f"{case}: max |packed - one by one| = {worst:.2e}")
    assert worst <= 1e-5
    # and the plain model does see across documents (the test would notice a no-op)
    with torch.no_grad():
        assert not torch.allclose(model(ids), packed, atol=1e-3)


def test_block_causal_mask_and_cu_seqlens():
    docs = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    cu, longest = cu_seqlens(docs)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 6, 8, 10] and longest == 3
    mask = block_causal_mask(docs)  # (B, 1, S, S)
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    for b in range(2):
        for i in range(5):
            for j in range(5):
                assert mask[b, 0, i, j] == (j <= i and docs[b, i] == docs[b, j])
    # one document per row: one sequence per row; a row of single-token documents: one per token
    cu, longest = cu_seqlens(torch.zeros(3, 4, dtype=torch.long))
    assert cu.tolist() == [0, 4, 8, 12] and longest == 4
    cu, longest = cu_seqlens(torch.arange(4).expand(2, 4))
    assert cu.tolist() == list(range(9)) and longest == 1
    # random layouts against the flattened boundaries counted by hand
    ids = _packed(rows=3, lengths=(3, 0, 0, 20, 2, 11, 1, 30))
    _, docs = document_positions(ids, EOD)
    lengths = [end - start for _, start, end in _segments(ids)]
    cu, longest = cu_seqlens(docs)
    assert cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()] and longest == max(lengths)


def _fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False):
    """flash_attn_varlen_func's contract, one sequence at a time with SDPA (flash-attn needs CUDA)."""
    assert (
        q.dim() == 3 and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and causal and dropout_p == 0.0
    )
    assert int(cu_q[0]) == 0 and int(cu_q[-1]) == q.shape[0] and max_q == max_k
    assert isinstance(max_q, int) and int((cu_q[1:] - cu_q[:-1]).max()) == max_q
    rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        qs, ks, vs = (
            t[a:b].transpose(0, 1) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))
        )
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(
            0, 1
        )
    return out


def test_flash_attn_varlen_path_matches_the_mask_path(monkeypatch):
    """The CUDA path's arguments (flattened tokens, cu_seqlens from the documents) on a stand-in kernel."""
    model = _model("untied_gqa_ckpt")
    ids = _packed()
    positions, docs = document_positions(ids, EOD)
    with torch.no_grad():
        masked = model(ids, position_ids=positions, document_ids=docs)
        monkeypatch.setattr(attention, "use_flash_attention", lambda x: True)
        monkeypatch.setattr(attention, "flash_attn_varlen_func", _fake_varlen)
        varlen = model(ids, position_ids=positions, document_ids=docs)
    torch.testing.assert_close(varlen, masked, rtol=1e-5, atol=1e-5)


def test_options_off_change_nothing():
    cfg = load_config(None, SMALL)
    assert (
        DocumentLayout.from_config(cfg.data, EOD) is None
    )  # off by default: plain (input_ids, labels) batches
    tokens = _packed(rows=2).long()
    loader = [{"tokens": torch.cat([tokens, tokens[:, :1]], dim=1)}]
    plain = next(token_batches(loader, torch.device("cpu")))
    assert isinstance(plain, tuple) and len(plain) == 2
    assert next(pipeline_batches(iter([plain])))[0] == (plain[0],)
    model = _model("lev")
    expected = model(plain[0], labels=plain[1]).float().mean()
    assert torch.equal(micro_batch_loss(model, plain), expected)
    # all three on, but a batch without EOD: the same model as the plain one
    layout = DocumentLayout.from_config(load_config(None, SMALL + DOCUMENTS).data, EOD)
    ids = torch.randint(1, 200, (2, SEQ), generator=torch.Generator().manual_seed(1))
    batch = MicroBatch(ids, ids, **layout(ids))
    with torch.no_grad():
        torch.testing.assert_close(
            micro_batch_loss(model, batch), model(ids, labels=ids).mean(), rtol=1e-6, atol=1e-6
        )


def test_loss_mask_drops_exactly_the_targets_after_eod():
    layout = DocumentLayout.from_config(load_config(None, SMALL + ["data.eod_mask_loss=true"]).data, EOD)
    assert layout.eod_mask_loss and not layout.reset_position_ids and not layout.reset_attention_mask
    tokens = _packed(rows=2)
    loader = [{"tokens": torch.cat([tokens, torch.full((2, 1), 7)], dim=1)}]
    batch = next(token_batches(loader, torch.device("cpu"), documents=layout))
    assert batch.position_ids is None and batch.document_ids is None
    assert torch.equal(batch.loss_mask == 0, batch.input_ids == EOD)  # the first token of the next document
    model = _model("lev")
    with torch.no_grad():
        per_token = model(batch.input_ids, labels=batch.labels)  # (B, S)
        kept = per_token[batch.input_ids != EOD]
        assert 0 < kept.numel() < per_token.numel()
        torch.testing.assert_close(micro_batch_loss(model, batch), kept.mean(), rtol=1e-6, atol=0)
        logits = model(batch.input_ids)
        (inputs,), labels = next(pipeline_batches(iter([batch])))
        assert isinstance(labels, tuple) and labels[1] is batch.loss_mask
        torch.testing.assert_close(
            pipeline_loss(logits, labels, VOCAB, layout=SINGLE), kept.mean(), rtol=1e-6, atol=0
        )
    assert float(masked_mean(per_token, torch.zeros_like(per_token))) == 0.0  # nothing kept: 0, not NaN


# ---------------------------------------------------------------- pipeline parallel == one process

MICRO, ACCUM, STEPS, LR = 2, 2, 3, 1e-3


def _steps():
    """The same global batch every step, ACCUM micro-batches of packed documents, as MicroBatches."""
    layout = DocumentLayout.from_config(load_config(None, SMALL + DOCUMENTS).data, EOD)
    tokens = _packed(rows=ACCUM * MICRO, lengths=(5, 9, 1, 13, 7, 8, 5, 3, 11, 2, 17, 6, 4, 9)).view(
        ACCUM, MICRO, SEQ
    )
    step = [MicroBatch(t[:, :-1], t[:, 1:], **layout(t[:, :-1])) for t in tokens]  # S - 1 tokens each
    return [step for _ in range(STEPS)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _pipeline_worker(case):
    import deepspeed

    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(1, 2)
    cfg = load_config(
        None,
        SMALL
        + CASES[case]
        + DOCUMENTS
        + [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.zero_stage=1",
            "parallel.partition_method=uniform",
            f"model.seq_length={SEQ - 1}",
        ],
    )
    pipe = build_model(model_spec(cfg, VOCAB, layout.world_size), layout)
    ds_config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "train_batch_size": MICRO * ACCUM,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**6,
        "gradient_clipping": 0.0,
    }
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=_adamw(pipe.parameters()), config=ds_config, dist_init_required=False
    )
    losses = [engine.train_batch(pipeline_batches(iter(step))).item() for step in _steps()]
    return losses


@pytest.mark.multiprocess
def test_pp2_with_documents_matches_single_process():
    case = "untied_gqa_ckpt"  # blocks checkpointed: the document tensors go through recomputation too
    model = _model(case, DOCUMENTS + [f"model.seq_length={SEQ - 1}"])
    opt, ref = _adamw(model.parameters()), []
    for step in _steps():
        opt.zero_grad()
        loss = sum(micro_batch_loss(model, mb) for mb in step) / ACCUM
        loss.backward()
        opt.step()
        ref.append(loss.item())
    for losses in run_distributed(_pipeline_worker, world_size=2, args=(case,), timeout=400):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert ref[-1] < ref[0]
