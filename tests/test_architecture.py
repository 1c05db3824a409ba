"""The package layering of docs/architecture.md, checked on the source.

The layers are an ordered list, bottom first. A package may import its own modules and any
package on a lower row, never one on its own row or above: so no import runs upward, and no
two packages can import each other. Every import counts (top level or inside a function, and
a `"megatron_lev.x"` or `"megatron_lev.x:Class"` string, which `importlib` or a callback spec
turns into an import), except those under `if TYPE_CHECKING:`, which never run. Named forbidden
pairs (`FORBIDDEN`, the doc's "does not know" column) are checked by the same walker, whatever the
rows allow. A cycle check over the package graph and over the module graph backs the row rule up.
The checker is tested on small planted trees, so it is shown to fail on an upward import, on a
forbidden pair the rows allow, and on a cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "megatron_lev"
DOC = PKG.parent / "docs" / "architecture.md"

# bottom first; a package imports only from rows below its own
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "resources"),
    ("utils",),
    ("log",),
    ("config",),
    ("parallel",),
    ("data", "optim"),
    ("ckpt",),
    ("model",),
    ("plan",),
    ("engine",),
    ("training",),
    ("convert",),
    ("analysis",),
    ("testing",),
    ("demo",),
    ("experiments",),
    ("commands",),
    ("cli",),
    ("__main__",),
)

# (importer, imported, why): imports allowed against the rows. Keep this empty unless a reason is
# stronger than the layering; each entry is printed in docs/architecture.md.
EXCEPTIONS: tuple[tuple[str, str, str], ...] = ()

# (importer, imported, why): imports the rows allow (or already refuse) that docs/architecture.md's
# "does not know" column forbids. Checked by the same walker as the rows, so a rule holds even where
# a row order would let the import through or the rows are later reshuffled. The doc's column names
# exactly these packages for each importer (`test_the_document_names_the_forbidden_pairs`).
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("config", "model", "the config knows no model; the run plan asks a variant for its own rules"),
    ("parallel", "model", "process groups and TP layers serve any network"),
    ("parallel", "engine", "the groups are DeepSpeed's layout computed here, not DeepSpeed's objects"),
    ("data", "model", "tokens and batches are the same for every model"),
    ("data", "engine", "batches are handed to whichever engine runs"),
    ("data", "training", "the data pipeline is driven by the loop, never drives it"),
    ("optim", "model", "the optimizer sees parameter groups, not a network"),
    ("optim", "engine", "the engine wraps the optimizer, not the other way"),
    ("optim", "training", "the optimizer knows nothing of the loop"),
    ("ckpt", "engine", "the checkpoint format saves through any engine's verbs"),
    ("ckpt", "training", "the checkpoint format does not know how a run resumes"),
    ("model", "engine", "the network is defined once, whatever backend parallelises it"),
    ("model", "training", "the network does not know how it is trained"),
    ("model", "ckpt", "the network does not know how it is stored"),
    ("model", "data", "the network takes tensors, not the data pipeline"),
    ("plan", "engine", "the plan is data (the DeepSpeed JSON included); the engine is built from it"),
    ("plan", "training", "the plan is made before the loop exists"),
    ("engine", "training", "the engine runs steps; the loop, callbacks and resume policy are above it"),
    ("convert", "training", "conversion reads checkpoint files (ckpt.record), not the training loop"),
    ("analysis", "engine", "analyses read checkpoints and models without an engine"),
    ("analysis", "training", "analyses do not run the loop"),
)

_SPEC = re.compile(r"^megatron_lev(\.\w+)+(:\w+)?$")


def level_of(layers=LAYERS) -> dict[str, int]:
    return {pkg: i for i, row in enumerate(layers) for pkg in row}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of the statements under `if TYPE_CHECKING:` (never run)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    for sub in ast.walk(stmt):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every project import in `path` that can run."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    here = module_name(path, root).split(".")
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno))
            out += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _SPEC.match(node.value):
            out.append((node.value.split(":")[0], node.lineno))
    return [(name, line) for name, line in out if name.split(".")[0] == root.name]


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _sources(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def package_edges(root: Path) -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> the import sites, over every module under `root`."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in _sources(root):
        src = package_of(module_name(path, root))
        seen = set()
        for name, line in imports_of(path, root):
            dst = package_of(name)
            if src and dst and dst != src and (dst, line) not in seen:
                seen.add((dst, line))
                edges.setdefault((src, dst), []).append(f"{path.relative_to(root.parent)}:{line} {name}")
    return edges


def module_edges(root: Path) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name that is an attribute, not a module, is dropped)."""
    modules = {module_name(p, root) for p in _sources(root)}
    graph: dict[str, set[str]] = {}
    for path in _sources(root):
        src = module_name(path, root)
        targets = set()
        for name, _ in imports_of(path, root):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != src and not src.startswith(name + ".") and name != root.name:
                targets.add(name)
        graph[src] = targets
    return graph


