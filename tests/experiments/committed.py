"""The check that a committed results page is the report of its committed raw files."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pages_dir(study: str) -> Path:
    """Where a study's pages are committed (`docs/results/<study>/`)."""
    return ROOT / "docs" / "results" / study


def raw_dir(study: str) -> Path:
    """Where a study's raw run files are committed (`results/<study>/raw/`, outside `docs/`)."""
    return ROOT / "results" / study / "raw"


def assert_pages_regenerate(write, study: str, pages, tmp_path: Path, **kwargs) -> None:
    """`write(results/<study>/raw, tmp_path, **kwargs)` gives every page in `pages` exactly as committed
    in `docs/results/<study>/`."""
    raw, docs = raw_dir(study), pages_dir(study)
    raw_rel, docs_rel = raw.relative_to(ROOT), docs.relative_to(ROOT)
    command = f"python -m studies report {raw_rel} {docs_rel}"
    assert raw.is_dir(), f"{raw_rel} is missing: python -m studies collect"
    write(raw, tmp_path, **kwargs)
    for name in pages:
        committed = docs / name
        assert committed.is_file(), f"{docs_rel}/{name} is missing: {command}"
        assert (tmp_path / name).read_text() == committed.read_text(), (
            f"{docs_rel}/{name} differs from the report of {raw_rel}; regenerate it with `{command}`"
        )
