"""One tokenizer interface over Hugging Face `tokenizers`, SentencePiece and tiktoken files.

`build_tokenizer(type, path)` returns a `Tokenizer` with `vocab_size`, `eod`,
`encode`, `encode_batch`, `decode`, `name` and `save_for_hf(directory)`, which
writes the files a Hugging Face export needs so `AutoTokenizer` can load them.
No special tokens are added by `encode`: preprocessing appends `eod` explicitly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from abc import ABC, abstractmethod
from array import array
from pathlib import Path

from megatron_lev.errors import DataError

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<eod>")
# tiktoken files carry only the ranks; these are the pattern and special token we use with them
# (the cl100k_base split pattern in its classic form, which HF `tokenizers` also accepts, and one
# special token `<|endoftext|>` right after the last rank).
TIKTOKEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
TIKTOKEN_EOD = "<|endoftext|>"
# Vocabulary sizes by name, as `build_tokenizer` reports them (for sizing without the file): the
# GPT-NeoX-20B tokenizer.json; a tiktoken file's ranks plus the one `<|endoftext|>` added above
# (cl100k_base: 100,256 ranks; o200k_base: 199,998). The encodings' own special tokens reach
# 100,277 and 200,019, which pad to the same sizes at TP 1 to 8 (100,352 and 200,064 at TP 1).
KNOWN_VOCABULARIES = {"neox": 50277, "cl100k_base": 100257, "o200k_base": 199999}


# A document longer than this many characters is encoded in pieces where the tokenizer allows it
# (`Tokenizer.encode_long`), so a huge one-line document costs memory for a piece, not for all of it.
PIECE_CHARS = 1 << 20


class TokenizerError(DataError):
    """The tokenizer file is missing or unusable; the message names it."""


def cut_points(text: str, piece_chars: int) -> list[int]:
    """Where to cut `text` into pieces of about `piece_chars` characters: each cut lies just before a
    single space between two non-space characters, at or after the size reached. A stretch without
    such a space is not cut (the piece grows until one comes)."""
    cuts, pos, n = [], piece_chars, len(text)
    while pos < n - 1:
        i = text.find(" ", pos)
        while i != -1 and i < n - 1 and (text[i - 1].isspace() or text[i + 1].isspace()):
            i = text.find(" ", i + 1)
        if i == -1 or i >= n - 1:
            break
        cuts.append(i)
        pos = i + piece_chars
    return cuts


class Tokenizer(ABC):
    """What preprocessing, training and export need from a tokenizer."""

    name: str
    vocab_size: int  # every id the tokenizer can produce is < vocab_size (special tokens included)
    eod: int  # end-of-document id appended after each document
    # Cutting a text just before a single space between two non-space characters gives the same ids
    # as the whole text: true of regex pre-tokenizers (GPT-2/NeoX byte-level BPE, tiktoken patterns),
    # where no token crosses such a point; not of SentencePiece, which marks a leading space.
    cuts_at_spaces: bool = False

    def encode_long(self, text: str, piece_chars: int = PIECE_CHARS) -> list[int] | array:
        """`encode(text)`; a text longer than `piece_chars` is encoded piece by piece (`cut_points`)
        when `cuts_at_spaces`, into the same ids (an `array('q')`, 8 bytes per id) with memory for
        one piece instead of the tokenizer's per-token bookkeeping for the whole text."""
        if not self.cuts_at_spaces or len(text) <= piece_chars:
            return self.encode(text)
        ids = array("q")
        start = 0
        for cut in [*cut_points(text, piece_chars), len(text)]:
            ids.extend(self.encode(text[start:cut]))
            start = cut
        return ids

    @abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids) -> str: ...

    @abstractmethod
    def save_for_hf(self, directory: str | os.PathLike) -> list[Path]:
        """Write the tokenizer files of an HF export into `directory`; returns the paths."""


