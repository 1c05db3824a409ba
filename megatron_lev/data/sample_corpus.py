"""Build a small Pile-format corpus from what a fresh machine already has.

Subsets (`meta.pile_set_name`): `Github` (the Python standard library sources, tests
excluded), `Python_docs` (pydoc topics and the stdlib docstrings), and, when present,
`Licenses` (/usr/share/common-licenses), `Man_pages` (/usr/share/man, troff stripped)
and `Dictionaries` (/usr/share/dict word lists). Missing sources are skipped and
listed in the manifest. Output: one `<subset>.jsonl.zst` per subset plus `manifest.json`;
the same machine and `--max-mb` give the same bytes.
"""

from __future__ import annotations

import ast
import gzip
import json
import math
import os
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from megatron_lev.errors import DataError, UserError
from megatron_lev.utils.io import atomic_open, atomic_write_json

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
MIN_CHARS = 50


def _stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted, without tests and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS]
        found.extend(Path(directory) / f for f in files if f.endswith(".py"))
    return sorted(found)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def github_docs() -> Iterator[str]:
    for path in _stdlib_files():
        if (text := _read(path)) is not None:
            yield text


def python_docs() -> Iterator[str]:
    """pydoc topics, then one document per stdlib module of its docstrings."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    for name in sorted(topics):
        yield topics[name]
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files():
        text = _read(path)
        try:
            tree = ast.parse(text or "")
        except (SyntaxError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        parts = []
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    title = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                    parts.append(f"{title}\n\n{doc}")
        if parts:
            yield "\n\n".join(dict.fromkeys(parts))


def license_docs(root: str = "/usr/share/common-licenses") -> Iterator[str]:
    for path in sorted(Path(root).glob("*")) if Path(root).is_dir() else []:
        if path.is_file() and (text := _read(path)):
            yield text


_TROFF_ESCAPES = re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)|\\s[-+]?\d|\\[&|^%]|\\\*(?:\(..|.)")


_NON_TEXT_MACROS = {
    "de",
    "ds",
    "nr",
    "ig",
    "if",
    "ie",
    "el",
    "IX",
    "tr",
    "rm",
    "nh",
    "ad",
    "na",
    "ta",
    "ft",
    "ne",
    "PD",
    "so",
    "ll",
    "in",
    "ti",
    "sp",
    "br",
    "fi",
    "nf",
    "hy",
    "ps",
    "vs",
    "mso",
}


def _strip_troff(src: str) -> str:
    """Plain text of a man page: from `.TH` on, macro names and font escapes dropped."""
    start = src.find("\n.TH ")
    src = src[start + 1 :] if start >= 0 else src
    out = []
    for line in src.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.."')):
            continue
        if line.startswith((".", "'")):
            words = line[1:].split(None, 1)
            if words and words[0] in _NON_TEXT_MACROS and words[0] != "TH":
                continue
            line = words[1] if len(words) > 1 and words[0] not in _NON_TEXT_MACROS else ""
            line = line.replace('"', "")
        line = _TROFF_ESCAPES.sub("", line).replace("\\-", "-").replace("\\(em", "--").replace("\\e", "\\")
        line = line.replace("\\(aq", "'").replace("\\(dq", '"').replace("\\ ", " ")
        if line.strip() or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def man_docs(root: str = "/usr/share/man") -> Iterator[str]:
    base = Path(root)
    for path in sorted(base.glob("man[1-8]/*")) if base.is_dir() else []:
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if not text.startswith(".so "):  # skip aliases that only include another page
            yield _strip_troff(text)


def dictionary_docs(root: str = "/usr/share/dict", lines_per_doc: int = 2000) -> Iterator[str]:
    for path in sorted(Path(root).glob("*")) if Path(root).is_dir() else []:
        if not path.is_file() or path.name.startswith("README") or not (text := _read(path)):
            continue
        lines = text.splitlines()
        for i in range(0, len(lines), lines_per_doc):
            yield "\n".join(lines[i : i + lines_per_doc])


SOURCES: dict[str, Callable[[], Iterator[str]]] = {
    "Github": github_docs,
    "Python_docs": python_docs,
    "Licenses": license_docs,
    "Man_pages": man_docs,
    "Dictionaries": dictionary_docs,
}


def build_sample_corpus(
    output_dir: str | os.PathLike,
    max_mb: float = 20.0,
    sources: list[str] | None = None,
    level: int = 10,
    progress: bool = True,
) -> dict:
    """Draw documents round-robin from the sources until `max_mb` of text; returns the manifest."""
    import zstandard

    from megatron_lev.utils.progress import progress_bar

    names = sources or list(SOURCES)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise UserError(f"--sources: unknown source(s) {unknown}; available: {', '.join(SOURCES)}")
    if not (math.isfinite(max_mb) and max_mb > 0):
        raise UserError(f"--max-mb {max_mb}: must be a finite number > 0")
    out = Path(output_dir)
    iters = {n: SOURCES[n]() for n in names}
    docs: dict[str, list[str]] = {n: [] for n in names}
    budget, total = int(max_mb * 1e6), 0
    bar = progress_bar(total=budget, unit="B", unit_scale=True, disable=not progress, desc="sample corpus")
    while iters and total < budget:
        for name in list(iters):
            text = next(iters[name], None)
            if text is None:
                del iters[name]
                continue
            if len(text.strip()) < MIN_CHARS:
                continue
            size = len(text.encode("utf-8"))
            docs[name].append(text)
            total += size
            bar.update(size)
            if total >= budget:
                break
    bar.close()
    if not any(docs.values()):
        raise DataError(
            f"--sources {' '.join(names)}: none of them has documents on this machine; "
            f"choose others from {', '.join(SOURCES)}"
        )
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"max_mb": max_mb, "bytes": total, "subsets": {}, "unavailable": []}
    for name in names:
        if not docs[name]:
            manifest["unavailable"].append(name)
            continue
        path = out / f"{name}.jsonl.zst"
        cctx = zstandard.ZstdCompressor(level=level)
        with atomic_open(path, "wb") as f, cctx.stream_writer(f, closefd=False) as w:
            for text in docs[name]:
                line = json.dumps({"text": text, "meta": {"pile_set_name": name}}, ensure_ascii=False)
                w.write(line.encode("utf-8") + b"\n")
        manifest["subsets"][name] = {
            "file": path.name,
            "documents": len(docs[name]),
            "characters": sum(len(t) for t in docs[name]),
        }
    for name in SOURCES:  # subsets of an earlier run into this directory would be read as part of the corpus
        if name not in manifest["subsets"]:
            (out / f"{name}.jsonl.zst").unlink(missing_ok=True)
    atomic_write_json(out / "manifest.json", manifest)
    return manifest
