"""The results files under benchmarks/results/: a title once, then one dated section per run."""

from __future__ import annotations

from pathlib import Path


def append_section(path: Path, title: str, section: str) -> None:
    """Append `section` to `path`, writing `title` first when the file is new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(title)
    with open(path, "a") as f:
        f.write(section)
    print(f"appended to {path}")