def _write_json(path: Path, obj) -> Path:
    from megatron_lev.utils.io import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
    return path


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` (Hugging Face `tokenizers`); EOD is the first of EOD_CANDIDATES it knows."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as _Tok

        self.path = Path(path)
        try:
            self._tok = _Tok.from_file(str(self.path))
        except Exception as exc:
            raise TokenizerError(f"{self.path}: not a Hugging Face tokenizer.json ({exc})") from None
        # a Hub file may carry truncation or padding for inference pipelines; the project encodes whole
        # documents, so both are off here (the identity digest leaves them out: they change no id here)
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = f"hf:{self.path.name}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_token = next((t for t in EOD_CANDIDATES if self._tok.token_to_id(t) is not None), None)
        if self.eod_token is None:
            raise TokenizerError(
                f"{self.path}: no end-of-document token (looked for {', '.join(EOD_CANDIDATES)})"
            )
        self.eod = self._tok.token_to_id(self.eod_token)
        self._batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        self.cuts_at_spaces = _hf_cuts_at_spaces(self.path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save_for_hf(self, directory):
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, out / "tokenizer.json")
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eod_token,
            "bos_token": self.eod_token,
            "unk_token": self.eod_token,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": 1_000_000_000,
        }
        return [out / "tokenizer.json", _write_json(out / "tokenizer_config.json", cfg)]


_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}


def _hf_cuts_at_spaces(path: Path) -> bool:
    """Whether a tokenizer.json encodes pieces cut before a single space like the whole text: a BPE
    model behind a byte-level pre-tokenizer that adds no prefix space (its GPT-2 regex, or a Split
    on TIKTOKEN_PATTERN first), a per-character normalizer, and no added token holding a space among
    other characters."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if (spec.get("model") or {}).get("type") != "BPE":
        return False
    norm = spec.get("normalizer")
    norms = (norm or {}).get("normalizers", [norm]) if norm else []
    if not all(isinstance(n, dict) and n.get("type") in _LOCAL_NORMALIZERS for n in norms):
        return False
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]

    def byte_level(step: dict, regex: bool) -> bool:
        return (
            step.get("type") == "ByteLevel"
            and step.get("add_prefix_space") is False
            and step.get("use_regex", True) is regex
        )

    if len(steps) == 1:
        ok = byte_level(steps[0], True)
    else:
        split = steps[0]
        ok = (
            len(steps) == 2
            and split.get("type") == "Split"
            and (split.get("pattern") or {}).get("Regex") == TIKTOKEN_PATTERN
            and split.get("behavior") == "Isolated"
            and byte_level(steps[1], False)
        )
    added = [t.get("content", "") for t in spec.get("added_tokens") or []]
    return ok and not any(" " in t and t.strip(" ") for t in added)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`; EOD is its `eos_id` (the `train-tokenizer` models use `<|endoftext|>`)."""

    def __init__(self, path: str | os.PathLike):
        import sentencepiece as spm

        self.path = Path(path)
        if not self.path.is_file():
            raise TokenizerError(f"{self.path}: SentencePiece model not found")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except Exception as exc:
            raise TokenizerError(f"{self.path}: not a SentencePiece model ({exc})") from None
        self.name = f"sentencepiece:{self.path.name}"
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            ids = [self._sp.piece_to_id(t) for t in EOD_CANDIDATES]
            found = [i for t, i in zip(EOD_CANDIDATES, ids) if self._sp.id_to_piece(i) == t]
            if not found:
                raise TokenizerError(f"{self.path}: no eos id and no end-of-document piece")
            self.eod = found[0]

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def save_for_hf(self, directory):
        """`tokenizer.model` plus a config for transformers' LlamaTokenizer (no BOS/EOS added)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, out / "tokenizer.model")
        eos = self._sp.id_to_piece(self.eod)
        cfg = {
            "tokenizer_class": "LlamaTokenizer",
            "eos_token": eos,
            "bos_token": None,
            "unk_token": self._sp.id_to_piece(self._sp.unk_id()),
            "add_bos_token": False,
            "add_eos_token": False,
            "legacy": False,
            "add_prefix_space": False,
            "model_max_length": 1_000_000_000,
        }
        return [out / "tokenizer.model", _write_json(out / "tokenizer_config.json", cfg)]


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (`base64-token rank` lines) with TIKTOKEN_PATTERN and `<|endoftext|>` last."""

    def __init__(self, path: str | os.PathLike):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path = Path(path)
        if not self.path.is_file():
            raise TokenizerError(f"{self.path}: tiktoken BPE file not found")
        try:
            ranks = load_tiktoken_bpe(str(self.path))
        except Exception as exc:
            raise TokenizerError(f"{self.path}: not a tiktoken BPE file ({exc})") from None
        self.eod = max(ranks.values()) + 1
        self._enc = tiktoken.Encoding(
            name=self.path.stem,
            pat_str=TIKTOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={TIKTOKEN_EOD: self.eod},
        )
        self.name = f"tiktoken:{self.path.name}"
        self.vocab_size = self.eod + 1
        self.cuts_at_spaces = True  # TIKTOKEN_PATTERN is a regex pre-tokenizer; no special tokens

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def save_for_hf(self, directory):
        """A `tokenizer.json` converted with transformers' TikTokenConverter (needs transformers)."""
        from transformers.convert_slow_tokenizer import TikTokenConverter

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tok = TikTokenConverter(
            vocab_file=str(self.path), pattern=TIKTOKEN_PATTERN, extra_special_tokens=[TIKTOKEN_EOD]
        ).converted()
        tmp = out / f".tokenizer.json.tmp.{os.getpid()}"
        tok.save(str(tmp))
        os.replace(tmp, out / "tokenizer.json")
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": TIKTOKEN_EOD,
            "bos_token": TIKTOKEN_EOD,
            "unk_token": TIKTOKEN_EOD,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": 1_000_000_000,
        }
        return [out / "tokenizer.json", _write_json(out / "tokenizer_config.json", cfg)]


