"""Train a SentencePiece BPE tokenizer (byte fallback) on Pile-format input.

Pieces: id 0 `<unk>`, id 1 `<|endoftext|>` (the EOD appended after every document;
it is the model's `eos_id`), no BOS/PAD. Text is kept as is (identity normalisation,
no dummy prefix, whitespace preserved), so `decode(encode(text)) == text`, and any
byte outside the learned pieces falls back to `<0xNN>` pieces instead of `<unk>`.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from megatron_lev.data.readers import Problem, check_text, find_inputs, iter_chunks, parse_line
from megatron_lev.errors import DataError

EOD_PIECE = "<|endoftext|>"
MIN_VOCAB = 260  # the smallest vocabulary to train: 256 byte pieces + <unk> + <|endoftext|> + merges


def iter_training_lines(inputs: list[str], max_mb: float, json_key: str = "text") -> Iterator[str]:
    """Non-empty lines of the documents, in input order, up to `max_mb` of text."""
    budget, used = int(max_mb * 1e6), 0
    problems: list[Problem] = []
    for chunk in iter_chunks(input_files(inputs), problems, text_key=json_key):
        for item in chunk.lines:
            text = item[0] if chunk.records else parse_line(item, json_key)[0]
            if text is None or check_text(text):
                continue
            for line in text.split("\n"):
                if line.strip():
                    yield line
                    used += len(line)
                    if used >= budget:
                        return


def input_files(inputs: list[str]) -> list[str]:
    """The files behind `--input`; a missing or unsupported input is one line naming it."""
    try:
        return find_inputs(inputs)
    except (FileNotFoundError, ValueError) as exc:
        raise DataError(f"--input: {exc}") from None


def train_sentencepiece(
    inputs: list[str],
    model_prefix: str,
    vocab_size: int = 8000,
    max_mb: float = 50.0,
    json_key: str = "text",
    num_threads: int | None = None,
) -> dict:
    """Train and write `<model_prefix>.model/.vocab` (atomically); returns a summary.

    Input without any text, or a vocabulary the text cannot fill, is refused before anything is written.
    """
    import sentencepiece as spm

    if next(iter_training_lines(inputs, max_mb, json_key), None) is None:
        raise DataError(
            f"--input {' '.join(inputs)}: no text to train on (Pile-format JSON lines with a "
            f"'{json_key}' field expected; see --json-key)"
        )
    out = Path(model_prefix)
    created = not out.parent.exists()
    tmp_prefix = out.parent / f".{out.name}.tmp.{os.getpid()}"
    try:  # before the training, which takes a while: can the output be written at all?
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{tmp_prefix}.probe", "wb"):
            pass
        os.unlink(f"{tmp_prefix}.probe")
    except OSError as exc:
        raise DataError(
            f"--model-prefix {model_prefix}: cannot write in {out.parent} ({exc.strerror or exc}); "
            "choose a writable directory"
        ) from None
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter_training_lines(inputs, max_mb, json_key),
            model_prefix=str(tmp_prefix),
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9995,
            unk_id=0,
            eos_id=1,
            bos_id=-1,
            pad_id=-1,
            eos_piece=EOD_PIECE,
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            max_sentence_length=1 << 16,
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,
        )
        for ext in (".vocab", ".model"):  # the model last: its presence means a complete pair
            os.replace(f"{tmp_prefix}{ext}", f"{out}{ext}")
    except BaseException as exc:
        with contextlib.suppress(OSError):  # a failed clean-up must not hide the error that stopped us
            for ext in (".vocab", ".model"):
                Path(f"{tmp_prefix}{ext}").unlink(missing_ok=True)
            if created and not any(out.parent.iterdir()):
                out.parent.rmdir()
        if isinstance(exc, RuntimeError):
            raise _training_error(exc, vocab_size, out) from None
        if isinstance(exc, OSError) and not isinstance(exc, DataError):
            raise DataError(
                f"--model-prefix {model_prefix}: writing {exc.filename or out} failed "
                f"({exc.strerror or exc}); choose a writable directory with free space"
            ) from None
        raise
    sp = spm.SentencePieceProcessor(model_file=f"{out}.model")
    return {
        "model": f"{out}.model",
        "vocab": f"{out}.vocab",
        "vocab_size": sp.get_piece_size(),
        "eod": sp.eos_id(),
        "eod_piece": EOD_PIECE,
    }


def _training_error(exc: RuntimeError, vocab_size: int, out: Path | None = None) -> DataError:
    """SentencePiece's error as one line that says which flag to change."""
    text = " ".join(str(exc).split())
    if re.search(r"PERMISSION_DENIED|Permission denied|Read-only file system|No space left", text):
        return DataError(
            f"--model-prefix {out}: SentencePiece cannot write its model ({text}); choose a writable "
            "directory with free space"
        )
    m = re.search(r"Vocabulary size (?:is )?too high \((\d+)\)\. Please set it to a value <= (\d+)", text)
    if m:
        return DataError(
            f"--vocab-size {vocab_size} is more than this text supports (at most {m.group(2)}): "
            "lower --vocab-size, or give more text (--input, --max-mb)"
        )
    return DataError(f"SentencePiece could not train on this input: {text}")
