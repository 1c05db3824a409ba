"""Parameter counts, FLOPs per token, vocabulary padding and the `params` command."""

import pytest
import torch

from megatron_lev.cli import main as cli_main
from megatron_lev.commands.params import rows
from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.model.embeddings import REGISTRY
from megatron_lev.model.flops import flops_per_token, parameter_count
from megatron_lev.model.vocab import padded_vocab_size
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec


@pytest.mark.parametrize("embedding", tuple(REGISTRY))
def test_parameter_count_equals_the_built_model(embedding):
    cfg = load_config(
        None,
        [
            f"model.embedding={embedding}",
            "model.num_kv_heads=2",
            "model.lev.d_seed=16",
            "model.lev.rank=8",
            "model.make_vocab_size_divisible_by=64",
            "model.min_compressed_width=1",  # tiny widths on purpose: the counts are under test
        ],
    )
    model = build_model(model_spec(cfg, 1000), SINGLE)
    assert parameter_count(cfg.model, 1024)["total"] == sum(p.numel() for p in model.parameters())


def test_paper_sizes_tied_within_five_percent():
    """The sizes are derived for o200k_base (the paper's ~200k vocabulary)."""
    table = {(r["size"], r["variant"]): r for r in rows(["200m", "400m", "1.2b"], 199999, 1, tuple(REGISTRY))}
    for size, target in (("200m", 200e6), ("400m", 400e6), ("1.2b", 1.2e9)):
        assert abs(table[size, "tied"]["total"] / target - 1) < 0.05, size
        assert table[size, "tied"]["vocab"] == 200064
    assert table["400m", "untied"]["total"] == 612_140_032  # the paper: 611M
    assert table["400m", "tied"]["embedding_share"] == pytest.approx(0.503, abs=1e-3)  # "about half"
    assert table["400m", "flat_mlp"]["widths"] == (4, 903) and table["400m", "flat_mlp"]["narrow"] == [4]
    assert 0 < table["1.2b", "lev"]["vs_tied"] < 0.005  # "grows by only 0.2%"
    neox = {(r["size"], r["variant"]): r for r in rows(["400m"], 50277, 1, ("lev",))}
    assert neox["400m", "lev"]["input"] == 1_720_192  # LEV.md: the spec's count at D = 1024, V = 50,277


def test_padding_and_flops():
    cfg = load_config(None).model
    assert padded_vocab_size(50277, cfg, 1) == 50304
    assert padded_vocab_size(50277, cfg, 4) == 50688  # multiple of 128 x 4
    # blocks-only check against the closed form 6 N + 12 L D S (+ head 6 D V), with MHA, D = 128, F = 384
    n_matmul = cfg.num_layers * (4 * 128 * 128 + 3 * 128 * 384)
    expected = 6 * n_matmul + 12 * cfg.num_layers * 128 * cfg.seq_length + 6 * 128 * 512
    assert flops_per_token(cfg, 512) == expected


def test_params_command_prints_every_variant(capsys):
    assert cli_main(["params", "--sizes", "tiny", "200m"]) == 0
    out = capsys.readouterr().out
    for variant in tuple(REGISTRY):
        assert f" {variant} " in out
    assert "vocabulary o200k_base (199,999)" in out and "203,935,232" in out  # 200m lev
    assert cli_main(["params", "--sizes", "400m", "--vocab-size", "neox", "cl100k_base", "o200k_base"]) == 0
    out = capsys.readouterr().out
    assert [line.split(" padded")[0] for line in out.splitlines() if line.startswith("vocabulary ")] == [
        "vocabulary neox (50,277)",
        "vocabulary cl100k_base (100,257)",
        "vocabulary o200k_base (199,999)",
    ]
    assert "e=17 h=831" in out and "e=4 h=903 <16!" in out and "50.3%" in out
    assert "below model.min_compressed_width" in out and "400m flat_mlp at o200k_base" in out
    assert cli_main(["params", "--vocab-size", "p50k"]) == 1
    assert "--vocab-size p50k: give a number or one of neox" in capsys.readouterr().err
    assert cli_main(["params", "--sizes", "nope"]) == 2
    assert "no model config named 'nope'" in capsys.readouterr().err


def test_forward_shapes_and_loss_against_f_cross_entropy():
    cfg = load_config(None, ["model.embedding=untied", "model.make_vocab_size_divisible_by=8"])
    model = build_model(model_spec(cfg, 64), SINGLE)
    ids = torch.randint(0, 64, (2, 10))
    logits = model(ids)
    assert logits.shape == (2, 10, 64)
    loss = model(ids, ids)
    torch.testing.assert_close(
        loss, torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids, reduction="none")
    )
