"""Split a Pile-format corpus three ways for the small grid: training, validation, zero-shot.

One Pile subset (`meta.pile_set_name`, by default Wikipedia) is held out entirely and used
only for zero-shot perplexity. Of every other subset, the first documents up to a character
cap are taken, and every `valid_every`-th of them goes to a separate validation file, so the
trainer's validation and `megatron-lev evaluate` see exactly the same held-out documents.
Run as `python -m megatron_lev.experiments.corpus --data-dir DIR --out DIR`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from megatron_lev.config import atomic_write_json

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


def main(argv: list[str] | None = None) -> int:
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
