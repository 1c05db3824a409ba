"""The check that a committed results page is the report of its committed raw files."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def assert_pages_regenerate(write, results: Path, pages, tmp_path: Path, **kwargs) -> None:
    """`write(results/raw, tmp_path, **kwargs)` gives every page in `pages` exactly as committed in
    `results`."""
    raw, rel = results / "raw", results.relative_to(ROOT)
    assert raw.is_dir(), f"{rel}/raw is missing: megatron-lev study collect"
    write(raw, tmp_path, **kwargs)
    for name in pages:
        committed = results / name
        assert committed.is_file(), f"{rel}/{name} is missing: megatron-lev study report {rel}/raw {rel}"
        assert (tmp_path / name).read_text() == committed.read_text(), (
            f"{rel}/{name} differs from the report of {rel}/raw; regenerate it with "
            f"`megatron-lev study report {rel}/raw {rel}`"
        )
