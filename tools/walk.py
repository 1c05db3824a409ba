"""Follow one parameter through the package's calls and count where it goes (static, AST only).

This is an approximation of a by-hand walk, for before/after numbers in an architecture review.
It imports nothing of the package: it reads the source of any checkout.

    python tools/walk.py [--root DIR] [--list] [--json] START PARAM
    e.g. python tools/walk.py megatron_lev.training.run:pretrain plan

Definitions:
- Start: `module.path:function` or `module.path:Class.method`, and one of its parameter names.
- The parameter "flows" into a call when the call passes, as a positional or keyword argument, a
  tracked name itself or an attribute chain of it (`run.cfg`, `cfg.model.lev`). Tracked names are
  the parameters that received the value, plus local names assigned (`x = ...`, `x: T = ...`, also
  tuple targets) in the same function from a tracked name, an attribute chain or subscript of one,
  a conditional/boolean expression with such a branch (`run.cfg if p else run`), or a call that
  receives one (`x = f(run)`, also nested: `Parts(Trainer(run), 3)`), element by element where a
  tuple meets a tuple (`a, b = run.a, other`); assignments are read once, in source order, so a
  chain of them is followed. Nested functions and lambdas are read as part of their enclosing
  function.
- Records: a value goes into a record and comes out of it. An argument that is the result of a
  package call which received the value carries it on (`fit(build(run))`: the record `build` returns
  holds the run; a builtin's result, `len(run)`, does not), an object an attribute of the value is
  stored on holds it (`self.plan = plan`), and a name bound to a field of a typed record takes the
  type the record's class annotates for that field (`trainer = parts.trainer` with `trainer:
  Trainer` in `RunParts`), so a method called on it is entered.
- Returns: the functions entered whose `return` carries the value (or a record holding it).
- A stop is a function of the package entered with the flowing value; each function counts once,
  however many paths or parameters reach it (the start is a stop). A class called as a
  constructor is entered at its `__init__` (its own or a base class's in the package); a class
  with no `__init__` in the source (a dataclass) is a stop `Class.__init__` with no body to follow.
- Files: distinct modules among the stops. Edges: distinct (caller, callee) pairs followed.
- Rows: the layer table of docs/architecture.md (the block after `<!-- layers -->`), numbered
  from its first row (0, the top); a module's row is that of its top-level package.
- A climb is a followed edge whose caller sits on a lower row of the table (a larger number)
  than the callee: a call up the stack. A descent is the opposite, a call down to a lower row.
  Calls within one top-level package (or between packages on one row) are neither. Where the
  layering test forbids upward imports, a resolvable climb needs an import the test would
  refuse, so climbs stay 0 and the descents carry the cross-layer count.
- Resolution: `from pkg.x import f` (also inside functions, relative imports, and re-exports of a
  package `__init__`), `import pkg.x as m` / `m.f`, `self.method` (the class and its package
  bases), classes called as constructors, `Class.method`, and `obj.method` where `obj` was
  assigned in the function from a package class (or from a function whose return annotation
  names one), or its parameter annotation names one (`A`, `A | None`). A method called on the
  tracked value itself (`cfg.validate()`, `plan.with_vocab(n)`) whose type is known that way
  receives it as `self`, and a method entered as `self` passes it on through `self.method()`.
  The callee's parameter is the matching positional (or `*args`) or keyword (or `**kwargs`) one.
  Calls that pass the value but resolve to nothing in the package (builtins, torch, DeepSpeed,
  callbacks, dynamic dispatch) are counted as unresolved, once per call site.

What it cannot see: values stored on `self` or in containers and read back in a method not entered
with that object as `self` (`self.cfg` read in a method reached only through `cfg`), quoted
annotations, a return travelling up to a caller that did not pass the value (the start's callers),
`*args`/`**kwargs` forwarding at
the call site, callbacks, registries, `getattr`/`importlib`, inheritance overrides (it takes the
class it can name, not the runtime subclass), and methods on values of unknown type.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

FuncDef = ast.FunctionDef | ast.AsyncFunctionDef


class Module:
    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.tree = ast.parse(path.read_text(), str(path))
        self.is_pkg = path.name == "__init__.py"
        self.defs: dict[str, ast.AST] = {}  # "f", "C", "C.m" -> node
        for node in self.tree.body:
            if isinstance(node, FuncDef | ast.ClassDef):
                self.defs[node.name] = node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, FuncDef):
                        self.defs[f"{node.name}.{sub.name}"] = sub
        self.imports = self.bindings(self.tree)  # local name -> dotted target

    def bindings(self, scope: ast.AST) -> dict[str, str]:
        """Local name -> dotted target of every import under `scope` (relative ones made absolute)."""
        out: dict[str, str] = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.Import):
                for a in node.names:
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = self.name.split(".") if self.is_pkg else self.name.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([node.module] if node.module else []))
                for a in node.names:
                    out[a.asname or a.name] = f"{base}.{a.name}"
        return out


class Index:
    def __init__(self, root: Path, pkg: str):
        self.pkg = pkg
        self.modules: dict[str, Module] = {}
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            self.modules[".".join(parts)] = Module(".".join(parts), path)

    def resolve(self, dotted: str, depth: int = 0) -> tuple[str, str] | None:
        """A dotted name -> (module, qualname) of the def it names ("" for a module), or None."""
        if dotted in self.modules:
            return dotted, ""
        if "." not in dotted or depth > 8 or dotted.split(".")[0] != self.pkg:
            return None
        owner, name = dotted.rsplit(".", 1)
        found = self.resolve(owner, depth + 1)
        if found is None:
            return None
        mod, qual = found
        m = self.modules[mod]
        if not qual:
            if name in m.defs:
                return mod, name
            return self.resolve(m.imports[name], depth + 1) if name in m.imports else None
        if isinstance(m.defs.get(qual), ast.ClassDef):
            for cmod, cls in self.mro(mod, qual):
                if f"{cls}.{name}" in self.modules[cmod].defs:
                    return cmod, f"{cls}.{name}"
        return None

    def mro(self, mod: str, cls: str, depth: int = 0) -> list[tuple[str, str]]:
        """The class and its package bases, depth first."""
        out = [(mod, cls)]
        node = self.modules[mod].defs[cls]
        for base in node.bases if depth < 8 else []:
            found = self.resolve_expr(base, mod, {})
            if found and isinstance(self.modules[found[0]].defs.get(found[1]), ast.ClassDef):
                out += self.mro(*found, depth + 1)
        return out

    def resolve_expr(self, expr: ast.AST, mod: str, local: dict[str, str]) -> tuple[str, str] | None:
        """A name or attribute chain in module `mod` (with function-local bindings) -> its def."""
        attrs: list[str] = []
        while isinstance(expr, ast.Attribute):
            attrs.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        m = self.modules[mod]
        head = local.get(expr.id) or m.imports.get(expr.id)
        if head is None and expr.id in m.defs:
            head = f"{mod}.{expr.id}"
        return self.resolve(".".join([head, *attrs])) if head else None


def chain_base(expr: ast.AST) -> str | None:
    """The name at the bottom of an attribute/subscript chain (`run` in `run.cfg.model[0]`)."""
    while isinstance(expr, ast.Attribute | ast.Subscript):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def carries(expr: ast.AST, tracked: set[str], calls: bool = False) -> bool:
    """Whether `expr` is (a chain of) a tracked name, a branch of one, or with `calls` a call taking one."""
    if isinstance(expr, ast.IfExp):
        return carries(expr.body, tracked, calls) or carries(expr.orelse, tracked, calls)
    if isinstance(expr, ast.BoolOp):
        return any(carries(v, tracked, calls) for v in expr.values)
    if calls and isinstance(expr, ast.Call):  # nested: `Parts(Trainer(plan), 3)` holds the plan
        return any(carries(a, tracked, calls) for a in [*expr.args, *(k.value for k in expr.keywords)])
    if isinstance(expr, ast.Starred):
        return False
    chain = isinstance(expr, ast.Attribute | ast.Subscript | ast.Name)
    return chain and chain_base(expr) in tracked


def pairs(targets: list[ast.AST], value: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, value) of an assignment, element by element where a tuple meets a tuple
    (`a, b = x.a, x.b`)."""
    out = []
    for t in targets:
        if isinstance(t, ast.Tuple) and isinstance(value, ast.Tuple) and len(t.elts) == len(value.elts):
            out += list(zip(t.elts, value.elts, strict=True))
        else:
            out.append((t, value))
    return out


