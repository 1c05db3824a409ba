"""Text formats of the zero-shot evaluations: LAMBADA passages and Wikitext-103 articles.

Only parsing lives here (no tokenizer, no model), so `evaluate` and the lm-eval task writer read
the same passages and documents.

- LAMBADA (`lambada_openai` layout): JSONL with a string `text` per passage, or plain text with
  one passage per line. The target is the last whitespace-separated word, with one leading
  space; the context is everything before the whitespace that precedes it, as lm-eval's
  `lambada_openai` splits a single-space-separated passage.
- Wikitext-103 raw files: a line ` = Title = ` starts an article, ` = = Section = = ` a
  subsection; numbers and hyphenated words carry the artefacts ` @-@ `, ` @,@ `, ` @.@ `.
  `wikitext_detokenize` undoes those and the spaces around punctuation as lm-eval's
  `wikitext` task does before scoring.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_lev.errors import DataError


@dataclass(frozen=True)
class LambadaPassage:
    """One passage: `context + target` is the passage with its whitespace before the last word
    collapsed to one space; `target` starts with that space."""

    text: str  # the passage as read
    context: str
    target: str
    line: int  # 1-based line of the file

    @property
    def normalised(self) -> str:
        """The text whose split on single spaces (lm-eval's template) gives this context and target."""
        return self.context + self.target if self.context else self.target[1:]

    @property
    def word(self) -> str:
        return self.target[1:]


_LAST_WORD = re.compile(r"(?:^|\s+)(\S+)$")


def split_last_word(text: str) -> tuple[str, str]:
    """(context, " " + last word) of a passage; trailing whitespace is ignored.

    >>> split_last_word("he said hello")
    ('he said', ' hello')
    """
    text = text.rstrip()
    match = _LAST_WORD.search(text)
    if match is None:
        raise ValueError("a passage needs at least one word")
    return text[: match.start()], " " + match.group(1)


def _read_lines(path: Path, what: str) -> list[str]:
    if not path.exists():
        raise DataError(f"{path}: {what} file not found; check the path")
    if not path.is_file():
        raise DataError(f"{path}: {what} file is a directory, expected a file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text; convert the {what} file to UTF-8") from None
    lines = [line + "\n" for line in text.split("\n")]  # only "\n" ends a line, as a file reader's
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def is_jsonl(path: str | Path) -> bool:
    return Path(path).name.endswith(".jsonl")


def read_lambada(path: str | Path, max_passages: int | None = None) -> list[LambadaPassage]:
    """Passages of a LAMBADA file: `.jsonl` with a string `text` per line, else one passage per line.

    Blank lines are skipped. A line that is not a JSON object with a string `text`, a passage
    with no word, a file that is not UTF-8 or holds no passage is a DataError naming the file
    and line.
    """
    path = Path(path)
    jsonl = is_jsonl(path)
    passages: list[LambadaPassage] = []
    for lineno, line in enumerate(_read_lines(path, "LAMBADA"), 1):
        if max_passages is not None and len(passages) >= max_passages:
            break
        if not line.strip():
            continue
        if jsonl:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f'{path}:{lineno}: not a JSON object ({exc.msg}); one {{"text": ...}} object per line'
                ) from None
            if not isinstance(record, dict) or "text" not in record:
                raise DataError(
                    f"{path}:{lineno}: no 'text' field; a LAMBADA .jsonl holds one "
                    '{"text": "passage ... last-word"} object per line'
                )
            text = record["text"]
            if not isinstance(text, str):
                raise DataError(f"{path}:{lineno}: 'text' is a {type(text).__name__}, not a string")
        else:
            text = line
        if not text.strip():
            raise DataError(f"{path}:{lineno}: the passage is empty; every passage needs a last word")
        context, target = split_last_word(text)
        passages.append(LambadaPassage(text, context, target, lineno))
    if not passages:
        raise DataError(
            f"{path}: no passages (empty file); give one passage per line "
            '(.jsonl: {"text": ...} objects, else plain text)'
        )
    return passages


# --------------------------------------------------------------------------------------- Wikitext


@dataclass(frozen=True)
class WikiDocument:
    """One article: its heading line through the line before the next article's heading."""

    title: str | None  # None: text before the first heading
    text: str  # the lines as in the file, newlines kept
    line: int  # 1-based line of its heading (or first line)

    @property
    def words(self) -> int:
        return len(self.text.split())

    @property
    def bytes(self) -> int:
        return len(self.text.encode("utf-8"))


def article_title(line: str) -> str | None:
    """The title of a top-level heading line (` = Title = `), None for any other line.

    Subsection headings (` = = Section = = `, deeper levels alike) are not article starts.
    """
    s = line.strip()
    if len(s) < 5 or not (s.startswith("= ") and s.endswith(" =")):
        return None
    if s.startswith("= =") or s.endswith("= ="):
        return None
    return s[2:-2].strip() or None


def split_wikitext(path: str | Path, max_docs: int | None = None) -> list[WikiDocument]:
    """Articles of a raw Wikitext file, split at top-level headings.

    Text before the first heading is kept as its own document if it holds any words (whitespace
    alone is dropped). A file with no heading at all is not in Wikitext format and is refused,
    as is a file without text.
    """
    path = Path(path)
    lines = _read_lines(path, "Wikitext")
    docs: list[WikiDocument] = []
    start, title = 0, None
    for i, line in enumerate([*lines, None]):
        heading = article_title(line) if line is not None else None
        if line is not None and heading is None:
            continue
        chunk = "".join(lines[start:i])
        if chunk.strip():
            docs.append(WikiDocument(title, chunk, start + 1))
        start, title = i, heading
    if not any(d.text.strip() for d in docs):
        raise DataError(f"{path}: no text to evaluate (empty file); give a raw Wikitext file")
    if all(d.title is None for d in docs):
        raise DataError(
            f"{path}: no article heading (a line ' = Title = '): not in Wikitext format; "
            "evaluate plain text with --text"
        )
    return docs[:max_docs] if max_docs is not None else docs


# lm-eval's `wikitext` detokenisation, in order: (literal or regex, replacement)
_DETOK: list[tuple[str | re.Pattern, str]] = [
    ("s '", "s'"),
    (re.compile(r"/' [0-9]/"), r"/'[0-9]/"),
    (" @-@ ", "-"),
    (" @,@ ", ","),
    (" @.@ ", "."),
    (" : ", ": "),
    (" ; ", "; "),
    (" . ", ". "),
    (" ! ", "! "),
    (" ? ", "? "),
    (" , ", ", "),
    (re.compile(r"\(\s*([^\)]*?)\s*\)"), r"(\1)"),
    (re.compile(r"\[\s*([^\]]*?)\s*\]"), r"[\1]"),
    (re.compile(r"{\s*([^}]*?)\s*}"), r"{\1}"),
    (re.compile(r"\"\s*([^\"]*?)\s*\""), r'"\1"'),
    (re.compile(r"'\s*([^']*?)\s*'"), r"'\1'"),
    ("= = = =", "===="),
    ("= = =", "==="),
    ("= =", "=="),
    (" \u00b0 ", "\u00b0"),
    (" \n", "\n"),
    ("\n ", "\n"),
    (" N ", " 1 "),
    (" 's", "'s"),
]


def wikitext_detokenize(text: str) -> str:
    """Undo Wikitext's tokenisation (` @-@ ` -> `-`, ` , ` -> `, `, `( x )` -> `(x)`, ...)."""
    for pattern, repl in _DETOK:
        text = pattern.sub(repl, text) if isinstance(pattern, re.Pattern) else text.replace(pattern, repl)
    return text
