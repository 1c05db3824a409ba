"""One definition: `GPTModel` and the pipeline build the same stages, under the same (canonical) names,
with the same weights."""

from pathlib import Path

import pytest
import torch

from megatron_lev.engine.build import build_model
from megatron_lev.engine.checkpoint_files import find_files, load_file
from megatron_lev.model.documents import Documents
from megatron_lev.model.embeddings import REGISTRY
from megatron_lev.model.gpt import GPTModel
from megatron_lev.model.stages import BlockStage, stage_specs
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.plan import model_spec
from megatron_lev.testing import run_distributed
from tests.model.test_pipeline import MICRO, VOCAB, _adamw, _config


@pytest.mark.parametrize("embedding", tuple(REGISTRY))
def test_gpt_state_dict_is_the_union_of_its_stages(embedding):
    cfg = _config(embedding, 1, 1)
    model = GPTModel(cfg.model, VOCAB, seed=cfg.train.seed, true_vocab_size=200)
    specs = stage_specs(cfg.model, VOCAB, cfg.train.seed, true_vocab_size=200)
    assert len(specs) == cfg.model.num_layers + 3
    union: dict[str, torch.Tensor] = {}
    for spec in specs:  # a tied table's second copy builds the same names and weights again
        for name, tensor in spec.build().state_dict().items():
            assert torch.equal(union.setdefault(name, tensor), tensor), name
    state = model.state_dict()
    assert list(state) == [n for n in union if n in state]  # same names, same order
    assert set(state) == set(union)
    for name, tensor in state.items():
        assert torch.equal(tensor, union[name]), name


@pytest.mark.parametrize("inputs", [("position_ids",), ("document_ids",), ("position_ids", "document_ids")])
def test_a_block_stage_carries_any_document_tensors_it_is_given(inputs):
    cfg = _config("tied", 1, 1)
    stage = BlockStage(cfg.model, 0, cfg.train.seed, inputs)
    h = torch.randn(2, 16, cfg.model.hidden_size)
    tensors = {
        "position_ids": torch.arange(16).remainder(5).expand(2, 16),
        "document_ids": torch.arange(16).div(5, rounding_mode="floor").expand(2, 16),
    }
    extra = tuple(tensors[name] for name in inputs)
    out, *rest = stage((h, *extra))
    given = {name: tensors[name] for name in inputs}
    documents = Documents(given.get("position_ids"), given.get("document_ids"))
    assert all(a is b for a, b in zip(rest, extra, strict=True))
    assert torch.equal(out, stage.block(h, documents))


def _layer_files_worker(root: str, embeddings):
    import deepspeed

    from megatron_lev.parallel import state

    layout = state.initialize_model_parallel(1, 2)
    blocks = {}
    for embedding in embeddings:
        pipe = build_model(model_spec(_config(embedding, 1, 2), VOCAB, layout.world_size), layout)
        blocks[embedding] = [type(f).__name__ for f in pipe.forward_funcs].count(BlockStage.__name__)
        ds_config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1},
            "steps_per_print": 10**6,
        }
        engine, *_ = deepspeed.initialize(
            model=pipe, optimizer=_adamw(pipe.parameters()), config=ds_config, dist_init_required=False
        )
        engine.save_checkpoint(str(Path(root) / embedding), tag="t")
    return blocks


@pytest.mark.multiprocess
def test_pp2_layer_files_hold_canonical_names_and_the_plain_model_weights(tmp_path):
    embeddings = ("tied", "untied")
    results = run_distributed(
        _layer_files_worker, world_size=2, args=(str(tmp_path), embeddings), timeout=400
    )
    for embedding in embeddings:
        assert [r[embedding] for r in results] == [1, 1]  # "uniform": one block per stage
        reference = build_model(model_spec(_config(embedding, 1, 1), VOCAB), SINGLE).state_dict()
        files = find_files(tmp_path / embedding / "t")
        assert files.kind == "pipeline" and files.tp == 1
        seen = set()
        for idx, by_rank in sorted(files.layer_files.items()):
            for name, tensor in load_file(by_rank[0]).items():
                assert name in reference, f"{embedding} layer {idx}: {name!r} is not a GPTModel name"
                assert torch.equal(tensor, reference[name]), f"{embedding} layer {idx}: {name}"
                seen.add(name)
        assert seen == set(reference), f"{embedding}: {sorted(set(reference) - seen)} not in any layer file"
