"""The research workbench (`studies/`) stays outside the library: no module of `megatron_lev` imports
it, the wheel does not ship it, and `python -m studies` runs from a checkout."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SPEC = re.compile(r"^studies(\.\w+)*(:\w+)?$")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _SPEC.match(node.value):
            names.add(node.value.split(":")[0])  # an importlib or callback spec
    return names


def test_the_package_never_imports_the_workbench():
    offenders = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in (ROOT / "megatron_lev").rglob("*.py")
        for name in _imports(path)
        if name == "studies" or name.startswith("studies.")
    )
    assert not offenders, f"the library imports the workbench (not in the wheel): {offenders}"


def test_the_wheel_ships_the_library_only():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    find = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert find["packages"]["find"]["include"] == ["megatron_lev*"], "keep studies/ out of the wheel"


def test_python_m_studies_runs_from_a_checkout():
    out = subprocess.run(
        [sys.executable, "-m", "studies", "plan", "--plan", "clip"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.rstrip().endswith("10 runs") and "lev-sc-s1234" in out


def test_a_lane_command_is_one_the_workbench_parses_back(tmp_path):
    """`run` starts each lane as `python -m studies lane ...`: the same plan, runs and directories."""
    from studies.__main__ import build_parser
    from studies.plans import study_plan
    from studies.runner import Study

    study = Study(tmp_path / "corpus", tmp_path / "out", plan="clip", tokenizer=tmp_path / "tok.json")
    runs = study_plan("clip")[:2]
    command = study.lane_command(1, runs)
    assert command[1:4] == ["-m", "studies", "lane"]
    args = build_parser().parse_args(command[3:])
    assert (args.plan, args.lane, args.runs) == ("clip", 1, [r.name for r in runs])
    assert (args.out, args.data_dir, args.tokenizer) == tuple(
        str(p) for p in (tmp_path / "out", tmp_path / "corpus", tmp_path / "tok.json")
    )
