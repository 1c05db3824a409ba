"""One tokenizer interface over Hugging Face `tokenizers`, SentencePiece and tiktoken files.

`build_tokenizer(type, path)` returns a `Tokenizer` with `vocab_size`, `eod`,
`encode`, `encode_batch`, `decode`, `name` and `save_for_hf(directory)`, which
writes the files a Hugging Face export needs so `AutoTokenizer` can load them.
No special tokens are added by `encode`: preprocessing appends `eod` explicitly.
"""

from __future__ import annotations

import json
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path

from megatron_lev.errors import DataError

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<eod>")
# tiktoken files carry only the ranks; these are the pattern and special token we use with them
# (the cl100k_base split pattern in its classic form, which HF `tokenizers` also accepts, and one
# special token `<|endoftext|>` right after the last rank).
TIKTOKEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
TIKTOKEN_EOD = "<|endoftext|>"


class TokenizerError(DataError):
    """The tokenizer file is missing or unusable; the message names it."""


class Tokenizer(ABC):
    """What preprocessing, training and export need from a tokenizer."""

    name: str
    vocab_size: int  # every id the tokenizer can produce is < vocab_size (special tokens included)
    eod: int  # end-of-document id appended after each document

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
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
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
        self.name = f"hf:{self.path.name}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_token = next((t for t in EOD_CANDIDATES if self._tok.token_to_id(t) is not None), None)
        if self.eod_token is None:
            raise TokenizerError(f"{self.path}: no end-of-document token (looked for {', '.join(EOD_CANDIDATES)})")
        self.eod = self._tok.token_to_id(self.eod_token)
        self._batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

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
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self.eod_token,
               "bos_token": self.eod_token, "unk_token": self.eod_token, "add_bos_token": False,
               "add_eos_token": False, "model_max_length": 1_000_000_000}
        return [out / "tokenizer.json", _write_json(out / "tokenizer_config.json", cfg)]


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
        cfg = {"tokenizer_class": "LlamaTokenizer", "eos_token": eos, "bos_token": None,
               "unk_token": self._sp.id_to_piece(self._sp.unk_id()), "add_bos_token": False,
               "add_eos_token": False, "legacy": False, "add_prefix_space": False,
               "model_max_length": 1_000_000_000}
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
        self._enc = tiktoken.Encoding(name=self.path.stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                                      special_tokens={TIKTOKEN_EOD: self.eod})
        self.name = f"tiktoken:{self.path.name}"
        self.vocab_size = self.eod + 1

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
        tok = TikTokenConverter(vocab_file=str(self.path), pattern=TIKTOKEN_PATTERN,
                                extra_special_tokens=[TIKTOKEN_EOD]).converted()
        tmp = out / f".tokenizer.json.tmp.{os.getpid()}"
        tok.save(str(tmp))
        os.replace(tmp, out / "tokenizer.json")
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": TIKTOKEN_EOD, "bos_token": TIKTOKEN_EOD,
               "unk_token": TIKTOKEN_EOD, "add_bos_token": False, "add_eos_token": False,
               "model_max_length": 1_000_000_000}
        return [out / "tokenizer.json", _write_json(out / "tokenizer_config.json", cfg)]


_TYPES = {"hf": HFTokenizer, "sentencepiece": SentencePieceTokenizer, "tiktoken": TiktokenTokenizer}


def build_tokenizer(tokenizer_type: str, path: str | os.PathLike) -> Tokenizer:
    """`hf` (tokenizer.json), `sentencepiece` (.model) or `tiktoken` (BPE ranks file)."""
    if tokenizer_type not in _TYPES:
        raise TokenizerError(f"tokenizer type {tokenizer_type!r} is not one of {', '.join(_TYPES)}")
    if path is None or not Path(path).is_file():
        raise TokenizerError(f"tokenizer file not found: {path} (type {tokenizer_type})")
    return _TYPES[tokenizer_type](path)


def tokenizer_fingerprint(tokenizer_type: str, path: str | os.PathLike, tokenizer: Tokenizer | None = None) -> dict:
    """What identifies a tokenizer across preprocessing, training and export: type, name,
    file name, sha256 of the file, vocabulary size and EOD id."""
    from megatron_lev.utils.io import sha256_file

    tok = tokenizer if tokenizer is not None else build_tokenizer(tokenizer_type, path)
    return {"type": tokenizer_type, "name": tok.name, "file": Path(path).name, "sha256": sha256_file(path),
            "vocab_size": int(tok.vocab_size), "eod": int(tok.eod)}


def fingerprint_mismatch(expected: dict, actual: dict) -> str | None:
    """None when two fingerprints name the same tokenizer, else what differs (one phrase)."""
    for key in ("sha256", "vocab_size", "eod", "type"):
        if key in expected and key in actual and expected[key] != actual[key]:
            return (f"{key} {actual[key]!r} != {expected[key]!r} "
                    f"(recorded: {expected.get('file', expected.get('name'))}, given: {actual.get('file', actual.get('name'))})")
    return None
