"""The LEV remedies through the real train command and exporters: a tiny run with
`model.lev.centre_reference` and `model.lev.seed_init_scale` records both in its config, its
`--keep-lev` export computes the checkpoint's logits (the exported code recomputes the reference
mean), and its plain export's table rows of the reference ids still average to zero."""

from __future__ import annotations

import json

import pytest
import torch

from tests.training.conftest import run_train, tiny_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]
REFERENCE = 24


@pytest.fixture(scope="module")
def remedy_run(minipile_prefix, tokenizer_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("remedies") / "run"
    extra = {
        "train.train_iters": 3,
        "train.save_interval": 3,
        "model.lev.centre_reference": REFERENCE,
        "model.lev.seed_init_scale": 10,
    }
    proc = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, out, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_run_records_the_remedies(remedy_run):
    import yaml

    lev = yaml.safe_load((remedy_run / "config.yaml").read_text())["model"]["lev"]
    assert lev["centre_reference"] == REFERENCE and lev["seed_init_scale"] == 10


def test_exports_compute_the_centred_layer(remedy_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from megatron_lev.cli import main
    from megatron_lev.convert.hf_export import source_model
    from megatron_lev.convert.source import open_checkpoint
    from megatron_lev.model.embeddings.lev import reference_ids

    src = open_checkpoint(remedy_run / "ckpt")
    ids = torch.tensor([[5, 50276, 17, 5, 1000, 50275, 3]])
    with torch.no_grad():
        reference = source_model(src, progress=False)(ids)

    lev_dir = tmp_path / "lev_layer"
    assert main(["convert", str(remedy_run / "ckpt"), str(lev_dir), "--keep-lev", "--no-progress"]) == 0
    assert "validation passed" in capsys.readouterr().out
    config = json.loads((lev_dir / "config.json").read_text())
    assert config["lev_centre_reference"] == REFERENCE and config["lev_reference_vocab"] == src.padded_vocab
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(lev_dir, trust_remote_code=True).eval()(ids).logits
        n = min(reference.shape[-1], exported.shape[-1])
        torch.testing.assert_close(exported[..., :n], reference[..., :n], atol=1e-4, rtol=1e-4)
        # the option matters: read without the centring, the same weights give other logits
        (lev_dir / "config.json").write_text(json.dumps({**config, "lev_centre_reference": 0}))
        other = AutoModelForCausalLM.from_pretrained(lev_dir, trust_remote_code=True).eval()(ids).logits
    assert (other[..., :n] - exported[..., :n]).abs().max() > 1e-3

    plain = tmp_path / "plain"
    assert main(["convert", str(remedy_run / "ckpt"), str(plain), "--no-progress"]) == 0
    assert "validation passed" in capsys.readouterr().out
    table = AutoModelForCausalLM.from_pretrained(plain).get_input_embeddings().weight.detach().double()
    rows = table[reference_ids(src.padded_vocab, REFERENCE)]  # every reference id is a real row here
    assert float(rows.mean(0).norm()) < 1e-4 * float(rows.norm(dim=1).mean())


def test_keep_lev_export_of_a_permuted_order_with_reference_ids_in_the_padding(
    minipile_prefix, tokenizer_path, tmp_path, capsys
):
    """With `id_order=random` the exported layer maps the reference ids through `id_rank`; R = 1024
    spreads them over the padded vocabulary up to id 50,279, past the tokenizer's 50,277, so the
    export must carry the padded rows of the order too."""
    from transformers import AutoModelForCausalLM

    from megatron_lev.cli import main
    from megatron_lev.convert.hf_export import source_model
    from megatron_lev.convert.source import open_checkpoint
    from megatron_lev.model.embeddings.lev import reference_ids

    out = tmp_path / "run"
    extra = {
        "train.train_iters": 2,
        "train.save_interval": 2,
        "model.lev.centre_reference": 1024,
        "model.lev.id_order": "random",
    }
    proc = run_train(1, tiny_overrides(minipile_prefix, tokenizer_path, out, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    src = open_checkpoint(out / "ckpt")
    assert int(reference_ids(src.padded_vocab, 1024).max()) >= src.vocab_size  # the case this tests
    ids = torch.tensor([[5, 50276, 17, 1000, 3]])
    with torch.no_grad():
        reference = source_model(src, progress=False)(ids)
    lev_dir = tmp_path / "lev_layer"
    assert main(["convert", str(out / "ckpt"), str(lev_dir), "--keep-lev", "--no-progress"]) == 0
    assert "validation passed" in capsys.readouterr().out
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(lev_dir, trust_remote_code=True).eval()(ids).logits
    n = min(reference.shape[-1], exported.shape[-1])
    torch.testing.assert_close(exported[..., :n], reference[..., :n], atol=1e-4, rtol=1e-4)
