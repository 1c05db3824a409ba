"""The run configs and DeepSpeed templates shipped inside the package, and how a given name finds them.

`configs/` and `ds_configs/` here are the only copies: a checkout's top-level `pretrain/configs`
and `ds_configs` are symbolic links to them, so the documented paths work in a checkout and there
is nothing to keep in sync. A name is looked up as given first (absolute, or relative to the
current directory), then in the packaged folders, so `--config tiny.yaml`,
`--config pretrain/configs/tiny.yaml` and `train.ds_config=zero2` work from a checkout and from an
installed wheel alike. `include:` lines are relative to the including file, so they resolve
through the links too. This module imports nothing of the project.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR / "configs"  # a checkout's pretrain/configs links here
DS_CONFIG_DIR = PACKAGE_DIR / "ds_configs"  # a checkout's ds_configs links here
# the links' paths in a checkout: a name that starts with one is also looked up without it, so the
# documented `pretrain/configs/...` and `ds_configs/...` names work for an installed package too
CHECKOUT_CONFIG_DIR = Path("pretrain", "configs")
CHECKOUT_DS_CONFIG_DIR = Path("ds_configs")


def _packaged(base: Path, name: str | os.PathLike, checkout_dir: Path, suffixes=("",)) -> Path | None:
    """The file `name` (relative, maybe starting with `checkout_dir`) under `base`, or None."""
    rel = Path(name)
    if rel.is_absolute():
        return None
    parts = rel.parts
    if parts[: len(checkout_dir.parts)] == checkout_dir.parts:
        parts = parts[len(checkout_dir.parts) :]
    if not parts:
        return None
    for suffix in suffixes:
        candidate = base.joinpath(*parts[:-1], parts[-1] + suffix)
        if candidate.is_file() and candidate.resolve().is_relative_to(base):
            return candidate
    return None


def config_path(name: str | os.PathLike) -> Path:
    """A run or model config: `name` if it exists, else the packaged config of that relative name
    (`tiny.yaml`, `models/200m.yaml`, `pretrain/configs/tiny.yaml`); else `name` unchanged, so the
    caller's "not found" names what the user gave."""
    path = Path(name)
    if path.exists():
        return path
    return _packaged(CONFIG_DIR, name, CHECKOUT_CONFIG_DIR) or path


def model_config_names() -> list[str]:
    """The packaged model sizes (`configs/models/<name>.yaml`), sorted."""
    return sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yaml"))


def ds_config_template(name: str | os.PathLike) -> Path | None:
    """A DeepSpeed JSON template: `name` if it is a file, else the packaged one of that name, with or
    without `.json` (`zero2`, `zero2.json`, `ds_configs/zero2.json`); None if neither exists."""
    path = Path(name)
    if path.is_file():
        return path
    return _packaged(DS_CONFIG_DIR, name, CHECKOUT_DS_CONFIG_DIR, ("", ".json"))


def checkout_root() -> Path | None:
    """The repository root when the package is imported from a source checkout, else None (installed)."""
    root = PACKAGE_DIR.parents[1]
    if (root / "pyproject.toml").is_file() and (root / CHECKOUT_CONFIG_DIR).is_dir():
        return root
    return None
