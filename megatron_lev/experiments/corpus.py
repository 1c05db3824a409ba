"""Split a Pile-format corpus three ways for the small grid: training, validation, zero-shot.

One subset (the documents of one `meta.pile_set_name`, by default `Wikipedia (en)`) is held out
entirely and used only for zero-shot perplexity. Of every other subset, the first documents up
to a character cap are taken, and every `valid_every`-th of them goes to a separate validation file, so the
trainer's validation and `megatron-lev evaluate` see exactly the same held-out documents.
Run as `python -m megatron_lev.experiments.corpus --data-dir DIR --out DIR`.

`python -m megatron_lev.experiments.corpus lambada --input zero_shot.jsonl --out lambada.jsonl`
cuts LAMBADA-format passages from the held-out documents (`lambada_passages`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from megatron_lev.utils.io import atomic_write_json

PARTS = ("train", "valid", "zero_shot")


def pile_files(data_dir: Path) -> list[Path]:
    """`*.jsonl` / `*.jsonl.zst` files of a Pile-format directory, sorted (a fixed document order)."""
    files = sorted(p for p in Path(data_dir).iterdir() if p.name.endswith((".jsonl", ".jsonl.zst")))
    if not files:
        raise FileNotFoundError(
            f"{data_dir}: no *.jsonl or *.jsonl.zst files (Pile format: one "
            '{"text": ..., "meta": {"pile_set_name": ...}} per line)'
        )
    return files


def read_lines(path: Path) -> Iterator[str]:
    """Raw lines of a .jsonl or .jsonl.zst file."""
    if path.name.endswith(".zst"):
        import zstandard

        with open(path, "rb") as f:
            yield from io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as f:
            yield from f


def split_corpus(
    data_dir: Path,
    out_dir: Path,
    zero_shot_subset: str = "Wikipedia (en)",
    max_chars_per_subset: int = 1_000_000,
    valid_every: int = 20,
    zero_shot_max_chars: int = 300_000,
) -> dict:
    """Write `train.jsonl`, `valid.jsonl`, `zero_shot.jsonl` and `split.json` (counts) into `out_dir`."""
    if valid_every < 2:
        raise ValueError(f"valid_every must be at least 2, got {valid_every}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = {part: out_dir / f".{part}.jsonl.tmp" for part in PARTS}
    handles = {part: open(path, "w", encoding="utf-8") for part, path in tmp.items()}
    stats: dict[str, dict[str, dict[str, int]]] = {}
    try:
        for path in pile_files(data_dir):
            for lineno, line in enumerate(read_lines(path), 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                    text, subset = (
                        doc["text"],
                        doc.get("meta", {}).get("pile_set_name", path.name.split(".")[0]),
                    )
                except (json.JSONDecodeError, KeyError, AttributeError) as exc:
                    raise ValueError(f"{path}:{lineno}: not a Pile-format line ({exc})") from None
                per = stats.setdefault(subset, {p: {"docs": 0, "chars": 0} for p in PARTS})
                if subset == zero_shot_subset:
                    part, cap = "zero_shot", zero_shot_max_chars
                else:
                    taken = per["train"]["docs"] + per["valid"]["docs"]
                    part, cap = ("valid" if taken % valid_every == valid_every - 1 else "train"), None
                    if per["train"]["chars"] + per["valid"]["chars"] >= max_chars_per_subset:
                        continue
                if cap is not None and per[part]["chars"] >= cap:
                    continue
                handles[part].write(json.dumps({"text": text, "meta": {"pile_set_name": subset}}) + "\n")
                per[part]["docs"] += 1
                per[part]["chars"] += len(text)
    finally:
        for h in handles.values():
            h.close()
    if zero_shot_subset not in stats:
        raise ValueError(
            f"{data_dir}: no documents of the held-out subset {zero_shot_subset!r} "
            f"(subsets found: {', '.join(sorted(stats))}); choose one with --zero-shot-subset"
        )
    for part in PARTS:
        if not any(s[part]["docs"] for s in stats.values()):
            raise ValueError(f"{data_dir}: the {part} part is empty (subsets: {', '.join(sorted(stats))})")
    for part, path in tmp.items():
        os.replace(path, out_dir / f"{part}.jsonl")
    summary = {
        "data_dir": str(data_dir),
        "zero_shot_subset": zero_shot_subset,
        "max_chars_per_subset": max_chars_per_subset,
        "valid_every": valid_every,
        "zero_shot_max_chars": zero_shot_max_chars,
        "subsets": stats,
    }
    atomic_write_json(out_dir / "split.json", summary)
    return summary


def _is_target(word: str) -> bool:
    """A LAMBADA-style last word: letters only, at least two of them."""
    return len(word) >= 2 and word.isalpha()


def lambada_passages(
    zero_shot: Path,
    out: Path,
    min_words: int = 40,
    max_words: int = 120,
    max_passages: int = 500,
) -> dict:
    """LAMBADA-format passages (`{"text": passage}` a line; the target is the last word) cut from the
    documents of `zero_shot` (a Pile-format .jsonl), written atomically to `out`.

    Deterministic: the documents are read in order and each is cut into consecutive windows of
    at most `max_words` whitespace-separated words; a window ends at its last word that is purely
    alphabetic and at least 2 letters long, provided the passage then has `min_words` words or more
    (else the window is dropped), and the next window starts after it. Words are joined by single
    spaces (line breaks are not kept). Unlike LAMBADA, passages are not filtered for needing the
    broader context: many last words are predictable from the last sentence alone.
    """
    if not 2 <= min_words <= max_words:
        raise ValueError(f"need 2 <= min_words <= max_words, got {min_words} and {max_words}")
    if max_passages < 1:
        raise ValueError(f"max_passages must be at least 1, got {max_passages}")
    zero_shot, out = Path(zero_shot), Path(out)
    passages: list[str] = []
    docs = 0
    for lineno, line in enumerate(read_lines(zero_shot), 1):
        if len(passages) >= max_passages:
            break
        if not line.strip():
            continue
        try:
            words = json.loads(line)["text"].split()
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{zero_shot}:{lineno}: not a Pile-format line ({exc})") from None
        docs += 1
        start = 0
        while start + min_words <= len(words) and len(passages) < max_passages:
            window = words[start : start + max_words]
            end = next((k for k in range(len(window), min_words - 1, -1) if _is_target(window[k - 1])), 0)
            if not end:
                start += len(window)
                continue
            passages.append(" ".join(window[:end]))
            start += end
    if not passages:
        raise ValueError(
            f"{zero_shot}: no passage of {min_words}-{max_words} words ending in an alphabetic word; "
            "lower --min-words"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in passages), encoding="utf-8")
    os.replace(tmp, out)
    lengths = [len(t.split()) for t in passages]
    return {
        "source": zero_shot.name,
        "documents_read": docs,
        "passages": len(passages),
        "min_words": min(lengths),
        "max_words": max(lengths),
        "mean_words": sum(lengths) / len(lengths),
    }


def lambada_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lev.experiments.corpus lambada",
        description=lambada_passages.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--input", required=True, help="Pile-format .jsonl[.zst] (the zero-shot part)")
    parser.add_argument("--out", required=True, help="LAMBADA-format .jsonl to write")
    parser.add_argument("--min-words", type=int, default=40)
    parser.add_argument("--max-words", type=int, default=120)
    parser.add_argument("--max-passages", type=int, default=500)
    args = parser.parse_args(argv)
    try:
        summary = lambada_passages(
            Path(args.input), Path(args.out), args.min_words, args.max_words, args.max_passages
        )
    except (OSError, ValueError) as exc:
        print(f"lambada passages: {exc}", file=sys.stderr)
        return 1
    print(
        f"{summary['passages']} passages of {summary['min_words']}-{summary['max_words']} words "
        f"(mean {summary['mean_words']:.1f}) from {summary['documents_read']} documents -> {args.out}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lambada"]:
        return lambada_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--data-dir", required=True, help="Pile-format directory (*.jsonl[.zst])")
    parser.add_argument("--out", required=True, help="directory for train/valid/zero_shot .jsonl")
    parser.add_argument(
        "--zero-shot-subset", default="Wikipedia (en)", help="pile_set_name held out for zero-shot"
    )
    parser.add_argument("--max-chars-per-subset", type=int, default=1_000_000)
    parser.add_argument("--valid-every", type=int, default=20, help="every N-th taken document is validation")
    parser.add_argument("--zero-shot-max-chars", type=int, default=300_000)
    args = parser.parse_args(argv)
    try:
        summary = split_corpus(
            Path(args.data_dir),
            Path(args.out),
            args.zero_shot_subset,
            args.max_chars_per_subset,
            args.valid_every,
            args.zero_shot_max_chars,
        )
    except (OSError, ValueError) as exc:
        print(f"corpus split: {exc}", file=sys.stderr)
        return 1
    for subset, parts in sorted(summary["subsets"].items()):
        print(
            f"{subset:>20}: "
            + ", ".join(f"{p} {parts[p]['docs']:,} docs / {parts[p]['chars']:,} chars" for p in PARTS)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