def upward_imports(root: Path, layers=LAYERS, exceptions=EXCEPTIONS) -> list[str]:
    """Every import of a package on the importer's row or above (named exceptions aside)."""
    level = level_of(layers)
    allowed = {(a, b) for a, b, _ in exceptions}
    wrong = []
    for (src, dst), sites in sorted(package_edges(root).items()):
        if (src, dst) in allowed:
            continue
        if src not in level or dst not in level:
            wrong.append(f"{src} -> {dst}: a package missing from LAYERS ({sites[0]})")
        elif level[dst] >= level[src]:
            how = "on the same row as" if level[dst] == level[src] else "above"
            wrong += [f"{site}: {dst} is {how} {src}" for site in sites]
    return wrong


def forbidden_imports(root: Path, pairs=FORBIDDEN, exceptions=EXCEPTIONS) -> list[str]:
    """Every import of a named forbidden pair, wherever the rows put the two packages."""
    allowed = {(a, b) for a, b, _ in exceptions}
    why = {(a, b): reason for a, b, reason in pairs}
    edges = package_edges(root)
    return [
        f"{site}: {src} must not import {dst} ({why[src, dst]})"
        for (src, dst) in sorted(why.keys() - allowed)
        for site in edges.get((src, dst), ())
    ]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def package_graph(root: Path) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for src, dst in package_edges(root):
        graph.setdefault(src, set()).add(dst)
    return graph


# ------------------------------------------------------------------ the real tree