def params_of(fn: FuncDef) -> tuple[list[str], set[str], str | None, str | None]:
    a = fn.args
    return (
        [p.arg for p in a.posonlyargs + a.args],
        {p.arg for p in a.kwonlyargs},
        *((v.arg if v else None) for v in (a.vararg, a.kwarg)),
    )


class Walk:
    def __init__(self, index: Index, rows: dict[str, int]):
        self.index, self.rows = index, rows
        self.stops: dict[str, None] = {}  # "module:qual", in the order reached
        self.edges: dict[tuple[str, str], None] = {}
        self.unresolved: set[tuple[str, int, int]] = set()
        self.seen: set[tuple[str, str, str]] = set()
        self.returns: dict[str, None] = {}  # functions that return the value (or a record holding it)

    def row(self, mod: str) -> int | None:
        parts = mod.split(".")
        return self.rows.get(parts[1]) if len(parts) > 1 else None

    def run(self, mod: str, qual: str, param: str) -> None:
        todo = [(mod, qual, param)]
        while todo:
            state = todo.pop(0)  # breadth first: stops listed by distance from the start
            if state in self.seen:
                continue
            self.seen.add(state)
            mod, qual, param = state
            self.stops.setdefault(f"{mod}:{qual}")
            fn = self.index.modules[mod].defs.get(qual)
            if isinstance(fn, FuncDef):
                todo += self.calls_from(mod, qual, fn, param)

    def calls_from(self, mod: str, qual: str, fn: FuncDef, param: str) -> list[tuple[str, str, str]]:
        m = self.index.modules[mod]
        local = m.bindings(fn)
        cls = qual.split(".")[0] if "." in qual else None
        tracked, types = {param}, {}
        for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
            if found := self.class_of(a.annotation, mod, local):
                types[a.arg] = found
        out = []
        nodes = (n for n in ast.walk(fn) if hasattr(n, "col_offset"))
        for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
            if isinstance(node, ast.Return) and node.value is not None:
                if carries(node.value, tracked, calls=True):
                    self.returns.setdefault(f"{mod}:{qual}")
            elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target, value in pairs(targets, node.value):
                    # a name bound, or the object an attribute is stored on (`self.plan = plan`,
                    # `parts.model = m`): that object holds the value from here on (a record)
                    names = [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
                    if carries(value, tracked, calls=True):
                        tracked.update(names)
                    if isinstance(target, ast.Name) and (found := self.field_type(value, types, mod)):
                        types[target.id] = found  # `trainer = parts.trainer`: RunParts's `trainer: Trainer`
                if isinstance(node.value, ast.Call) and len(names) == 1:
                    if found := self.class_of(node.value.func, mod, local, returns=True):
                        types[names[0]] = found
            elif isinstance(node, ast.Call):
                out += self.follow(node, mod, qual, cls, local, tracked, types)
        return out

    def field_type(self, value: ast.AST, types: dict, mod: str) -> tuple[str, str] | None:
        """The class of `obj.field` where `obj`'s class is known and annotates `field` in its body
        (a dataclass record's field: `RunParts.trainer: Trainer`)."""
        if not (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name)):
            return None
        owner = types.get(value.value.id)
        if owner is None:
            return None
        for cmod, cls in self.index.mro(*owner):
            for item in self.index.modules[cmod].defs[cls].body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == value.attr:
                    return self.class_of(item.annotation, cmod, {})
        return None

    def class_of(
        self, expr, mod: str, local: dict[str, str], returns: bool = False
    ) -> tuple[str, str] | None:
        """The package class an annotation names (`A`, `A | None`); with `returns`, the class a callable
        makes: itself if a class, else its return annotation."""
        if isinstance(expr, ast.BinOp):
            return self.class_of(expr.left, mod, local) or self.class_of(expr.right, mod, local)
        found = self.index.resolve_expr(expr, mod, local) if expr is not None else None
        node = self.index.modules[found[0]].defs.get(found[1]) if found else None
        if returns and isinstance(node, FuncDef) and node.returns is not None:
            return self.class_of(node.returns, found[0], {})  # module bindings hold function-local ones too
        return found if isinstance(node, ast.ClassDef) else None

    def follow(self, call, mod, qual, cls, local, tracked, types) -> list[tuple[str, str, str]]:
        """The (module, qual, parameter) states a call passes the value into; records edges."""
        func, receiver_flows = call.func, False
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = func.value.id
            receiver_flows = base in tracked and (base in types or (base == "self" and cls))

        # an argument carries the value when it is (a chain of) a tracked name, or the result of a
        # package call that received one: a record packed with it (`fit(build(run))`), or what a
        # function returned (not a builtin's result: `len(cfg)`)
        def carried(arg: ast.AST) -> bool:
            if isinstance(arg, ast.Call) and self.index.resolve_expr(arg.func, mod, local) is not None:
                return carries(arg, tracked, calls=True)
            return carries(arg, tracked)

        flowing = [i for i, a in enumerate(call.args) if carried(a)]
        kws = [k.arg for k in call.keywords if k.arg and carried(k.value)]
        if not (flowing or kws or receiver_flows):
            return []
        target, bound = None, False
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = func.value.id
            if base == "self" and cls:
                target, bound = self.index.resolve(f"{mod}.{cls}.{func.attr}"), True
            elif base in types:
                target, bound = self.index.resolve(".".join([*types[base], func.attr])), True
        if target is None:
            target = self.index.resolve_expr(func, mod, local)
            if target and target[1] and "." in target[1]:  # Class.method named directly: unbound
                bound = False
        defs = self.index.modules[target[0]].defs if target else {}
        if target and isinstance(defs.get(target[1]), ast.ClassDef):  # a constructor: enter __init__
            init = self.index.resolve(f"{target[0]}.{target[1]}.__init__")
            target, bound = init or (target[0], f"{target[1]}.__init__"), True
            defs = self.index.modules[target[0]].defs
        if not target or not target[1]:
            self.unresolved.add((mod, call.lineno, call.col_offset))
            return []
        callee = defs.get(target[1])
        if not isinstance(callee, FuncDef):  # a generated __init__: a stop with no body
            self.edges.setdefault((f"{mod}:{qual}", f"{target[0]}:{target[1]}"))
            return [(target[0], target[1], "")]
        pos, kwonly, vararg, kwarg = params_of(callee)
        decos = {d.id for d in callee.decorator_list if isinstance(d, ast.Name)}
        self_name = None
        if "classmethod" in decos:
            pos = pos[1:]
        elif "." in target[1] and "staticmethod" not in decos:
            self_name, pos = (pos[0] if pos else None), (pos[1:] if bound else pos)
        names = {pos[i] if i < len(pos) else vararg for i in flowing}
        names |= {k if k in pos or k in kwonly else kwarg for k in kws}
        if receiver_flows and bound and self_name:
            names.add(self_name)
        names.discard(None)
        if not names:
            self.unresolved.add((mod, call.lineno, call.col_offset))
            return []
        self.edges.setdefault((f"{mod}:{qual}", f"{target[0]}:{target[1]}"))
        return [(target[0], target[1], n) for n in sorted(names)]

    def report(self) -> dict:
        climbs, descents = [], []
        for caller, callee in self.edges:
            a, b = self.row(caller.split(":")[0]), self.row(callee.split(":")[0])
            if a is not None and b is not None and a != b:
                (climbs if a > b else descents).append((caller, callee, a, b))
        files = {s.split(":")[0] for s in self.stops}
        return {
            "stops": len(self.stops),
            "files": len(files),
            "climbs": len(climbs),
            "descents": len(descents),
            "edges": len(self.edges),
            "unresolved": len(self.unresolved),
            "returns": len(self.returns),
            "_climbs": climbs,
            "_descents": descents,
        }


