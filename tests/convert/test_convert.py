"""Real TP=2 x PP=2 (and TP=2 x ZeRO-3) checkpoints -> Hugging Face Llama, checked against the source."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from megatron_lev.cli import main as cli_main
from megatron_lev.convert import hf_export
from megatron_lev.convert.hf_export import export_to_hf, source_model
from megatron_lev.convert.source import open_checkpoint
from megatron_lev.engine.checkpoint_files import CheckpointError
from tests.convert.ds_checkpoints import text_batches

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def hf_exports(ds_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    return {v: export_to_hf(ds_checkpoints[v][0], out / v, progress=False) for v in ("tied", "lev")}


@pytest.mark.parametrize("variant", ["tied", "lev"])
def test_export_loads_as_plain_llama_and_matches_the_source(
    variant, hf_exports, ds_checkpoints, tokenizer_path, sample_text
):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    result = hf_exports[variant]
    assert result.report is not None and result.report.max_abs_diff < 1e-4
    cfg = json.loads((result.out_dir / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is (variant == "tied") and cfg["vocab_size"] == 50277
    assert not (result.out_dir / "modeling_lev.py").exists()  # plain Llama, no custom code

    model = AutoModelForCausalLM.from_pretrained(result.out_dir).eval()
    assert type(model) is LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(result.out_dir)
    _, held_out = text_batches(tokenizer_path, sample_text)
    from megatron_lev.data.tokenizers import build_tokenizer

    assert tok(sample_text[:2000])["input_ids"] == build_tokenizer("hf", tokenizer_path).encode(
        sample_text[:2000]
    )

    # held-out text: the unmerged TP=2 x PP=2 engine's evaluation loss == the merged model's (padded
    # vocabulary, as trained) and the HF model's loss == the merged model's over the real vocabulary
    ids, labels = held_out[:, :-1], held_out[:, 1:]
    source = source_model(open_checkpoint(ds_checkpoints[variant][0]), progress=False)
    with torch.no_grad():
        assert source(ids, labels).mean().item() == pytest.approx(
            ds_checkpoints[variant][1]["eval_loss"], rel=1e-6
        )
        project_loss = F.cross_entropy(source(ids)[..., :50277].flatten(0, 1), labels.flatten()).item()
        hf_loss = F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten()).item()
    assert hf_loss == pytest.approx(project_loss, rel=1e-6)

    generated = model.generate(held_out[:1, :5], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 9) and torch.equal(generated[:, :5], held_out[:1, :5])


def test_zero3_bf16_checkpoint_through_the_cli(ds_checkpoints, tmp_path, capsys):
    """ZeRO-3 partitions gathered per TP rank; ALBERT's compressed input is materialised; bf16 export."""
    save_dir, _ = ds_checkpoints["albert"]
    out = tmp_path / "albert"
    assert cli_main(["convert", str(save_dir), str(out), "--dtype", "bf16", "--no-progress"]) == 0
    assert "validation passed" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.model.embed_tokens.weight.shape == (50277, 32)