def test_every_package_is_on_a_row():
    on_disk = {
        p.name.removesuffix(".py")
        for p in PKG.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    on_disk.discard("__init__")
    rows = set(level_of())
    assert on_disk == rows, (
        f"packages without a row: {sorted(on_disk - rows)}; rows without a package: {sorted(rows - on_disk)}"
    )


def test_no_import_runs_upward():
    wrong = upward_imports(PKG)
    assert not wrong, "imports against the layers of docs/architecture.md:\n" + "\n".join(wrong)


def test_no_forbidden_pair_is_imported():
    wrong = forbidden_imports(PKG)
    assert not wrong, "imports the doc's 'does not know' column forbids:\n" + "\n".join(wrong)


def test_the_forbidden_pairs_name_placed_packages():
    level = level_of()
    unknown = sorted({p for a, b, _ in FORBIDDEN for p in (a, b)} - level.keys())
    assert not unknown, f"FORBIDDEN names packages without a row: {unknown}"
    pairs = [(a, b) for a, b, _ in FORBIDDEN]
    assert len(pairs) == len(set(pairs)) and all(why for *_, why in FORBIDDEN)


def test_no_cycle_between_packages():
    cycle = find_cycle(package_graph(PKG))
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def test_no_cycle_between_modules():
    cycle = find_cycle(module_edges(PKG))
    assert cycle is None, "modules import each other: " + " -> ".join(cycle)


def test_only_the_engine_package_imports_deepspeed():
    leaks = []
    for path in _sources(PKG):
        if package_of(module_name(path, PKG)) == "engine":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            leaks += [
                f"{path.relative_to(PKG.parent)}:{node.lineno} {n}"
                for n in names
                if n.split(".")[0] == "deepspeed"
            ]
    assert not leaks, "DeepSpeed outside megatron_lev/engine/: " + "; ".join(leaks)


def test_no_production_module_names_the_test_aids():
    """`megatron_lev.testing` ships test aids (a launcher, a host-sync counter, fault callbacks)."""
    uses = [site for (src, dst), sites in package_edges(PKG).items() if dst == "testing" for site in sites]
    assert not uses, "production code imports megatron_lev.testing: " + "; ".join(uses)


def test_the_trainer_does_not_know_which_engine_runs():
    text = (PKG / "training" / "trainer.py").read_text()
    for word in ("pipeline", "forward_funcs", "deepspeed", "DeepSpeed", "Checkpointer"):
        assert word not in text, f"training/trainer.py mentions {word!r}"


# The parallel layout is passed, not read from a global: only these modules may import
# `megatron_lev.parallel.state` (which creates the process groups and returns the `ParallelLayout`).
STATE = "megatron_lev.parallel.state"
STATE_USERS = (
    STATE,
    "megatron_lev.training.run",  # the composition root: creates the run's layout
    "megatron_lev.convert.reshard",  # starts the target layout's groups itself
)
# Megatron-style global getters: a call of one outside STATE_USERS reads a hidden global
_GETTER = re.compile(
    r"^(get_(tensor_model|pipeline_model|data|model)_parallel_\w+|(initialize|destroy)_model_parallel"
    r"|model_parallel_is_initialized)$"
)


def _calls(root: Path):
    """(module, path relative to the package's parent, call node, the called name) of every call in
    every module under `root`: what the site checks below walk."""
    for path in _sources(root):
        yield from _calls_in(path, root)


def _calls_in(path: Path, root: Path):
    """`_calls` of one module."""
    module, where = module_name(path, root), path.relative_to(root.parent)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            fn = node.func
            yield module, where, node, fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")


def state_readers(root: Path, allowed=STATE_USERS) -> list[str]:
    """Sites in modules outside `allowed` that import `parallel.state` (in any form) or call a
    Megatron-style parallel-state getter."""
    state = f"{root.name}.parallel.state"
    found = []
    for path in _sources(root):
        if module_name(path, root) not in allowed:
            where = path.relative_to(root.parent)
            found += [f"{where}:{line} imports {n}" for n, line in imports_of(path, root) if n == state]
    found += [
        f"{where}:{node.lineno} calls {name}()"
        for module, where, node, name in _calls(root)
        if module not in allowed and _GETTER.match(name)
    ]
    return sorted(set(found))


def test_only_the_layout_makers_import_parallel_state():
    """The `ParallelLayout` travels as an argument; at most three modules touch `parallel.state`."""
    assert len(STATE_USERS) <= 3
    readers = state_readers(PKG)
    assert not readers, "the parallel layout must be passed, not read: " + "; ".join(readers)


def test_a_planted_parallel_state_reader_is_caught(tmp_path):
    root = _tree(
        tmp_path,
        {
            "parallel/state.py": "def get_data_parallel_rank():\n    return 0\n",
            "training/run.py": "from megatron_lev.parallel import state\n",
            "model/a.py": "from megatron_lev.parallel import state\n",
            "model/b.py": "import megatron_lev.parallel.state as s\n",
            "model/c.py": "from megatron_lev.parallel.state import get_data_parallel_rank\n",
            "engine/d.py": "def f(mpu):\n    return mpu.get_tensor_model_parallel_rank()\n",
            "parallel/e.py": "from . import state\n",
            "model/fine.py": "from megatron_lev.parallel.layout import ParallelLayout\n",
        },
    )
    allowed = ("megatron_lev.parallel.state", "megatron_lev.training.run")
    readers = state_readers(root, allowed)
    assert [r.split(":")[0] for r in readers] == [
        "megatron_lev/engine/d.py",
        "megatron_lev/model/a.py",
        "megatron_lev/model/b.py",
        "megatron_lev/model/c.py",
        "megatron_lev/parallel/e.py",
    ], readers
    assert state_readers(root, (*allowed, "megatron_lev.model.a")) == [r for r in readers if "/a.py" not in r]


def test_the_document_lists_the_layers_the_test_enforces():
    """docs/architecture.md's layer block is LAYERS, top row first, and names every exception."""
    text = DOC.read_text()
    block = re.search(r"<!-- layers -->\n```\n(.*?)```", text, re.S)
    assert block, f"{DOC} has no '<!-- layers -->' block"
    rows = []
    for line in block.group(1).splitlines():
        names = re.findall(r"`([\w_]+)`", line)
        if names:
            rows.append(tuple(names))
    assert rows == [tuple(r) for r in reversed(LAYERS)], rows
    for importer, imported, _ in EXCEPTIONS:
        assert f"`{importer}` -> `{imported}`" in text


def _does_not_know_column() -> dict[str, set[str]]:
    """importer -> the packages the "does not know" column of the doc's table names (in backticks)."""
    packages = level_of().keys()
    table = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) != 3:
            continue
        for importer in re.findall(r"`(\w+)`", cells[0]):
            table[importer] = set(re.findall(r"`(\w+)`", cells[2])) & packages
    return table


