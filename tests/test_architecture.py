"""The package layout of docs/architecture.md, checked on the source: only `megatron_lev/engine/`
imports DeepSpeed, and imports between packages point one way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_lev"

# package -> the packages of megatron_lev it may import (any import: top level or inside a function)
BASE = {"errors", "utils", "logging", "resources"}
ALLOWED = {
    "resources": set(),
    "errors": set(),
    "utils": {"errors"},
    "logging": set(),
    "config": {"errors", "utils", "resources", "model"},  # model: the variant's own rules, via the registry
    "parallel": BASE | {"config"},
    "model": BASE | {"config", "parallel", "engine"},  # engine: the pipeline builder only (checked below)
    "data": BASE | {"config", "parallel"},
    "engine": BASE | {"config", "parallel", "model", "training"},  # training: the optimizer and batches
    "training": BASE | {"config", "parallel", "model", "data", "engine", "testing"},  # testing: fault hooks
    # testing.distributed: the in-process gloo launcher resharding runs its workers with
    "checkpoint": BASE | {"config", "parallel", "model", "data", "engine", "training", "testing"},
    "analysis": BASE | {"config", "parallel", "model", "data", "checkpoint", "training"},
}


def _package(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def _sources():
    return sorted(PKG.rglob("*.py"))


def test_only_the_engine_package_imports_deepspeed():
    leaks = [
        f"{path.relative_to(PKG.parent)}:{line} imports {name}"
        for path in _sources()
        if _package(path) != "engine"
        for name, line in _imports(path)
        if name == "deepspeed" or name.startswith("deepspeed.")
    ]
    assert not leaks, "DeepSpeed outside megatron_lev/engine/: " + "; ".join(leaks)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_one_way(package):
    wrong = []
    for path in _sources():
        if _package(path) != package:
            continue
        for name, line in _imports(path):
            parts = name.split(".")
            if parts[0] != "megatron_lev" or len(parts) < 2:
                continue
            target = parts[1]
            if target != package and target not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(PKG.parent)}:{line} imports {name}")
    assert not wrong, f"megatron_lev/{package} may import only {sorted(ALLOWED[package])}: " + "; ".join(
        wrong
    )


def test_the_model_names_the_engine_only_to_build_a_pipeline():
    uses = [
        (path.relative_to(PKG.parent), name)
        for path in (PKG / "model").rglob("*.py")
        for name, _ in _imports(path)
        if name.startswith("megatron_lev.engine")
    ]
    assert all(name == "megatron_lev.engine.pipeline" for _, name in uses), uses


def test_the_trainer_does_not_know_which_engine_runs():
    text = (PKG / "training" / "trainer.py").read_text()
    for word in ("pipeline", "forward_funcs", "deepspeed", "DeepSpeed"):
        assert word not in text, f"training/trainer.py mentions {word!r}"
