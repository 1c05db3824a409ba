"""tools/walk.py on small planted packages, where the stops, files and climbs are known by construction."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "walk.py"
_SPEC = importlib.util.spec_from_file_location("walk_tool", TOOL)
walk_tool = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(walk_tool)

DOC = """# Architecture

<!-- layers -->
```
`top`                 the upper row
`low` `side`          the lower row
```
"""


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A checkout under tmp_path: megatron_lev/<files>, every folder a package, and the layer doc."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(DOC)
    pkg = tmp_path / "megatron_lev"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for d in [pkg, *[p for p in pkg.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return tmp_path


def numbers(root: Path, start: str, param: str) -> dict:
    return {k: v for k, v in walk_tool.walk(root, start, param).report().items() if not k.startswith("_")}


def test_three_functions_in_two_files_with_one_upward_call(tmp_path):
    root = plant(
        tmp_path,
        {
            "low/b.py": """
                def start(cfg):
                    return mid(cfg, 1)

                def mid(conf, n):
                    from megatron_lev.top.a import leaf
                    return leaf(n, value=conf)
            """,
            "top/a.py": """
                def leaf(n, value):
                    return value
            """,
        },
    )
    got = numbers(root, "megatron_lev.low.b:start", "cfg")
    assert got == {
        "stops": 3,
        "files": 2,
        "climbs": 1,
        "descents": 0,
        "edges": 2,
        "unresolved": 0,
        "returns": 3,
    }
    w = walk_tool.walk(root, "megatron_lev.low.b:start", "cfg")
    assert list(w.stops) == ["megatron_lev.low.b:start", "megatron_lev.low.b:mid", "megatron_lev.top.a:leaf"]
    assert w.report()["_climbs"] == [("megatron_lev.low.b:mid", "megatron_lev.top.a:leaf", 1, 0)]


def test_a_downward_call_and_a_same_row_call_are_not_climbs(tmp_path):
    root = plant(
        tmp_path,
        {
            "top/a.py": """
                from megatron_lev.low.b import f

                def start(cfg):
                    f(cfg)
            """,
            "low/b.py": """
                from megatron_lev.side import c

                def f(cfg):
                    c.g(cfg)
            """,
            "side/c.py": "def g(cfg):\n    pass\n",
        },
    )
    got = numbers(root, "megatron_lev.top.a:start", "cfg")
    assert (got["stops"], got["files"], got["climbs"], got["descents"]) == (3, 3, 0, 1)


def test_an_attribute_chain_and_a_local_name_flow_but_an_unrelated_value_does_not(tmp_path):
    root = plant(
        tmp_path,
        {
            "top/a.py": """
                from megatron_lev.low.b import chained, assigned, derived, unrelated, counted

                def start(cfg, other):
                    chained(cfg.model.lev)
                    m = cfg.model
                    assigned(m)
                    n = counted(cfg)
                    derived(x=n)
                    unrelated(other, len(cfg), 3)
                    print(cfg)
            """,
            "low/b.py": """
                def chained(lev): pass
                def assigned(model): pass
                def counted(cfg): return 1
                def derived(x): pass
                def unrelated(a, b, c): pass
            """,
        },
    )
    w = walk_tool.walk(root, "megatron_lev.top.a:start", "cfg")
    assert sorted(s.split(":")[1] for s in w.stops) == ["assigned", "chained", "counted", "derived", "start"]
    assert w.report()["unresolved"] == 2  # len(cfg), print(cfg)


def test_a_method_on_self_and_a_constructor_resolve(tmp_path):
    root = plant(
        tmp_path,
        {
            "top/a.py": """
                from megatron_lev.low.b import Holder

                class Runner:
                    def run(self, cfg):
                        self.step(3, cfg=cfg)
                        h = Holder(cfg)
                        h.use(cfg.model)
                        Holder.make(cfg)

                    def step(self, n, cfg):
                        pass
            """,
            "low/b.py": """
                class Base:
                    def __init__(self, cfg):
                        pass

                class Holder(Base):
                    def use(self, model):
                        pass

                    @classmethod
                    def make(cls, cfg):
                        pass
            """,
        },
    )
    w = walk_tool.walk(root, "megatron_lev.top.a:Runner.run", "cfg")
    assert list(w.stops) == [
        "megatron_lev.top.a:Runner.run",
        "megatron_lev.top.a:Runner.step",
        "megatron_lev.low.b:Base.__init__",
        "megatron_lev.low.b:Holder.use",
        "megatron_lev.low.b:Holder.make",
    ]
    assert ("megatron_lev.low.b", "Holder.make", "cfg") in w.seen  # a classmethod's `cls` is skipped
    assert ("megatron_lev.low.b", "Holder.use", "self") in w.seen  # `h` was built from cfg


def test_relative_imports_and_a_package_reexport_resolve(tmp_path):
    root = plant(
        tmp_path,
        {
            "top/a.py": """
                from . import helpers
                from ..low import g

                def start(cfg):
                    helpers.f(cfg)
                    g(cfg)
            """,
            "top/helpers.py": "def f(cfg):\n    pass\n",
            "low/__init__.py": "from .impl import g\n",
            "low/impl.py": "def g(cfg):\n    pass\n",
        },
    )
    w = walk_tool.walk(root, "megatron_lev.top.a:start", "cfg")
    assert sorted(w.stops) == [
        "megatron_lev.low.impl:g",
        "megatron_lev.top.a:start",
        "megatron_lev.top.helpers:f",
    ]


def test_the_command_line_prints_json_and_the_list(tmp_path, capsys):
    root = plant(tmp_path, {"low/b.py": "def start(cfg):\n    return mid(cfg)\n\ndef mid(cfg):\n    pass\n"})
    assert walk_tool.main(["--root", str(root), "--json", "megatron_lev.low.b:start", "cfg"]) == 0
    assert json.loads(capsys.readouterr().out)["stops"] == 2
    walk_tool.main(["--root", str(root), "--list", "megatron_lev.low.b:start", "cfg"])
    assert "megatron_lev.low.b:mid" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        walk_tool.main(["--root", str(root), "megatron_lev.low.b:start", "nope"])


def test_a_value_is_followed_into_a_record_and_out_of_it(tmp_path):
    """`fit(build(plan))`: the record `build` returns carries the plan into `fit`; there a field read
    by tuple assignment, typed by the record's annotation, enters the method called on it; a builtin's
    result (`len(plan)`) carries nothing."""
    root = plant(
        tmp_path,
        {
            "top/run.py": """
                from dataclasses import dataclass
                from megatron_lev.low.trainer import Trainer

                @dataclass
                class Parts:
                    trainer: Trainer
                    n: int

                def start(plan, other):
                    fit(build(plan))
                    ignored(len(plan))

                def build(plan):
                    return Parts(Trainer(plan), 3)

                def fit(parts: Parts):
                    trainer, n = parts.trainer, parts.n
                    trainer.train()

                def ignored(n): pass
            """,
            "low/trainer.py": """
                class Trainer:
                    def __init__(self, plan):
                        self.plan = plan

                    def train(self):
                        return step(self.plan)

                def step(plan):
                    return plan
            """,
        },
    )
    w = walk_tool.walk(root, "megatron_lev.top.run:start", "plan")
    assert sorted(s.split(":")[1] for s in w.stops) == [
        "Parts.__init__",
        "Trainer.__init__",
        "Trainer.train",
        "build",
        "fit",
        "start",
        "step",
    ]
    assert sorted(w.returns) == [
        "megatron_lev.low.trainer:Trainer.train",
        "megatron_lev.low.trainer:step",
        "megatron_lev.top.run:build",
    ]