def test_the_document_names_the_forbidden_pairs():
    """Each row of the doc's table names, in its "does not know" column, exactly the packages FORBIDDEN
    keeps that row's packages from importing, and every importer of FORBIDDEN has a row."""
    table = _does_not_know_column()
    wanted: dict[str, set[str]] = {}
    for importer, imported, _ in FORBIDDEN:
        wanted.setdefault(importer, set()).add(imported)
    missing = sorted(wanted.keys() - table.keys())
    assert not missing, f"importers without a row in the table: {missing}"
    wrong = {
        pkg: (names, wanted.get(pkg, set()))
        for pkg, names in table.items()
        if names != wanted.get(pkg, set())
    }
    assert not wrong, f"{DOC.name} 'does not know' column vs FORBIDDEN (doc, test): {wrong}"


# ------------------------------------------------------------------ the checker can fail


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "megatron_lev"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return root


PLANTED_LAYERS = (("utils",), ("model",), ("engine",))


def test_a_planted_upward_import_is_caught(tmp_path):
    root = _tree(
        tmp_path,
        {
            "utils/io.py": "",
            "model/gpt.py": "def build():\n    from megatron_lev.engine.pipeline import build_pipeline\n",
            "engine/pipeline.py": "from megatron_lev.model import gpt\n",
        },
    )
    wrong = upward_imports(root, PLANTED_LAYERS, ())
    assert (
        len(wrong) == 1 and "megatron_lev/model/gpt.py:2" in wrong[0] and "engine is above model" in wrong[0]
    )
    assert find_cycle(package_graph(root)) == ["engine", "model", "engine"]
    assert upward_imports(root, PLANTED_LAYERS, (("model", "engine", "planted"),)) == []


def test_a_planted_cycle_is_caught_even_when_a_row_allows_it(tmp_path):
    root = _tree(
        tmp_path,
        {
            "model/a.py": "from megatron_lev.model.b import x\n",
            "model/b.py": "x = 1\n\n\ndef f():\n    from megatron_lev.model import a\n",
            "engine/e.py": "'megatron_lev.utils.io:helper'\n",
            "utils/io.py": "",
        },
    )
    assert find_cycle(module_edges(root)) == [
        "megatron_lev.model.a",
        "megatron_lev.model.b",
        "megatron_lev.model.a",
    ]
    # a callback spec string counts as an import; one under TYPE_CHECKING does not
    assert ("engine", "utils") in package_edges(root)
    (root / "utils" / "io.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from megatron_lev.engine import e\n"
    )
    assert upward_imports(root, PLANTED_LAYERS, ()) == []


def test_a_package_missing_from_the_rows_is_caught(tmp_path):
    root = _tree(tmp_path, {"model/gpt.py": "from megatron_lev.newpkg import thing\n", "newpkg/thing.py": ""})
    wrong = upward_imports(root, PLANTED_LAYERS, ())
    assert wrong and "missing from LAYERS" in wrong[0]


@pytest.mark.parametrize(
    "relative", ["from ..engine import pipeline\n", "from ..engine.pipeline import build\n"]
)
def test_a_relative_upward_import_is_caught(tmp_path, relative):
    root = _tree(tmp_path, {"model/gpt.py": relative, "engine/pipeline.py": "build = 1\n", "utils/io.py": ""})
    wrong = upward_imports(root, PLANTED_LAYERS, ())
    assert wrong and "engine is above model" in wrong[0]


def test_a_planted_forbidden_pair_is_caught_on_a_legal_row(tmp_path):
    """`convert` sits above `training`, so the rows allow the import; the named pair does not, also
    inside a function, and not under TYPE_CHECKING."""
    layers = (("ckpt",), ("training",), ("convert",))
    pairs = (("convert", "training", "planted reason"),)
    root = _tree(
        tmp_path,
        {
            "ckpt/record.py": "",
            "training/resume.py": "from megatron_lev.ckpt.record import x\n",
            "convert/reshard.py": "def f():\n    from megatron_lev.training.resume import saved_batch\n",
            "convert/source.py": (
                "from typing import TYPE_CHECKING\n\n"
                "if TYPE_CHECKING:\n    from megatron_lev.training import resume\n"
            ),
        },
    )
    assert upward_imports(root, layers, ()) == []
    wrong = forbidden_imports(root, pairs, ())
    assert len(wrong) == 1 and "megatron_lev/convert/reshard.py:2" in wrong[0], wrong
    assert "convert must not import training (planted reason)" in wrong[0]
    assert forbidden_imports(root, pairs, (("convert", "training", "planted"),)) == []


