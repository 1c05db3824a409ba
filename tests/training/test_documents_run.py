"""`pretrain(cfg)` with the packed-document keys on: the EOD id comes from the run's tokenizer, and
the batches (training and validation) carry the document tensors to the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.conftest import tiny_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

DOCUMENT_KEYS = {
    "data.reset_position_ids": "true",
    "data.reset_attention_mask": "true",
    "data.eod_mask_loss": "true",
}


def _runs(prefix: str, tok: str, out: str) -> dict:
    from megatron_lev.data.boundaries import DocumentLayout
    from megatron_lev.data.tokenizers import build_tokenizer
    from tests.training.suites import _pretrain

    layouts = []
    original = DocumentLayout.from_config.__func__

    def recording(cls, data_cfg, eod):
        layouts.append(original(cls, data_cfg, eod))
        return layouts[-1]

    DocumentLayout.from_config = classmethod(recording)
    result = {"eod": build_tokenizer("hf", tok).eod}
    for name, extra in (("plain", {}), ("documents", DOCUMENT_KEYS)):
        res = _pretrain(
            tiny_overrides(
                prefix,
                tok,
                Path(out) / name,
                **{"train.train_iters": 4, "train.eval_interval": 2, "train.eval_iters": 2, **extra},
            )
        )
        result[name] = (res.exit_code, res.losses)
    result["layouts"] = layouts
    return result


def test_document_keys_reach_the_model(minipile_prefix, tokenizer_path, tmp_path):
    from megatron_lev.testing.distributed import run_distributed

    (r,) = run_distributed(
        _runs, world_size=1, args=(minipile_prefix, tokenizer_path, str(tmp_path)), timeout=300
    )
    plain, docs = r["layouts"]
    assert plain is None  # off by default: the batches are plain (input_ids, labels)
    assert (
        docs.eod == r["eod"] and docs.reset_position_ids and docs.reset_attention_mask and docs.eod_mask_loss
    )
    assert r["plain"][0] == 0 and r["documents"][0] == 0
    # the same data and weights: the losses part at the first batch that holds an EOD
    plain_losses, document_losses = r["plain"][1], r["documents"][1]
    assert any(abs(document_losses[i] - plain_losses[i]) > 1e-5 for i in plain_losses), (
        plain_losses,
        document_losses,
    )
