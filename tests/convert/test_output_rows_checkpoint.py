"""`studies.output_rows` on real TP=2 x PP=2 ZeRO-1 checkpoints: it reads the output layer (LEV's head,
TIED's table) merged over the shards, and its row norms are those of the canonical weights the export
reads by its own path."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lev.analysis.perplexity import COUNT_EDGES
from megatron_lev.convert.source import iter_canonical, open_checkpoint
from studies.output_rows import output_rows

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "variant, parameter", [("lev", "output_head.weight"), ("tied", "embedding.table.weight")]
)
def test_the_output_rows_of_a_sharded_checkpoint(variant, parameter, ds_checkpoints):
    save_dir, _ = ds_checkpoints[variant]
    src = open_checkpoint(save_dir)
    vocab = src.vocab_size
    counts = np.random.default_rng(0).choice([0, 3, 40, 400, 4000], size=vocab)
    rec = output_rows(save_dir, counts)
    assert rec["parameter"] == parameter and rec["tag"] == src.tag_dir.name
    assert rec["adam_eps"] == src.cfg.train.adam_eps and rec["step"] > 0
    assert sum(b["rows"] for b in rec["bands"]) == vocab  # the padding rows left out
    weight = dict(iter_canonical(src, progress=False))[parameter].float().numpy()
    band = np.searchsorted(np.asarray(COUNT_EDGES), counts, side="right")
    for b, stats in enumerate(rec["bands"]):
        norms = np.linalg.norm(weight[:vocab][band == b], axis=1)
        assert stats["rows"] == len(norms)
        assert stats["row_norm_median"] == pytest.approx(float(np.median(norms)), rel=1e-6)
        assert 0 < stats["sqrt_v"]["q10"] <= stats["sqrt_v"]["q50"] <= stats["sqrt_v"]["q90"]
        assert 0 < stats["eps_share_median"] < 1