# ------------------------------------------------------------------ one reader of the `latest` pointer

POINTER_READER = "megatron_lev.ckpt.layout"  # read_latest: the one rule for what `latest` may name


def _names_the_pointer(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Constant) and n.value == "latest")
        or (isinstance(n, ast.Name) and n.id == "LATEST_FILE")
        for n in ast.walk(node)
    )


def pointer_readers(root: Path, allowed: str = POINTER_READER) -> list[str]:
    """Sites outside `allowed` that read the `latest` pointer themselves: `.read_text()` / `.open()`
    of a path joined with it, or `open(...)` of one."""
    found = []
    for module, where, node, name in _calls(root):
        if module == allowed.replace("megatron_lev", root.name):
            continue
        if isinstance(node.func, ast.Attribute) and name in ("read_text", "read_bytes", "open"):
            target = node.func.value
        elif isinstance(node.func, ast.Name) and name == "open" and node.args:
            target = node.args[0]
        else:
            continue
        if isinstance(target, ast.BinOp) and _names_the_pointer(target):
            found.append(f"{where}:{node.lineno}")
    return found


def test_one_reader_of_the_latest_pointer():
    readers = pointer_readers(PKG)
    assert not readers, "read `latest` through ckpt.layout.read_latest: " + "; ".join(readers)


def test_a_planted_pointer_reader_is_caught(tmp_path):
    root = _tree(
        tmp_path,
        {
            "ckpt/layout.py": "def read_latest(root):\n    return (root / LATEST_FILE).read_text()\n",
            "convert/a.py": "def f(work):\n    return (work / 'latest').read_text().strip()\n",
            "engine/b.py": "def f(p):\n    return open(p / LATEST_FILE).read()\n",
            "ckpt/io.py": "def f(root, tag):\n    write(root / LATEST_FILE, tag)\n",
        },
    )
    assert [r.split(":")[0] for r in pointer_readers(root)] == [
        "megatron_lev/convert/a.py",
        "megatron_lev/engine/b.py",
    ]


# ------------------------------------------------------------------ plans are made in plan/


def plan_makers(root: Path) -> list[str]:
    """Sites outside `plan/` that construct a `RunPlan` or settle a plan's vocabulary or batch
    (`with_vocab`, `with_global_batch`) outside a run's `setup`."""
    found = []
    for module, where, node, name in _calls(root):
        if package_of(module) == "plan":
            continue
        if name == "RunPlan":
            found.append(f"{where}:{node.lineno} RunPlan(")
        elif name in ("with_vocab", "with_global_batch") and module != f"{root.name}.training.run":
            found.append(f"{where}:{node.lineno} .{name}(")
    return found


def test_plans_are_made_in_plan_and_settled_in_setup():
    makers = plan_makers(PKG)
    assert not makers, "make plans with plan.validate_run / model_plan: " + "; ".join(makers)


def test_a_planted_plan_maker_is_caught(tmp_path):
    root = _tree(
        tmp_path,
        {
            "plan/__init__.py": "class RunPlan:\n    pass\n\ndef make():\n    return RunPlan()\n",
            "convert/a.py": "from megatron_lev.plan import RunPlan\n\ndef f():\n    return RunPlan()\n",
            "engine/b.py": "def f(plan):\n    return plan.with_vocab(3)\n",
            "training/run.py": "def setup(plan):\n    return plan.with_vocab(3)\n",
        },
    )
    assert [r.split(":")[0] for r in plan_makers(root)] == [
        "megatron_lev/convert/a.py",
        "megatron_lev/engine/b.py",
    ]


# ------------------------------------------------------------------ models are built from a spec


def model_constructors(root: Path) -> list[str]:
    """Sites outside `model/` and `engine/build.py` that construct a `GPTModel` themselves instead of
    `build_model(spec, layout)` from a `ModelSpec`."""
    return [
        f"{where}:{node.lineno} GPTModel("
        for module, where, node, name in _calls(root)
        if name == "GPTModel" and package_of(module) != "model" and module != f"{root.name}.engine.build"
    ]


