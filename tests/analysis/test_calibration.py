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
    with pytest.raises(DataError, match=r"--runs lev-s9: no collected run of that name"):
        calibrate_study(out, raw, runs=["lev-s1234", "lev-s9"], log=lambda m: None)


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
        "bucket_nll_sum": np.stack([nll, nll + 100 * np.arange(6)], axis=1).tolist(),  # (T, 2, docs)
        "bucket_tokens": [[1] * 6, [1] * 6],
    }
    fit = cross_fitted(record)
    assert fit["fit"] == (2.0, 0.8)  # the even documents get the odd ones' temperature
    np.testing.assert_array_equal(fit["nll_sum"], [3.0, 3.0] * 3)  # each at its worst: no leak
    np.testing.assert_array_equal(fit["bucket_nll_sum"], [[3.0] * 6, [3.0 + 100 * d for d in range(6)]])


MULT = 1 + 0.1 * np.sin(np.arange(20))  # every document's losses scaled alike: intervals with width


def _write_record(raw, run: str, kind: str, stage: int, one: tuple, hot: tuple) -> None:
    """A record and its evaluation over 20 documents of 2 tokens in each of the 5 buckets; `one` and
    `hot` = (loss of a target below 1e-7, loss of any other target) at T = 1 and at T = 1.5."""
    rows = [[2 * v * m for m in MULT] for v in (one[0], hot[0])]
    others = [[2 * v * m for m in MULT] for v in (one[1], hot[1])]
    record = {
        "temperatures": [1.0, 1.5],
        "bucket_edges": [1e-7, 1e-6, 1e-5, 1e-4],
        "tokens": [10] * 20,
        "bucket_tokens": [[2] * 20 for _ in range(5)],
        "nll_sum": [[r + 4 * o for r, o in zip(rows[t], others[t])] for t in (0, 1)],
        "bucket_nll_sum": [[rows[t]] + [others[t]] * 4 for t in (0, 1)],
        "entropy_sum": [50.0] * 20,
    }
    (raw / run).mkdir(parents=True, exist_ok=True)
    (raw / run / f"calibration{kind}-i{stage}.json").write_text(json.dumps(record))
    per_doc = {"tokens": record["tokens"], "nll_sum": record["nll_sum"][0]}
    result = {"results": [{"corpus_kind": "text", "per_document": per_doc}]}
    (raw / run / f"eval{kind}-i{stage}.json").write_text(json.dumps(result))


LEV_1234 = ((14.0, 5.0), (14.2, 5.1))  # best at T = 1 (overall 68 against 69.2 a document)


@pytest.mark.parametrize(
    "tied_rare_hot, reading",
    [
        ((14.0, 14.0), "the lead is sharpness"),  # cross-fitted, TIED at 1.5 matches LEV
        ((14.5, 14.5), "the lead survives calibration"),
        ((14.0, 14.5), "mixed"),  # per seed
    ],
)
def test_the_follow_ups_reading_b(tmp_path, tied_rare_hot, reading):
    from studies import calibration_report as cal

    for stage in (1000, 2000):
        for kind in ("", "-cool"):
            _write_record(tmp_path, "lev-s1234", kind, stage, *LEV_1234)
            _write_record(tmp_path, "lev-s1235", kind, stage, (14.6, 5.3), (14.0, 5.0))
            for seed, rare in zip((1234, 1235), tied_rare_hot):
                _write_record(tmp_path, f"tied-s{seed}", kind, stage, (15.0, 5.0), (rare, 4.9))
    page = cal.report(tmp_path)
    assert "- **(a) the LEV seed gap**: sharpness explains it." in page
    assert f"- **(b) LEV - TIED below 1e-7**: {reading}." in page
    g = (2 * 14.6 + 8 * 5.3 - 68) / 10 * MULT.mean()
    assert f"| 1,000 | {g:+.3f} [" in page and "| +0.000 [+0.000, +0.000] | +0.00 |" in page
    # the rarest bucket is read, not the others (where LEV and TIED differ by 0 at T = 1)
    assert f"| 1234 | constant | 1,000 | {-MULT.mean():+.3f} [" in page
    assert "| tied-s1234 | constant | 1,000 | " in page and "| 1.50, 1.50 | 1.50 |" in page
    assert "| lev-s1234 | constant | 1,000 | " in page and "| 1.00, 1.00 | 1.00 |" in page
    # without the cooled records of one seed, (b) is not read
    for stage in (1000, 2000):
        (tmp_path / "tied-s1235" / f"calibration-cool-i{stage}.json").unlink()
    assert cal.reading_b(cal.records(tmp_path))[0].startswith("open")


@pytest.mark.parametrize(
    "lev_1235, reading",
    [
        (((14.6, 5.3), (14.0, 5.2)), "partly"),  # Gc = 0.16 of G = 0.36
        (((14.6, 5.3), (14.6, 5.3)), "it does not"),  # no temperature helps
        (((13.0, 4.8), (13.0, 4.8)), "open (G is not positive"),  # seed 1235 ahead
    ],
)
def test_the_follow_ups_reading_a(tmp_path, lev_1235, reading):
    from studies import calibration_report as cal

    for stage in (1000, 2000):
        _write_record(tmp_path, "lev-s1234", "", stage, *LEV_1234)
        _write_record(tmp_path, "lev-s1235", "", stage, *lev_1235)
    assert cal.reading_a(cal.records(tmp_path))[0].startswith(reading)
    (tmp_path / "lev-s1235" / "calibration-i1000.json").unlink()  # stage 1 of one seed missing
    _write_record(tmp_path, "lev-s1234", "", 3000, *LEV_1234)
    _write_record(tmp_path, "lev-s1235", "", 3000, *lev_1235)
    assert cal.reading_a(cal.records(tmp_path))[0].startswith("open (needs both LEV seeds")


def test_a_record_that_is_not_its_evaluations_is_refused(tmp_path):
    from studies import calibration_report as cal

    _write_record(tmp_path, "lev-s1234", "", 1000, *LEV_1234)
    healthy = tmp_path / "copy"  # the same record and evaluation at another path are read
    shutil.copytree(tmp_path / "lev-s1234", healthy / "lev-s1234")
    assert len(cal.records(healthy)) == 1
    path = tmp_path / "lev-s1234" / "calibration-i1000.json"
    record = json.loads(path.read_text())
    record["nll_sum"][0][3] += 0.5
    path.write_text(json.dumps(record))
    with pytest.raises(
        DataError, match=r"calibration-i1000.json: its T = 1 loss differs from the evaluation"
    ):
        cal.records(tmp_path)
    record["nll_sum"][0][3] -= 0.5
    record["tokens"][0] += 1
    path.write_text(json.dumps(record))
    with pytest.raises(DataError, match=r"token counts are not those of the evaluation beside it"):
        cal.records(tmp_path)