_TYPES = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer}


def build_tokenizer(tokenizer_type: str, path: str | os.PathLike) -> Tokenizer:
    """`hf` (tokenizer.json), `sentencepiece` (.model) or `tiktoken` (BPE ranks file)."""
    if tokenizer_type not in _TYPES:
        raise TokenizerError(f"tokenizer type {tokenizer_type!r} is not one of {', '.join(_TYPES)}")
    if path is None or not Path(path).is_file():
        raise TokenizerError(f"tokenizer file not found: {path} (type {tokenizer_type})")
    return _TYPES[tokenizer_type](path)


# Two tokenizer files that agree on the vocabulary size, the EOD id and the ids of this text are
# taken as the same tokenizer where only ids matter (a tiktoken file and the tokenizer.json an
# export converts it to; one tokenizer.json saved by two programs). It covers ASCII words,
# contractions and punctuation, digits and numbers, runs of spaces, tabs and newlines, accented
# Latin, Greek, Cyrillic, CJK, Arabic and emoji. Recorded digests depend on it: never edit it
# (a changed text needs a new fingerprint key).
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. It's 9:41, isn't it? (Yes!) a-b_c/d@e.com #tag\n"
    "0 1 12 123 1234 12345 3.14159 -42 1,000,000 2024-01-31 0x1F 1e-5 007\n"
    "  two spaces,   three,\ttab,\t\ttwo tabs, trailing   \n\n\nthree newlines\r\nCRLF \u00a0nbsp\n"
    "na\u00efve caf\u00e9 Stra\u00dfe \u00c5ngstr\u00f6m \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac "
    "\u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u65e5\u672c\u8a9e\u306e\u6587\u7ae0 "
    "\u4e2d\u6587 \ud55c\uad6d\uc5b4 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 "
    "\U0001f642\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \u2014 \u2026 \u20ac5"
)


def probe_digest(tokenizer: Tokenizer) -> str:
    """sha256 of the ids `tokenizer` gives PROBE_TEXT."""
    ids = tokenizer.encode(PROBE_TEXT)
    return hashlib.sha256(" ".join(str(int(i)) for i in ids).encode()).hexdigest()


# the parts of a tokenizer.json that decide its encoding; the rest (formatting, key order, `version`,
# `truncation`, `padding`, the decoder) may differ between two saves of the same tokenizer
_HF_CONTENT = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor")


def _merge_pair(merge):
    """A BPE merge as a pair: `"a b"` (older tokenizers files) and `["a", "b"]` (newer) alike."""
    if isinstance(merge, str):
        left, _, right = merge.partition(" ")
        return [left, right]
    return list(merge)


