"""The loss by softmax temperature: at T = 1 it is `evaluate`'s, per document and per bucket; a
cross-fitted temperature comes from the other parity's documents; a known temperature is recovered;
the follow-up's readings on records with known differences."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from megatron_lev.analysis.calibration import (
    TEMPERATURES,
    best_temperature,
    cross_fitted,
    mean_entropy,
    temperature_losses,
    temperature_record,
)
from megatron_lev.analysis.corpora import sequence_batches
from megatron_lev.cli import main as cli
from megatron_lev.errors import DataError
from studies.calibrate import calibrate_study, checkpoints
from tests.analysis.conftest import VOCAB


def _study(tmp_path, tiny_llama, shared_data, n_docs: int = 9):
    """A study directory as `studies run` leaves it (data, one exported stage) and its collected
    evaluation, made by the real `evaluate` command."""
    out, raw = tmp_path / "study", tmp_path / "raw"
    (out / "data").mkdir(parents=True)
    texts = [
        f"Document {i}: the river ran past the mill, and {'rare ' * i}words came after it."
        for i in range(n_docs)
    ]
    (out / "data" / "zero_shot.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    counts = np.random.default_rng(0).integers(0, 50, VOCAB).astype(np.int64)
    counts[:500] = 10**6  # frequent ids, so every bucket has tokens
    np.save(out / "data" / "train_text_document.counts.npy", counts)
    model = out / "runs" / "lev-s1234" / "hf-i1000"
    shutil.copytree(tiny_llama, model)
    shutil.copy(shared_data / "tokenizers" / "gpt-neox-20b.json", model / "tokenizer.json")
    evaluated = tmp_path / "eval"
    argv = ["evaluate", str(model), "--text", str(out / "data" / "zero_shot.jsonl"), "--counts"]
    argv += [str(out / "data" / "train_text_document.counts.npy"), "--seq-len", "16", "--threads", "1"]
    assert cli([*argv, "--out", str(evaluated)]) == 0
    (raw / "lev-s1234").mkdir(parents=True)
    shutil.copy(evaluated / "eval.json", raw / "lev-s1234" / "eval-i1000.json")
    return out, raw


def test_the_record_at_t_1_is_evaluates_result_per_document_and_bucket(tmp_path, tiny_llama, shared_data):
    out, raw = _study(tmp_path, tiny_llama, shared_data)
    written = calibrate_study(out, raw, seq_len=16, log=lambda m: None)
    assert [p.name for p in written] == ["calibration-i1000.json"]
    record = json.loads(written[0].read_text())
    result = next(
        r
        for r in json.loads((raw / "lev-s1234" / "eval-i1000.json").read_text())["results"]
        if r["corpus_kind"] == "text"
    )
    one = record["temperatures"].index(1.0)
    doc = result["per_document"]
    assert record["tokens"] == doc["tokens"] and record["bucket_tokens"] == doc["bucket_tokens"]
    np.testing.assert_allclose(record["nll_sum"][one], doc["nll_sum"], atol=1e-4)
    np.testing.assert_allclose(record["bucket_nll_sum"][one], doc["bucket_nll_sum"], atol=1e-4)
    # another temperature is another loss, and the entropy of a random tiny model is near log V
    assert not np.allclose(record["nll_sum"][0], record["nll_sum"][one], atol=1e-3)
    assert abs(mean_entropy(record) - math.log(VOCAB)) < 0.5
    # a record already written is kept: the command goes on where it stopped
    assert calibrate_study(out, raw, seq_len=16, log=lambda m: None) == []


def test_a_collected_stage_without_its_exported_model_is_named(tmp_path, tiny_llama, shared_data):
    out, raw = _study(tmp_path, tiny_llama, shared_data, n_docs=3)
    (raw / "lev-s1234" / "eval-cool-i1000.json").write_text("{}")
    assert [(r, k, n) for r, k, n, _ in checkpoints(out, raw)] == [
        ("lev-s1234", "", 1000),
        ("lev-s1234", "-cool", 1000),
    ]
    with pytest.raises(
        DataError, match=r"lev-s1234-cool-i1000/hf: no exported model for lev-s1234-cool at 1000"
    ):
        calibrate_study(out, raw, seq_len=16, log=lambda m: None)
    assert (raw / "lev-s1234" / "calibration-i1000.json").is_file()  # what came before it was kept


def _bigram_model(temperature: float, vocab: int = 40, n_docs: int = 60, doc_len: int = 50, seed: int = 0):
    """Documents whose next token is drawn from softmax(table[previous] / temperature), and the model
    that predicts softmax(table[previous]): over-confident by `temperature`."""
    g = torch.Generator().manual_seed(seed)
    table = 3 * torch.randn(vocab, vocab, generator=g)
    docs = []
    for _ in range(n_docs):
        ids = [int(torch.randint(vocab, (1,), generator=g))]
        for _ in range(doc_len - 1):
            p = torch.softmax(table[ids[-1]] / temperature, dim=-1)
            ids.append(int(torch.multinomial(p, 1, generator=g)))
        docs.append(np.asarray(ids))
    return docs, (lambda inputs: table[inputs])


def test_a_known_over_confidence_is_recovered_and_the_fitted_loss_is_lower():
    docs, model_fn = _bigram_model(temperature=1.5)
    batches = list(sequence_batches(docs, 32, 4))  # the documents as one stream, as evaluate cuts it
    nll, entropy, targets, inputs = temperature_losses(batches, model_fn, TEMPERATURES, progress=False)
    assert nll.shape == (len(TEMPERATURES), sum(len(d) for d in docs) - 1) and len(entropy) == nll.shape[1]
    record = temperature_record(nll, entropy, targets, TEMPERATURES, [len(d) for d in docs], np.ones(40))
    assert best_temperature(record) in (1.4, 1.5, 1.6)
    fit = cross_fitted(record)
    assert set(fit["fit"]) <= {1.4, 1.5, 1.6}
    one = record["temperatures"].index(1.0)
    assert fit["nll_sum"].sum() < np.sum(record["nll_sum"][one]) - 0.05 * np.sum(record["tokens"])
    # T = 1 is F.cross_entropy of the logits
    logits = torch.cat([model_fn(b[:, :-1]).reshape(-1, 40) for b in batches])
    ref = torch.nn.functional.cross_entropy(
        logits, torch.cat([b[:, 1:].reshape(-1) for b in batches]), reduction="none"
    )
    np.testing.assert_allclose(nll[one], ref.double().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(inputs[1:], targets[:-1])


def test_each_parity_is_scored_at_the_temperature_the_other_parity_fits():
    temps = [0.8, 1.0, 2.0]
    # even documents are best at 0.8, odd ones at 2.0
    per_doc = {0: [1.0, 2.0, 3.0], 1: [3.0, 2.0, 1.0]}
    nll = np.array([[per_doc[d % 2][t] for d in range(6)] for t in range(3)])
    record = {
        "temperatures": temps,
        "tokens": [1] * 6,
        "nll_sum": nll.tolist(),
        "bucket_nll_sum": nll[:, None, :].tolist(),
        "bucket_tokens": [[1] * 6],
    }
    fit = cross_fitted(record)
    assert fit["fit"] == (2.0, 0.8)  # the even documents get the odd ones' temperature
    np.testing.assert_array_equal(fit["nll_sum"], [3.0, 3.0] * 3)  # each at its worst: no leak
    np.testing.assert_array_equal(fit["bucket_nll_sum"], [[3.0, 3.0] * 3])


def _write_record(raw, run: str, kind: str, stage: int, at_one: float, at_hot: float, docs: int = 20) -> None:
    """A record over `docs` documents of 2 tokens in each of the 5 buckets, every token's loss
    `at_one` at T = 1 and `at_hot` at T = 1.5 (in every bucket)."""
    bucket_tokens = [[2] * docs for _ in range(5)]
    bucket = [[[2 * v] * docs for _ in range(5)] for v in (at_one, at_hot)]
    record = {
        "temperatures": [1.0, 1.5],
        "bucket_edges": [1e-7, 1e-6, 1e-5, 1e-4],
        "tokens": [10] * docs,
        "bucket_tokens": bucket_tokens,
        "nll_sum": [[10 * v] * docs for v in (at_one, at_hot)],
        "bucket_nll_sum": bucket,
        "entropy_sum": [50.0] * docs,
    }
    (raw / run).mkdir(parents=True, exist_ok=True)
    (raw / run / f"calibration{kind}-i{stage}.json").write_text(json.dumps(record))


@pytest.mark.parametrize(
    "tied_hot, reading",
    [(14.0, "the lead is sharpness"), (14.5, "the lead survives calibration")],
)
def test_the_follow_ups_readings(tmp_path, tied_hot, reading):
    from studies import calibration_report as cal

    for stage in (1000, 2000):
        for kind in ("", "-cool"):
            _write_record(tmp_path, "lev-s1234", kind, stage, 14.0, 14.2)  # best at T = 1
            _write_record(tmp_path, "lev-s1235", kind, stage, 14.6, 14.0)  # flatter is better
            for seed in (1234, 1235):
                _write_record(tmp_path, f"tied-s{seed}", kind, stage, 15.0, tied_hot)
    page = cal.report(tmp_path)
    assert "- **(a) the LEV seed gap**: sharpness explains it." in page
    assert f"- **(b) LEV - TIED below 1e-7**: {reading}." in page
    assert "| 1,000 | +0.600 | +0.000 | +0.00 |" in page  # G, Gc, their ratio
    # TIED is fitted at 1.5 on both parities, LEV seed 1234 at 1.0
    assert "| tied-s1234 | constant | 1,000 | 15.000 | " + f"{tied_hot:.3f} | 1.50, 1.50 | 1.50 |" in page
    assert "| lev-s1234 | constant | 1,000 | 14.000 | 14.000 | 1.00, 1.00 | 1.00 |" in page
    a, _ = cal.reading_a({k: v for k, v in cal.records(tmp_path).items() if k[0] != "lev-s1235"})
    assert a.startswith("open")
