"""`megatron-lev geometry` on a tiny real run with two checkpoints, checked against direct computation
on the loaded tables; the run uses the centred LEV layer and equal-scale init, whose first-step RMS
(over the vocabulary) must be the configured one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.training.conftest import run_train, tiny_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]
TARGET = 0.05


@pytest.fixture(scope="module")
def lev_run(minipile_prefix, tokenizer_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("geometry") / "lev_run"
    extra = {
        "train.train_iters": 4,
        "train.save_interval": 2,
        "model.lev.centred": "true",
        "model.input_init_rms": TARGET,
    }
    proc = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, out, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_first_step_rms_over_the_vocabulary_is_the_target(lev_run):
    rows = [json.loads(line) for line in (lev_run / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["kind"] == "train" and r["iteration"] == 1)
    assert first["input_embedding_table_rms"] == pytest.approx(TARGET, rel=1e-3)


SAMPLE, SEED = 1500, 7  # the pairwise statistics over a seeded row sample (all V^2 pairs would not fit)


def _direct(matrix: torch.Tensor) -> dict[str, float]:
    """The metrics written out directly; pairs over the rows `--sample SAMPLE --seed SEED` picks."""
    x = matrix.double()
    pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(SEED))[:SAMPLE]
    unit = x[pick] / x[pick].norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    pairs = cos[torch.triu(torch.ones_like(cos, dtype=torch.bool), diagonal=1)]
    sv = torch.linalg.svdvals(x)
    p = sv / sv.sum()
    return {
        "mu": float(pairs.mean()),
        "sigma": float(pairs.std(unbiased=False)),
        "eps": float(pairs.mean() + 2 * pairs.std(unbiased=False)),
        "mean_row_ratio": float(x.mean(0).norm() / x.norm(dim=1).mean()),
        "effective_rank": math.exp(float(-(p * p.log()).sum())),
    }


def test_geometry_of_each_checkpoint_matches_direct_computation(lev_run, capsys):
    from megatron_lev.analysis.geometry import checkpoint_matrices
    from megatron_lev.cli import main
    from megatron_lev.convert.source import load_canonical_state, open_checkpoint
    from megatron_lev.model.embeddings import build_input_embedding

    out = lev_run.parent / "geometry_out"
    argv = ["geometry", str(lev_run), "--out", str(out), "--x", "tokens", "--sample", str(SAMPLE)]
    assert main([*argv, "--seed", str(SEED)]) == 0
    printed = capsys.readouterr().out
    assert "h x r" in printed and "| lev_run | lev | 2 |" in printed
    data = json.loads((out / "geometry.json").read_text())
    rows = data["rows"]
    assert [(r["iteration"], r["matrix"]) for r in rows] == [
        (2, "input"),
        (2, "output"),
        (4, "input"),
        (4, "output"),
    ]
    assert [r["tokens"] for r in rows] == [2 * 2 * 32] * 2 + [4 * 2 * 32] * 2
    assert all(r["rank_bound"] == 2 * 4 for r in rows if r["matrix"] == "input")  # h x r of the run
    assert (out / "geometry.png").stat().st_size > 0
    assert (out / "geometry.csv").read_text().splitlines()[0].startswith("run,embedding,iteration")
    save = lev_run / "ckpt"
    for it in (2, 4):
        tag = f"iter_{it:07d}"
        # the input table from the loaded parameters by a separate build, the head from the state
        src = open_checkpoint(save, tag=tag)
        state = load_canonical_state(src, progress=False)
        emb = build_input_embedding(src.cfg.model, src.padded_vocab, base_vocab=src.base_vocab).double()
        emb.load_state_dict(
            {k[len("embedding.") :]: v for k, v in state.items() if k.startswith("embedding.")}
        )
        assert emb.lev.centred
        tables = {
            "input": emb.materialize()[: src.vocab_size],
            "output": state["output_head.weight"][: src.vocab_size],
        }
        _, table, head = checkpoint_matrices(save, tag)
        torch.testing.assert_close(table.double(), tables["input"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(head, tables["output"].float())
        for matrix, direct in tables.items():
            row = next(r for r in rows if r["iteration"] == it and r["matrix"] == matrix)
            assert row["rows"] == src.vocab_size and row["pair_rows"] == SAMPLE
            for key, value in _direct(direct).items():
                assert row[key] == pytest.approx(value, rel=2e-4, abs=1e-6), (it, matrix, key)


def test_keep_lev_export_of_the_centred_layer_computes_the_same_logits(lev_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from megatron_lev.cli import main
    from megatron_lev.convert.hf_export import source_model
    from megatron_lev.convert.source import open_checkpoint

    out = tmp_path / "lev_layer"
    assert main(["convert", str(lev_run / "ckpt"), str(out), "--keep-lev", "--no-progress"]) == 0
    assert "validation passed" in capsys.readouterr().out  # the converter's own logit and probe checks
    config = json.loads((out / "config.json").read_text())
    assert config["lev_centred"] is True
    ids = torch.tensor([[5, 50276, 17, 5, 1000, 50275, 3]])
    with torch.no_grad():
        reference = source_model(open_checkpoint(lev_run / "ckpt"), progress=False)(ids)
        exported = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()(ids).logits
        n = min(reference.shape[-1], exported.shape[-1])
        torch.testing.assert_close(exported[..., :n], reference[..., :n], atol=1e-4, rtol=1e-4)
        # the option matters: read as the spec's (uncentred) layer, the same weights give other logits
        (out / "config.json").write_text(json.dumps({**config, "lev_centred": False}))
        other = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()(ids).logits
    assert (other - exported).abs().max() > 1e-3
