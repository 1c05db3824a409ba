"""A LEV model with a token-id order other than bpe, through DeepSpeed checkpoints and every converter.

Two real checkpoints (4 gloo processes): TP=2 x PP=2 ZeRO-1 with `model.lev.id_order=frequency`
(its counts file is deleted after the save: nothing downstream may need it), and TP=2 x DP=2 ZeRO-3
with `random`. Each export must give the input table in token-id order: row i = the bpe-order
table's row `id_rank[i]`, computed here from the merged parameters without the order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lev.cli import main as cli_main
from megatron_lev.convert.source import load_canonical_state, open_checkpoint
from megatron_lev.model.embeddings.id_order import frequency_ranks, random_ranks
from megatron_lev.testing import run_distributed
from tests.convert.ds_checkpoints import SMALL, _ds_config, text_batches

pytestmark = pytest.mark.multiprocess

VOCAB, PADDED = 50277, 50304
ID_RANK = "embedding.codebooks.id_rank"


def _make(root: str, tokenizer: str, text: str, counts: str) -> dict:
    """Collective over 4 ranks: the two checkpoints; returns their held-out losses."""
    import deepspeed

    from megatron_lev.ckpt.io import save_checkpoint
    from megatron_lev.config import load_config
    from megatron_lev.engine.build import build_model
    from megatron_lev.engine.deepspeed_engine import DeepSpeedEngine, disable_cpu_shm_comm
    from megatron_lev.engine.mpu import TensorParallelMPU
    from megatron_lev.parallel import state
    from megatron_lev.plan import model_spec

    disable_cpu_shm_comm()
    train, held_out = text_batches(tokenizer, text)
    out = {}

    def config(tp, pp, zero, precision, *extra):
        return load_config(
            None,
            [
                *SMALL,
                "model.embedding=lev",
                f"data.tokenizer_path={tokenizer}",
                f"parallel.tensor_model_parallel_size={tp}",
                f"parallel.pipeline_model_parallel_size={pp}",
                f"parallel.zero_stage={zero}",
                f"train.precision={precision}",
                *extra,
            ],
        )

    layout = state.initialize_model_parallel(2, 2)
    cfg = config(2, 2, 1, "fp32", "model.lev.id_order=frequency", f"model.lev.id_order_counts={counts}")
    torch.manual_seed(cfg.train.seed)
    model = build_model(model_spec(cfg, VOCAB, layout.world_size), layout)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config=_ds_config("fp32", 1, 1),
        dist_init_required=False,
    )
    engine.train_batch(iter([((train[:, :-1],), train[:, 1:])]))
    loss = engine.eval_batch(iter([((held_out[:, :-1],), held_out[:, 1:])]))
    wrapped = DeepSpeedEngine(engine, None, cfg, pipeline=True, gas=1, layout=layout)
    save_checkpoint(wrapped, Path(root) / "frequency", 1, {}, keep_last=2, config_yaml=cfg.to_yaml())
    out["frequency"] = float(loss)

    layout = state.initialize_model_parallel(2, 1)
    cfg = config(2, 1, 3, "bf16", "model.lev.id_order=random", "model.lev.id_order_seed=5")
    torch.manual_seed(cfg.train.seed)
    model = build_model(model_spec(cfg, VOCAB, layout.world_size), layout)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config=_ds_config("bf16", 3, 2),
        mpu=TensorParallelMPU(layout),
        dist_init_required=False,
    )
    batch = train if layout.dp_rank == 0 else held_out
    engine.backward(engine(batch[:, :-1], batch[:, 1:]).mean())
    engine.step()
    wrapped = DeepSpeedEngine(engine, None, cfg, pipeline=False, gas=1, layout=layout)
    save_checkpoint(wrapped, Path(root) / "random", 1, {}, keep_last=2, config_yaml=cfg.to_yaml())
    return out


@pytest.fixture(scope="module")
def ordered_checkpoints(tmp_path_factory, tokenizer_path, sample_text):
    root = tmp_path_factory.mktemp("id_order")
    counts = np.random.default_rng(0).integers(0, 1000, size=VOCAB).astype(np.int64)
    counts[4321] = 10**6  # the most frequent token
    counts_path = root / "train_text_document.counts.npy"
    np.save(counts_path, counts)
    losses = run_distributed(
        _make, world_size=4, args=(str(root), tokenizer_path, sample_text, str(counts_path)), timeout=900
    )[0]
    counts_path.unlink()  # resharding, converting and analysing must not need it
    return {"root": root, "counts": counts, "losses": losses}


def _bpe_table(state: dict[str, torch.Tensor], cfg) -> torch.Tensor:
    """The bpe-order table of the merged LEV parameters: row j from the digits of j itself."""
    import dataclasses

    from megatron_lev.model.embeddings.lev import LevEmbedding

    lev = dataclasses.replace(cfg.model.lev, id_order="bpe", id_order_counts=None)
    emb = LevEmbedding(PADDED, cfg.model.hidden_size, lev)
    params = {k.removeprefix("embedding."): v.float() for k, v in state.items() if k.startswith("embedding.")}
    del params["codebooks.id_rank"]
    emb.load_state_dict(params, strict=True)
    return emb.materialize()


def _expected(save_dir: Path):
    src = open_checkpoint(save_dir)
    state = load_canonical_state(src, progress=False)
    rank = state[ID_RANK]
    assert rank.dtype == torch.int64 and torch.equal(rank.sort().values, torch.arange(PADDED))
    return src, state, rank, _bpe_table(state, src.cfg)[rank[:VOCAB]]


def _embed_tokens(out: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_the_stored_order_is_the_one_drawn_at_init(ordered_checkpoints):
    root = ordered_checkpoints["root"]
    freq = load_canonical_state(open_checkpoint(root / "frequency"), progress=False)[ID_RANK]
    assert torch.equal(freq, frequency_ranks(ordered_checkpoints["counts"], PADDED))
    assert int(freq[4321]) == 0  # merged from the pipeline's layer files of both TP ranks
    zero3 = load_canonical_state(open_checkpoint(root / "random"), progress=False)[ID_RANK]
    assert torch.equal(zero3, random_ranks(PADDED, 5))  # gathered from ZeRO-3 files, still int64


def test_the_source_model_reproduces_the_engines_loss(ordered_checkpoints, tokenizer_path, sample_text):
    from megatron_lev.convert.hf_export import source_model

    _, held_out = text_batches(tokenizer_path, sample_text)
    model = source_model(open_checkpoint(ordered_checkpoints["root"] / "frequency"), progress=False)
    with torch.no_grad():
        loss = model(held_out[:, :-1], held_out[:, 1:]).mean().item()
    assert loss == pytest.approx(ordered_checkpoints["losses"]["frequency"], rel=1e-6)


@pytest.mark.parametrize("order", ["frequency", "random"])
def test_convert_exports_the_table_in_token_id_order(ordered_checkpoints, order, tmp_path, capsys):
    save_dir = ordered_checkpoints["root"] / order
    out = tmp_path / "hf"
    assert cli_main(["convert", str(save_dir), str(out), "--no-progress"]) == 0
    assert "validation passed" in capsys.readouterr().out
    _, _, rank, expected = _expected(save_dir)
    table = _embed_tokens(out)["model.embed_tokens.weight"]
    assert table.shape == (VOCAB, 32)
    torch.testing.assert_close(table, expected, rtol=1e-5, atol=1e-6)
    moved = (rank[:VOCAB] != torch.arange(VOCAB)).nonzero().flatten()[:100]
    assert len(moved) == 100 and not torch.allclose(table[moved], _expected_bpe_rows(save_dir, moved))


def _expected_bpe_rows(save_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    src = open_checkpoint(save_dir)
    return _bpe_table(load_canonical_state(src, progress=False), src.cfg)[ids]


def test_keep_lev_export_applies_the_order(ordered_checkpoints, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    save_dir = ordered_checkpoints["root"] / "frequency"
    dense_dir, lev_dir = tmp_path / "dense", tmp_path / "lev"
    assert cli_main(["convert", str(save_dir), str(dense_dir), "--no-progress"]) == 0
    assert cli_main(["convert", str(save_dir), str(lev_dir), "--keep-lev", "--no-progress"]) == 0
    assert "validation passed" in capsys.readouterr().out
    assert json.loads((lev_dir / "config.json").read_text())["lev_id_order"] == "frequency"
    _, _, rank, expected = _expected(save_dir)
    stored = _embed_tokens(lev_dir)["model.embed_tokens.codebooks.id_rank"]
    assert stored.dtype == torch.int64 and torch.equal(stored, rank[:VOCAB])

    model = AutoModelForCausalLM.from_pretrained(lev_dir, trust_remote_code=True).eval()
    dense = AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    assert torch.equal(model.model.embed_tokens.codebooks.id_rank, rank[:VOCAB])
    ids = torch.tensor([[5, 50276, 4321, 17, 5, 1000, 50275]])
    with torch.no_grad():
        torch.testing.assert_close(model.model.embed_tokens(ids)[0], expected[ids[0]], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-4, rtol=1e-4)


def test_reshard_carries_the_order_without_the_counts(ordered_checkpoints, tmp_path):
    """TP=2 x PP=2 -> TP=1: a fresh engine (its model built without the counts file) loads the order
    from the written checkpoint and gives the source's loss; Adam's moments travel without a buffer's."""
    from megatron_lev.convert.reshard import reshard

    save_dir = ordered_checkpoints["root"] / "frequency"
    tag_dir, ref, got = reshard(save_dir, tmp_path / "tp1", tp=1, pp=1)
    assert got == pytest.approx(ref, rel=1e-6, abs=1e-6)
    _, _, rank, _ = _expected(save_dir)
    assert torch.equal(load_canonical_state(open_checkpoint(tag_dir.parent), progress=False)[ID_RANK], rank)


def test_geometry_reads_the_table_in_token_id_order(ordered_checkpoints):
    from megatron_lev.analysis.geometry import checkpoint_matrices

    save_dir = ordered_checkpoints["root"] / "frequency"
    _, table, _ = checkpoint_matrices(save_dir, (save_dir / "latest").read_text().strip())
    torch.testing.assert_close(table, _expected(save_dir)[3], rtol=1e-5, atol=1e-6)