def test_a_wrong_mapping_fails_validation_and_names_the_layer(ds_checkpoints, tmp_path, monkeypatch, capsys):
    real = hf_export.to_hf

    def swapped_qk(name, tensor, cfg, vocab):  # a typical conversion bug in block 1 only
        out = real(name, tensor, cfg, vocab)
        if name == "layers.1.attention.qkv.weight":
            (q_name, q), (k_name, k), v = out
            out = [(q_name, torch.cat([k, k])), (k_name, q[: k.shape[0]]), v]
        return out

    monkeypatch.setattr(hf_export, "to_hf", swapped_qk)
    out = tmp_path / "bad"
    rc = cli_main(["convert", str(ds_checkpoints["tied"][0]), str(out), "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "VALIDATION FAILED" in err and "stage 'layer 1'" in err
    assert not out.exists() and (tmp_path / "bad.invalid" / "config.json").is_file()


def _copy(ds_checkpoints, tmp_path):
    src = ds_checkpoints["tied"][0]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst, dst / (src / "latest").read_text().strip()


def test_truncated_shard_is_named(ds_checkpoints, tmp_path):
    root, tag = _copy(ds_checkpoints, tmp_path)
    victim = tag / "layer_01-model_01-model_states.pt"
    victim.write_bytes(victim.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="layer_01-model_01-model_states.pt"):
        export_to_hf(root, tmp_path / "out", progress=False)


def test_missing_shard_and_missing_marker(ds_checkpoints, tmp_path):
    root, tag = _copy(ds_checkpoints, tmp_path)
    (tag / "complete").unlink()
    with pytest.raises(CheckpointError, match="interrupted"):
        export_to_hf(root, tmp_path / "out", progress=False)
    (tag / "complete").write_text("{}")
    (tag / "layer_02-model_00-model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="layer 2 has files for TP ranks \\[1\\]"):
        export_to_hf(root, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _unprefixed(name: str) -> str:
    """The older layer-file name: `layers.0.mlp.down.weight` -> `mlp.down.weight`, `final_norm.weight` ->
    `weight`."""
    if name.startswith("layers."):
        return name.split(".", 2)[2]
    return name.removeprefix("final_norm.").removeprefix("output_head.")


def test_layer_files_of_the_older_layout_are_refused(ds_checkpoints, tmp_path):
    """Older pipeline layer files named parameters relative to their layer (`attention.qkv.weight`)."""
    root, tag = _copy(ds_checkpoints, tmp_path)
    (tag / "complete").write_text("{}")  # no checksums: the files below are rewritten
    for path in tag.glob("layer_*-model_states.pt"):
        state = torch.load(path, weights_only=True)
        torch.save({_unprefixed(k): v for k, v in state.items()}, path)
    with pytest.raises(CheckpointError, match="older megatron-lev .pipeline layer files without canonical"):
        export_to_hf(root, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    from megatron_lev.convert.reshard import reshard

    with pytest.raises(CheckpointError, match="older megatron-lev"):
        reshard(root, tmp_path / "tp1", tp=1, pp=1)


def test_wrong_config_is_refused(ds_checkpoints, tmp_path):
    root, tag = _copy(ds_checkpoints, tmp_path)
    cfg = (tag / "config.yaml").read_text().replace("embedding: tied", "embedding: untied")
    (tmp_path / "other.yaml").write_text(cfg)
    with pytest.raises(CheckpointError, match="model.embedding"):
        export_to_hf(root, tmp_path / "out", config=tmp_path / "other.yaml", progress=False)


def test_lm_eval_runs_on_the_export(hf_exports, shared_data, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = tmp_path / "tasks"
    assert cli_main(["lm-eval-tasks", "--data-dir", str(shared_data / "eval"), "--out", str(tasks)]) == 0
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_exports['lev'].out_dir},dtype=float32",
        tasks=["local_arc_easy", "local_winogrande"],
        limit=4,
        batch_size=4,
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        device="cpu",
    )
    for task in ("local_arc_easy", "local_winogrande"):
        acc = out["results"][task]["acc,none"]
        assert 0.0 <= acc <= 1.0
    assert out["results"]["local_arc_easy"]["acc_norm,none"] >= 0.0


def test_keep_lev_exports_a_trainable_lev_layer(ds_checkpoints, hf_exports, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lev_layer"
    assert cli_main(["convert", str(ds_checkpoints["lev"][0]), str(out), "--keep-lev", "--no-progress"]) == 0
    assert "validation passed" in capsys.readouterr().out
    assert (out / "modeling_lev_llama.py").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    dense = AutoModelForCausalLM.from_pretrained(hf_exports["lev"].out_dir).eval()
    ids = torch.tensor([[5, 50276, 17, 5, 1000, 50275]])
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, dense(ids).logits, atol=1e-4, rtol=1e-4)
    model.train()
    model(ids, labels=ids).loss.backward()
    assert model.model.embed_tokens.delta.grad.abs().sum() > 0  # LEV keeps training as a layer

    assert cli_main(["convert", str(ds_checkpoints["tied"][0]), str(tmp_path / "x"), "--keep-lev"]) == 2
    assert "--keep-lev needs a LEV model" in capsys.readouterr().err