def layer_rows(root: Path) -> dict[str, int]:
    """Package -> row of the layer block (first row 0), read as tests/test_architecture.py reads it."""
    text = (root / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- layers -->\n```\n(.*?)```", text, re.S)
    if not block:
        raise SystemExit(f"{root}/docs/architecture.md has no '<!-- layers -->' block")
    rows = [re.findall(r"`([\w_]+)`", line) for line in block.group(1).splitlines()]
    return {name: i for i, names in enumerate(r for r in rows if r) for name in names}


def walk(root: Path, start: str, param: str) -> Walk:
    mod, _, qual = start.partition(":")
    index = Index(root, mod.split(".")[0])
    fn = index.modules[mod].defs.get(qual) if mod in index.modules else None
    if not isinstance(fn, FuncDef):
        raise SystemExit(f"no function {start} under {root}")
    pos, kwonly, vararg, kwarg = params_of(fn)
    if param not in {*pos, *kwonly, vararg, kwarg}:
        raise SystemExit(f"{start} has no parameter {param!r}")
    w = Walk(index, layer_rows(root))
    w.run(mod, qual, param)
    return w


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--list", action="store_true", help="print every stop and every climb/descent edge")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    ap.add_argument("start", help="module.path:function or module.path:Class.method")
    ap.add_argument("param")
    args = ap.parse_args(argv)
    w = walk(args.root.resolve(), args.start, args.param)
    r = w.report()
    nums = {k: v for k, v in r.items() if not k.startswith("_")}
    if args.json:
        print(json.dumps(nums))
        return 0
    print(f"{args.start} {args.param}: " + ", ".join(f"{v} {k}" for k, v in nums.items()))
    if args.list:
        print("stops:", *(f"  {s}" for s in w.stops), sep="\n")
        for kind in ("climbs", "descents"):
            edges = (f"  {a} -> {b} (row {ra} -> {rb})" for a, b, ra, rb in r[f"_{kind}"])
            print(f"{kind}:", *edges, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
