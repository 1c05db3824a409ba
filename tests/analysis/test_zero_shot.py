"""LAMBADA last-word prediction and document-level Wikitext perplexity (`evaluate --lambada /
--wikitext`) on a tiny random Llama, checked against independent per-passage / per-window scoring."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_lev.analysis.zero_shot import rolling_windows
from megatron_lev.cli import main as cli
from megatron_lev.data.zero_shot_formats import (
    article_title,
    read_lambada,
    split_last_word,
    split_wikitext,
    wikitext_detokenize,
)
from megatron_lev.errors import DataError

CONTEXTS = [
    "The cat sat on the",
    "She opened the door and saw",
    "In the morning we walked to the",
    "He said that the answer was",
    "They bought a new",
    "After dinner the children played",
    "My favourite colour is",
]

WIKI = (
    " \n"
    " = Robert Boulter = \n"
    " \n"
    " Robert Boulter is an English actor . He had a guest @-@ starring role . \n"
    " \n"
    " = = Career = = \n"
    " \n"
    " In 2006 , he starred in a play ( 1 @,@ 000 words ) . \n"
    " = Du Fu = \n"
    " \n"
    " Du Fu was a prominent Chinese poet of the Tang dynasty . He wrote 1 @.@ 5 poems a day . \n"
    " = = = Early life = = = \n"
    ' The " Sage Poet " lived in the 8th century . \n'
)


@pytest.fixture(scope="module")
def model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama)).eval()


@pytest.fixture(scope="module")
def tok(shared_data):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(shared_data / "tokenizers" / "gpt-neox-20b.json"))


def _enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _evaluate(tiny_llama, shared_data, tmp_path, *flags, tokenizer=None) -> dict:
    out = tmp_path / "out"
    tokenizer = tokenizer or shared_data / "tokenizers" / "gpt-neox-20b.json"
    argv = ["evaluate", str(tiny_llama), "--tokenizer", str(tokenizer)]
    assert cli([*argv, *map(str, flags), "--out", str(out), "--threads", "1", "--batch-size", "3"]) == 0
    return json.loads((out / "eval.json").read_text())


# ------------------------------------------------------------------------------------------ LAMBADA


@pytest.mark.parametrize(
    "text, context, target",
    [
        ("he said hello", "he said", " hello"),
        ("he said hello\n", "he said", " hello"),
        ("a  b  ", "a", " b"),
        ("one", "", " one"),
        ("quoted \u201cend.\u201d", "quoted", " \u201cend.\u201d"),
    ],
)
def test_target_is_the_last_word_with_its_leading_space(text, context, target):
    assert split_last_word(text) == (context, target)


def test_lambada_jsonl_and_plain_text_read_alike(tmp_path):
    texts = ["first passage ends here", "second one ends there"]
    (tmp_path / "l.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts))
    )
    (tmp_path / "l.txt").write_text(texts[0] + "\n\n" + texts[1] + "\n")
    a, b = read_lambada(tmp_path / "l.jsonl"), read_lambada(tmp_path / "l.txt")
    assert [(p.context, p.target) for p in a] == [(p.context, p.target) for p in b]
    assert [p.target for p in a] == [" here", " there"] and [p.line for p in b] == [1, 3]
    assert [p.normalised for p in a] == texts
    assert len(read_lambada(tmp_path / "l.txt", max_passages=1)) == 1


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("e.jsonl", "", r"e\.jsonl: no passages"),
        ("e.txt", "\n  \n", r"e\.txt: no passages"),
        ("k.jsonl", '{"text": "a b"}\n{"body": "c d"}\n', r"k\.jsonl:2: no 'text' field"),
        ("j.jsonl", '{"text": "a b"}\n\n{"text": "c d"\n', r"j\.jsonl:3: not a JSON object"),
        ("n.jsonl", '{"text": ["a"]}\n', r"n\.jsonl:1: 'text' is a list"),
        ("w.jsonl", '{"text": "  "}\n', r"w\.jsonl:1: the passage is empty"),
    ],
)
def test_bad_lambada_files_name_file_and_line(tmp_path, name, content, fragment):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=fragment):
        read_lambada(tmp_path / name)
    with pytest.raises(DataError, match=r"gone\.jsonl: LAMBADA file not found"):
        read_lambada(tmp_path / "gone.jsonl")


def _hand_lambada(model, tok, texts: list[str], seq_len: int) -> tuple[list[bool], list[float]]:
    """lm-eval's loglikelihood for a causal model, one passage at a time: encode the whole passage
    and the context, the target is the rest; keep the last S+1 tokens; greedy = argmax at every
    target position."""
    hits, nlls = [], []
    with torch.no_grad():
        for text in texts:
            words = text.split(" ")
            context, target = " ".join(words[:-1]), " " + words[-1]
            ctx = _enc(tok, context)
            cont = _enc(tok, context + target)[len(ctx) :]
            inp = (ctx + cont)[-(seq_len + 1) :][:-1]
            logits = model(input_ids=torch.tensor([inp])).logits[0, -len(cont) :]
            target_ids = torch.tensor(cont)
            hits.append(bool((logits.argmax(-1) == target_ids).all()))
            nlls.append(float(F.cross_entropy(logits, target_ids, reduction="sum")))
    return hits, nlls


def _greedy_passages(model, tok) -> list[str]:
    """Each context followed by the model's own greedy next word where that is a whole word (a hit),
    else by a word it does not predict (a miss)."""
    texts = []
    with torch.no_grad():
        for context in CONTEXTS:
            ids = _enc(tok, context)
            best = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            word = tok.decode([best])
            if re.fullmatch(r" [A-Za-z]+", word) and _enc(tok, context + word) == ids + [best]:
                texts.append(context + word)
            else:
                texts.append(context + " banana")
    return texts


@pytest.mark.parametrize("seq_len", [64, 6])  # 6: contexts are cut to the window
def test_lambada_accuracy_and_perplexity_match_hand_scoring(
    model, tok, tiny_llama, shared_data, tmp_path, seq_len
):
    texts = _greedy_passages(model, tok)
    hits, nlls = _hand_lambada(model, tok, texts, seq_len)
    assert 0 < sum(hits) < len(hits), "the check needs both hits and misses"
    path = tmp_path / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = _evaluate(tiny_llama, shared_data, tmp_path, "--lambada", path, "--seq-len", seq_len)
    (res,) = data["results"]
    assert res["corpus_kind"] == "lambada" and res["task"] == "lambada" and res["name"] == "tiny-llama"
    assert res["count"] == len(texts)
    assert res["acc"] == pytest.approx(sum(hits) / len(hits), abs=1e-12)
    assert res["mean_nll"] == pytest.approx(np.mean(nlls), rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(np.mean(nlls)), rel=1e-5)
    assert (res["truncated"] > 0) == (seq_len == 6)
    per = res["per_document"]  # per passage, for compare's bootstrap: they add up to the result
    assert per["unit"] == "passage" and per["count"] == len(texts) and per["tokens"] == [1] * len(texts)
    assert per["nll_sum"] == pytest.approx(nlls, rel=1e-5) and per["hits"] == [int(h) for h in hits]
    md = (tmp_path / "out" / "eval.md").read_text()
    assert f"LAMBADA tiny-llama ({path}): acc {res['acc']:.4f}" in md


# ----------------------------------------------------------------------------------------- Wikitext


def test_articles_split_at_top_level_headings_only(tmp_path):
    (tmp_path / "wiki.test.raw").write_text(WIKI)
    docs = split_wikitext(tmp_path / "wiki.test.raw")
    assert [d.title for d in docs] == ["Robert Boulter", "Du Fu"]
    assert [d.line for d in docs] == [2, 9]
    assert docs[0].text.startswith(" = Robert Boulter = \n") and " = = Career = = \n" in docs[0].text
    assert " = = = Early life = = = \n" in docs[1].text
    assert "".join(d.text for d in docs) == WIKI[len(" \n") :]  # only the blank preamble is dropped
    assert docs[0].words == len(docs[0].text.split())
    assert len(split_wikitext(tmp_path / "wiki.test.raw", max_docs=1)) == 1
    assert article_title(" = = Career = = ") is None and article_title("=") is None
    assert article_title(" = A = B = \n") == "A = B"


def test_text_before_the_first_heading_is_a_document(tmp_path):
    (tmp_path / "w.raw").write_text(" stray text \n = T = \n body \n")
    docs = split_wikitext(tmp_path / "w.raw")
    assert [(d.title, d.text) for d in docs] == [(None, " stray text \n"), ("T", " = T = \n body \n")]


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("", r"w\.raw: no text to evaluate"),
        (" \n \n", r"w\.raw: no text"),
        ("plain prose\n", "no article heading"),
    ],
)
def test_bad_wikitext_files(tmp_path, content, fragment):
    (tmp_path / "w.raw").write_text(content)
    with pytest.raises(DataError, match=fragment):
        split_wikitext(tmp_path / "w.raw")


def test_detokenizer_matches_lm_eval():
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    samples = [
        WIKI,
        " the players ' union , 1 @,@ 000 @-@ strong ( founded in 1 @.@ 5 ) ; ",
        ' " quoted " : yes ! 90 \u00b0 C N ',
        " it 's [ a ] { b } ' c ' s ' = = = = x = = = = \n y ? z . ",
    ]
    for s in samples:
        assert wikitext_detokenize(s) == wikitext_detokenizer({"page": s})
    assert wikitext_detokenize(" well @-@ known , 1 @,@ 000 @.@ 5 ") == " well-known, 1,000.5 "


@pytest.mark.parametrize("n", [1, 2, 5, 9, 10, 11, 17, 40])
@pytest.mark.parametrize("seq_len, stride", [(8, None), (8, 3), (8, 1), (1, None), (4, 4)])
def test_rolling_windows_score_every_token_once(n, seq_len, stride):
    scored = []
    for start, end, k in rolling_windows(n, seq_len, stride):
        assert 0 <= start < end and end - start <= seq_len and 1 <= k <= end - start
        targets = list(range(end - k + 1, end + 1))
        assert all(t - 1 >= start for t in targets)  # each prediction sees its previous token
        scored += targets
    assert scored == list(range(1, n))


def test_rolling_windows_are_lm_evals_with_the_end_of_text_prefix():
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    tokens = list(range(100, 123))
    stream = [0, *tokens]
    for seq_len in (4, 7, 23, 30):
        ours = [(stream[s:e], stream[e - k + 1 : e + 1]) for s, e, k in rolling_windows(len(stream), seq_len)]
        theirs = [
            (ctx + cont[:-1], cont)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(tokens, 0, seq_len, 1))
        ]
        assert ours == theirs


def _doc_nll(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
    return float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))


def test_wikitext_word_perplexity_and_windows(model, tok, tiny_llama, shared_data, tmp_path):
    path = tmp_path / "wiki.test.raw"
    path.write_text(WIKI)
    docs = split_wikitext(path)
    eos = tok.token_to_id("<|endoftext|>")
    streams = [[eos, *_enc(tok, d.text)] for d in docs]
    assert max(map(len, streams)) <= 64  # each article fits one window of the tiny model
    total = sum(_doc_nll(model, s) for s in streams)
    words = sum(len(d.text.split()) for d in docs)
    n_bytes = sum(len(d.text.encode()) for d in docs)
    n_tokens = sum(len(s) - 1 for s in streams)

    (whole,) = _evaluate(tiny_llama, shared_data, tmp_path, "--wikitext", path, "--seq-len", 64)["results"]
    assert whole["corpus_kind"] == "wikitext" and whole["documents"] == 2
    assert (whole["tokens"], whole["words"], whole["bytes"]) == (n_tokens, words, n_bytes)
    assert whole["total_nll"] == pytest.approx(total, rel=1e-5)
    assert whole["perplexity"] == whole["word_perplexity"] == pytest.approx(math.exp(total / words), rel=1e-5)
    assert whole["word_perplexity"] == pytest.approx(math.exp(whole["total_nll"] / whole["words"]), rel=1e-12)
    assert whole["bits_per_byte"] == pytest.approx(total / n_bytes / math.log(2), rel=1e-5)
    assert whole["token_perplexity"] == pytest.approx(math.exp(total / n_tokens), rel=1e-5)

    # windows of 8 without overlap, then with a stride of 3: every token still scored once
    for stride in (None, 3):
        flags = ["--wikitext", path, "--seq-len", 8, *(["--stride", stride] if stride else [])]
        (res,) = _evaluate(tiny_llama, shared_data, tmp_path, *flags)["results"]
        ref = 0.0
        for s in streams:
            for start, end, k in rolling_windows(len(s), 8, stride):
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([s[start:end]])).logits[0, -k:]
                ref += float(F.cross_entropy(logits, torch.tensor(s[end - k + 1 : end + 1]), reduction="sum"))
        assert res["tokens"] == n_tokens and res["stride"] == (stride or 8)
        # the tiny random model hardly uses context: the windows' loss of it is ~1e-5 relative
        assert res["total_nll"] == pytest.approx(ref, abs=2e-4)
        assert abs(res["total_nll"] - total) > 1e-3

    (detok,) = _evaluate(tiny_llama, shared_data, tmp_path, "--wikitext", path, "--detokenize")["results"]
    assert detok["detokenize"] and (detok["words"], detok["bytes"]) == (words, n_bytes)  # of the raw text
    assert detok["tokens"] == sum(len(_enc(tok, wikitext_detokenize(d.text))) for d in docs)
    md = (tmp_path / "out" / "eval.md").read_text()
    assert "Wikitext tiny-llama" in md and "(detokenised)" in md


def test_all_kinds_in_one_run(tiny_llama, shared_data, tmp_path):
    (tmp_path / "wiki.raw").write_text(WIKI)
    (tmp_path / "lambada.txt").write_text("the dog barked at the mailman\n")
    (tmp_path / "corpus.txt").write_text("Some plain text to evaluate as a corpus.")
    flags = ["--text", tmp_path / "corpus.txt", "--lambada", tmp_path / "lambada.txt"]
    data = _evaluate(tiny_llama, shared_data, tmp_path, *flags, "--wikitext", tmp_path / "wiki.raw")
    assert [r.get("corpus_kind") for r in data["results"]] == ["text", "lambada", "wikitext"]
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 0 for r in data["results"])
    md = (tmp_path / "out" / "eval.md").read_text()
    assert md.startswith("| result |") and "- LAMBADA" in md and "- Wikitext" in md


def test_lambada_numbers_are_lm_evals(model, tok, tiny_llama, shared_data, tmp_path, monkeypatch):
    """lm-eval itself, on the task file `lm-eval-tasks --lambada` writes, gives the same acc and
    perplexity as `evaluate --lambada` (contexts cut to a window of 16)."""
    import shutil

    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import PreTrainedTokenizerFast

    from megatron_lev.data.lm_eval_tasks import write_lm_eval_tasks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hf = tmp_path / "hf"
    shutil.copytree(tiny_llama, hf)
    tokenizer_file = shared_data / "tokenizers" / "gpt-neox-20b.json"
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|endoftext|>").save_pretrained(hf)
    path = tmp_path / "lambada.txt"
    path.write_text("\n".join(_greedy_passages(model, tok)) + "\n")
    write_lm_eval_tasks(None, tmp_path / "tasks", lambada=path)
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf},max_length=16,dtype=float32",
        tasks=["local_lambada"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        batch_size=2,
        device="cpu",
        bootstrap_iters=0,
    )["results"]["local_lambada"]
    (ours,) = _evaluate(hf, shared_data, tmp_path, "--lambada", path, "--seq-len", 16, tokenizer=hf)[
        "results"
    ]
    assert 0 < ours["acc"] < 1
    assert ours["acc"] == pytest.approx(theirs["acc,none"], abs=1e-12)
    assert ours["perplexity"] == pytest.approx(theirs["perplexity,none"], rel=1e-5)
