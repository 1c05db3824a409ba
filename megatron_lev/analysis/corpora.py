"""Token batches for evaluation: held-out MMIDIDX shards and text / Pile-format jsonl(.zst) corpora."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_lev.errors import DataError


def sequence_batches(
    documents: Iterable[np.ndarray], seq_len: int, batch_size: int
) -> Iterator[torch.Tensor]:
    """Concatenate documents and cut windows of S+1 tokens with stride S (B, S+1).

    Consecutive windows share one token, so every token but the first is predicted once; the
    final partial window comes alone as a (1, L) batch.
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    buf = np.zeros(0, dtype=np.int64)
    rows: list[np.ndarray] = []
    for doc in documents:
        buf = np.concatenate([buf, np.asarray(doc, dtype=np.int64)])
        while len(buf) >= seq_len + 1:
            rows.append(buf[: seq_len + 1])
            buf = buf[seq_len:]
            if len(rows) == batch_size:
                yield torch.from_numpy(np.stack(rows))
                rows = []
    if rows:
        yield torch.from_numpy(np.stack(rows))
    if len(buf) >= 2:
        yield torch.from_numpy(buf[None, :])


def indexed_documents(
    prefix: str | Path, max_docs: int | None = None, split: tuple[str, str] | None = None
) -> Iterator[np.ndarray]:
    """Documents of a Megatron MMIDIDX shard `<prefix>.bin/.idx`, in order.

    `split=("valid", "969,30,1")` keeps only the documents the trainer's `data.split` assigns
    to that part (the same contiguous ranges as `megatron_lev.data.indices.split_documents`).
    """
    from megatron_lev.data.indexed import IndexedDataset
    from megatron_lev.data.indices import split_documents

    ds = IndexedDataset(str(prefix))
    start, end = 0, len(ds)
    if split is not None:
        part, spec = split
        names = ("train", "valid", "test")
        if part not in names:
            raise DataError(f"split {part!r} must be one of {', '.join(names)}")
        start, end = split_documents(len(ds), spec)[names.index(part)]
        if end <= start:
            raise DataError(f"{prefix}: split {part!r} of {spec!r} holds no documents (of {len(ds)})")
    if max_docs is not None:
        end = min(end, start + max_docs)
    for i in range(start, end):
        yield np.asarray(ds[i])


def text_documents(path: str | Path) -> Iterator[str]:
    """Texts of a `.jsonl` / `.jsonl.zst` corpus (the "text" field) or a plain-text file (one document).

    A file that is not UTF-8, a line that is not a JSON object with a string "text", or a damaged
    `.zst` is a DataError naming the file (and line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: corpus file not found")
    name = path.name
    if not (name.endswith(".jsonl") or name.endswith(".jsonl.zst")):
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{path}: not UTF-8 text (byte {exc.start}); convert it to UTF-8 or pass a .jsonl corpus"
            ) from None
        return
    lineno = 0
    try:
        if name.endswith(".zst"):
            import zstandard

            raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
            lines = io.TextIOWrapper(raw, encoding="utf-8")
        else:
            lines = open(path, encoding="utf-8")
        with lines:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DataError(
                        f"{path}:{lineno}: not a JSON object with a 'text' field ({exc}); one "
                        '{"text": ...} object per line'
                    ) from None
                if not isinstance(text, str):
                    raise DataError(f"{path}:{lineno}: 'text' is a {type(text).__name__}, not a string")
                yield text
    except UnicodeDecodeError:
        raise DataError(f"{path}:{lineno + 1}: not UTF-8 text; convert the corpus to UTF-8") from None
    except DataError:
        raise
    except Exception as exc:  # zstandard.ZstdError and friends: a damaged compressed file
        if type(exc).__module__.startswith("zstandard"):
            raise DataError(
                f"{path}: damaged zstd stream after line {lineno} ({exc}); recompress the corpus"
            ) from None
        raise


@dataclass
class TextTokenizer:
    """The minimum evaluation needs from a tokenizer: text -> ids, and the end-of-document id."""

    name: str
    encode: Callable[[str], list[int]]
    eos_id: int | None
    vocab_size: int | None = None  # ids the tokenizer can produce (None: unknown)
    file: Path | None = None  # its tokenizer.json, to compare with a model's


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """A `tokenizer.json` file (Hugging Face tokenizers) or a directory AutoTokenizer understands."""
    path = Path(path)
    if path.is_file() and path.suffix == ".json":
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises its own exception type
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({str(exc)[:200]})") from None
        eos = next(
            (
                tok.token_to_id(t)
                for t in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
                if tok.token_to_id(t) is not None
            ),
            None,
        )
        return TextTokenizer(
            path.name, lambda s: tok.encode(s, add_special_tokens=False).ids, eos, tok.get_vocab_size(), path
        )
    if not path.exists():
        raise FileNotFoundError(f"{path}: tokenizer not found (a tokenizer.json or a model directory)")
    if path.is_file():
        raise DataError(f"{path}: not a tokenizer (a tokenizer.json file or a model directory)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(
            f"{path}: no tokenizer in this directory ({str(exc).strip()[:200]}); pass --tokenizer "
            "with a tokenizer.json"
        ) from None
    file = path / "tokenizer.json"
    return TextTokenizer(
        path.name,
        lambda s: tok.encode(s, add_special_tokens=False),
        tok.eos_token_id,
        len(tok),
        file if file.is_file() else None,
    )


class TokenizedCorpus:
    """Documents of text corpora as token arrays (EOS after each), counting the UTF-8 bytes read."""

    def __init__(self, paths: list[str | Path], tokenizer: TextTokenizer, max_docs: int | None = None):
        self.paths, self.tokenizer, self.max_docs = [Path(p) for p in paths], tokenizer, max_docs
        self.n_bytes = 0
        self.n_docs = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        for path in self.paths:
            for text in text_documents(path):
                if self.max_docs is not None and self.n_docs >= self.max_docs:
                    return
                ids = self.tokenizer.encode(text)
                if self.tokenizer.eos_id is not None:
                    ids = [*ids, self.tokenizer.eos_id]
                self.n_bytes += len(text.encode("utf-8"))
                self.n_docs += 1
                yield np.asarray(ids, dtype=np.int64)
