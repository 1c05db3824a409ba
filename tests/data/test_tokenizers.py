"""The three tokenizer kinds behind one interface, and their Hugging Face export."""

from __future__ import annotations

import base64

import pytest

from megatron_lev.data.tokenizers import TokenizerError, build_tokenizer

TEXT = "The Pile is 825 GiB of text.\n\tIndented line: naïve café, 日本語 and emoji 🙂!"


def _tiktoken_file(path, neox_path):
    """A small byte-level BPE in tiktoken's format: 256 bytes plus merges taken from GPT-NeoX."""
    import json

    vocab = json.load(open(neox_path))["model"]["vocab"]
    # GPT-2 byte-to-unicode map, to turn NeoX pieces back into bytes
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_of = {chr(c): b for b, c in zip(bs, cs)}
    ranks = {bytes([b]): b for b in range(256)}
    for piece, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        raw = bytes(byte_of[ch] for ch in piece) if all(ch in byte_of for ch in piece) else None
        if raw and len(raw) > 1 and raw not in ranks and len(ranks) < 3000:
            # keep only pieces whose halves are already present, as BPE merges require
            if any(raw[:k] in ranks and raw[k:] in ranks for k in range(1, len(raw))):
                ranks[raw] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return str(path)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, pile_jsonl):
    from megatron_lev.data.train_tokenizer import train_sentencepiece

    prefix = tmp_path_factory.mktemp("sp") / "sp"
    info = train_sentencepiece([str(pile_jsonl)], str(prefix), vocab_size=600, max_mb=0.3, num_threads=1)
    assert info["vocab_size"] == 600 and info["eod"] == 1 and info["eod_piece"] == "<|endoftext|>"
    return info["model"]


def test_hf_tokenizer(neox_path):
    tok = build_tokenizer("hf", neox_path)
    assert tok.vocab_size == 50277 and tok.eod == 0 and tok.encode("The") == [510]
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.encode_batch([TEXT, "The"]) == [tok.encode(TEXT), [510]]


def test_sentencepiece_round_trip_and_byte_fallback(sp_model):
    tok = build_tokenizer("sentencepiece", sp_model)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT  # identity normalisation, byte fallback for unseen characters
    assert tok.eod == 1 and tok.vocab_size == 600 and max(ids) < 600 and 0 not in ids  # no <unk>
    assert tok.encode_batch([TEXT, "x"]) == [ids, tok.encode("x")]


def test_tiktoken(tmp_path, neox_path):
    tok = build_tokenizer("tiktoken", _tiktoken_file(tmp_path / "small.tiktoken", neox_path))
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and tok.eod == tok.vocab_size - 1 and max(ids) < tok.eod
    assert len(ids) < len(TEXT.encode())  # merges were applied
    assert tok.encode_batch([TEXT]) == [ids]


@pytest.mark.parametrize("kind", ["hf", "tiktoken", "sentencepiece"])
def test_hf_export_loads_with_transformers(kind, tmp_path, neox_path, request):
    from transformers import AutoTokenizer

    path = {"hf": neox_path, "sentencepiece": request.getfixturevalue("sp_model")}.get(
        kind
    ) or _tiktoken_file(tmp_path / "small.tiktoken", neox_path)
    tok = build_tokenizer(kind, path)
    files = tok.save_for_hf(tmp_path / "export")
    assert all(f.exists() for f in files)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    for text in (TEXT, "  leading spaces", "Hello world"):
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token_id == tok.eod


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        build_tokenizer("hf", tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match="bad.json"):
        build_tokenizer("hf", tmp_path / "bad.json")
    with pytest.raises(TokenizerError, match="not one of"):
        build_tokenizer("bpe", tmp_path / "bad.json")


def test_a_tokenizer_file_with_truncation_or_padding_encodes_whole_documents(tmp_path, neox_path):
    """Many Hub `tokenizer.json` files carry truncation (and padding) for inference. Before, such a
    file counted as the same tokenizer (the identity digest leaves those settings out) while every
    document `preprocess` encoded was cut to its max_length, with exit status 0. The project switches
    both off where it encodes: the ids are the plain file's, and it is the same tokenizer."""
    import json

    from megatron_lev.data.tokenizers import tokenizer_fingerprint

    spec = json.loads(open(neox_path).read())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {
        "strategy": {"Fixed": 64},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 1,
        "pad_type_id": 0,
        "pad_token": "<|padding|>",
    }
    cut = tmp_path / "tokenizer.json"
    cut.write_text(json.dumps(spec))
    text = "The quick brown fox jumps over the lazy dog. " * 20
    plain, hub = build_tokenizer("hf", neox_path), build_tokenizer("hf", cut)
    ids = plain.encode(text)
    assert len(ids) > 64
    assert hub.encode(text) == ids and hub.encode_batch([text, "a b"]) == plain.encode_batch([text, "a b"])
    theirs, ours = tokenizer_fingerprint("hf", cut, hub), tokenizer_fingerprint("hf", neox_path, plain)
    assert (
        theirs["content_sha256"] == ours["content_sha256"] and theirs["probe_sha256"] == ours["probe_sha256"]
    )