def content_digest(tokenizer_type: str, path: str | os.PathLike, tokenizer: Tokenizer | None = None) -> str:
    """sha256 of what a tokenizer is, not of its file's bytes: for a `tokenizer.json` its model
    (vocabulary, merges), added and special tokens, normaliser, pre-tokenizer and post-processor,
    dumped canonically (sorted keys, merges as pairs), so the same tokenizer loaded and saved again
    has the same digest (read through the `tokenizers` library, which writes out the defaults an
    older file leaves implicit); for SentencePiece every piece with its score and kind; for tiktoken its
    ranks. Together with the vocabulary size and EOD id this decides whether two files are one
    tokenizer (`fingerprint_mismatch`)."""
    if tokenizer_type == "hf":
        from tokenizers import Tokenizer as HFFile  # its own serialisation: defaults written out alike

        data = json.loads(HFFile.from_file(str(path)).to_str())
        parts = {k: data.get(k) for k in _HF_CONTENT}
        model = dict(parts.get("model") or {})
        if isinstance(model.get("merges"), list):
            model["merges"] = [_merge_pair(m) for m in model["merges"]]
        parts["model"] = model
        text = json.dumps(parts, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
    tok = tokenizer if tokenizer is not None else build_tokenizer(tokenizer_type, path)
    if tokenizer_type == "sentencepiece":
        sp = tok._sp
        rows = [
            [
                sp.id_to_piece(i),
                round(float(sp.get_score(i)), 6),
                sp.is_control(i),
                sp.is_unknown(i),
                sp.is_byte(i),
            ]
            for i in range(sp.get_piece_size())
        ]
        text = json.dumps(rows, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()
    from megatron_lev.utils.io import sha256_file  # tiktoken: the ranks file is the content

    return sha256_file(path)


def tokenizer_fingerprint(
    tokenizer_type: str, path: str | os.PathLike, tokenizer: Tokenizer | None = None
) -> dict:
    """What identifies a tokenizer across preprocessing, training and export: type, name,
    file name, sha256 of the file, vocabulary size, EOD id, `probe_sha256` (`probe_digest`) and
    `content_sha256` (`content_digest`: the same for the same tokenizer saved again)."""
    from megatron_lev.utils.io import sha256_file

    tok = tokenizer if tokenizer is not None else build_tokenizer(tokenizer_type, path)
    return {
        "type": tokenizer_type,
        "name": tok.name,
        "file": Path(path).name,
        "sha256": sha256_file(path),
        "vocab_size": int(tok.vocab_size),
        "eod": int(tok.eod),
        "probe_sha256": probe_digest(tok),
        "content_sha256": content_digest(tokenizer_type, path, tok),
    }


def encoding_mismatch(expected: dict, actual: dict) -> str | None:
    """None when two fingerprints tokenize alike (the same file, or the same vocabulary size, EOD
    id and ids of PROBE_TEXT), else what differs (one phrase)."""
    if expected.get("sha256") and expected.get("sha256") == actual.get("sha256"):
        return None
    for key in ("vocab_size", "eod"):
        if key in expected and key in actual and expected[key] != actual[key]:
            return f"{key} {actual[key]!r} != {expected[key]!r}"
    if not expected.get("probe_sha256") or not actual.get("probe_sha256"):
        return "another file (sha256 differs) and no record of how it encodes the probe text"
    if expected["probe_sha256"] != actual["probe_sha256"]:
        return "it encodes the probe text (ASCII, digits, whitespace, unicode) into other ids"
    return None


def fingerprint_mismatch(expected: dict, actual: dict) -> str | None:
    """None when two fingerprints name the same tokenizer, else what differs (one phrase). The same
    tokenizer is the same content (`content_sha256`: vocabulary, merges or model, special tokens,
    normaliser), whatever the bytes of its file; a record without a content digest (written by an
    older version) is compared by the file's sha256."""
    content = "content_sha256" in expected and "content_sha256" in actual
    for key in ("content_sha256" if content else "sha256", "vocab_size", "eod", "type"):
        if key in expected and key in actual and expected[key] != actual[key]:
            return (
                f"{key} {actual[key]!r} != {expected[key]!r} "
                f"(recorded: {expected.get('file', expected.get('name'))}, "
                f"given: {actual.get('file', actual.get('name'))})"
            )
    return None