def test_the_package_builds_models_from_a_spec_and_no_code_fakes_a_run():
    makers = model_constructors(PKG)
    assert not makers, "build a model with engine.build.build_model(spec, layout): " + "; ".join(makers)
    fakes = [
        f"{path.relative_to(PKG.parent)}"
        for top in ("tests", "benchmarks", "tools", "megatron_lev")
        for path in sorted((PKG.parent / top).rglob("*.py"))
        if path.name != "test_architecture.py" and re.search(r"unused-(data|tokenizer)", path.read_text())
    ]
    assert not fakes, (
        "build a model with plan.model_spec(cfg, vocab), not a run with placeholder paths: "
        + ", ".join(fakes)
    )


GPT = "from megatron_lev.model.gpt import GPTModel"


def _flagged_files(tmp_path: Path, files: dict[str, str], finder) -> list[str]:
    """The files `finder` flags in a planted tree of `files`."""
    return [r.split(":")[0] for r in finder(_tree(tmp_path, files))]


def test_a_planted_model_constructor_is_caught(tmp_path):
    files = {
        "model/gpt.py": "class GPTModel:\n    pass\n\ndef f():\n    return GPTModel()\n",
        "engine/build.py": f"{GPT}\n\ndef b(s):\n    return GPTModel(s)\n",
        "convert/a.py": f"{GPT}\n\ndef f(c):\n    return GPTModel(c, 8)\n",
    }
    assert _flagged_files(tmp_path, files, model_constructors) == ["megatron_lev/convert/a.py"]


# ------------------------------------------------------------------ the phase is passed


def session_readers(root: Path) -> list[str]:
    """Sites outside `parallel/session.py` that read the joined session from afar (`current()`,
    `_SESSION`) instead of being passed its phase reporter (`phase_reporter()`, called once by the
    composition root, `training/run.py`)."""
    session = f"{root.name}.parallel.session"
    found = []
    for path in _sources(root):
        module = module_name(path, root)
        if module == session:
            continue
        where = path.relative_to(root.parent)
        text = path.read_text()
        found += [f"{where}: _SESSION" for _ in re.findall(r"\b_SESSION\b", text)[:1]]
        for _mod, w, node, name in _calls_in(path, root):
            if name == "current" or (name == "phase_reporter" and module != f"{root.name}.training.run"):
                found.append(f"{w}:{node.lineno} {name}()")
    return found


def test_the_session_phase_is_passed_not_read_from_afar():
    readers = session_readers(PKG)
    assert not readers, "pass the phase reporter from training/run.py: " + "; ".join(readers)


REPORTER = "from megatron_lev.parallel.session import phase_reporter"
SESSION = "from megatron_lev.parallel import session"


def test_a_planted_session_reader_is_caught(tmp_path):
    files = {
        "parallel/session.py": "_SESSION = None\n\ndef current():\n    return _SESSION\n",
        "training/run.py": f"{REPORTER}\n\ndef b():\n    return phase_reporter()\n",
        "ckpt/io.py": f"{SESSION}\n\ndef f():\n    session.current().set_phase('x')\n",
    }
    assert _flagged_files(tmp_path, files, session_readers) == ["megatron_lev/ckpt/io.py"]


# ------------------------------------------------------------------ the RNG tracker is the model's


def process_wide_trackers(root: Path) -> list[str]:
    """Module-level RNG trackers (an `RNGStatesTracker(...)` assigned at module scope): a tracker is
    made per model (`parallel.random.tp_rng_tracker`, called by `build_model`) and passed down, so no
    module keeps one for code elsewhere to read."""
    found = []
    for path in _sources(root):
        where = path.relative_to(root.parent)
        for node in ast.parse(path.read_text(), str(path)).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "RNGStatesTracker":
                found.append(f"{where}:{node.lineno} a module-level RNGStatesTracker")
    return found


def test_no_rng_tracker_is_process_wide():
    trackers = process_wide_trackers(PKG)
    assert not trackers, "make the tracker per model (tp_rng_tracker) and pass it: " + "; ".join(trackers)


TRACKER = "from megatron_lev.parallel.random import RNGStatesTracker"


def test_a_planted_process_wide_tracker_is_caught(tmp_path):
    files = {
        "parallel/random.py": (
            "class RNGStatesTracker:\n    pass\n\ndef t():\n    return RNGStatesTracker()\n"
        ),
        "model/a.py": f"{TRACKER}\n\n_T = RNGStatesTracker()\n",
    }
    assert _flagged_files(tmp_path, files, process_wide_trackers) == ["megatron_lev/model/a.py"]
