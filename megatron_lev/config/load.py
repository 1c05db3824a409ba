"""Loading a run config: YAML files merged left to right (with `include:`), dotted overrides, types.

    cfg = load_config(["pretrain/configs/tiny.yaml"], ["model.embedding=tied", "train.lr=1e-3"])

Unknown keys are refused with a suggestion, every value is coerced to its field's type or refused
in one line naming the key, and `validate=True` runs the generic rules (`RunConfig.validate`).
`set_dotted` is the one setter of a dotted key in a tree of dicts (overrides here, DeepSpeed
JSON in `plan.ds_config`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_lev.config.ranges import join
from megatron_lev.config.run import RunConfig
from megatron_lev.errors import ConfigError
from megatron_lev.resources import config_path


def load_config(
    paths: str | os.PathLike | list | None = None,
    overrides: list[str] | None = None,
    validate: bool = True,
) -> RunConfig:
    """Merge YAML files (later wins), apply dotted overrides, type-check, validate (the generic
    rules; `validate=False` leaves that to the caller, e.g. `plan.validate_run`). The rules of a
    world size (the layout, the batch over data parallelism) are the plan's: `plan.validate_config`.

    A path that does not exist is looked up among the packaged configs (`tiny.yaml`,
    `pretrain/configs/models/200m.yaml`): see `megatron_lev.resources`.
    """
    if paths is None:
        paths = []
    elif isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    merged: dict[str, Any] = {}
    for path in paths:
        _deep_merge(merged, _read_tree(config_path(path), ()))
    given = set()
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(merged, key, value)
        given.add(key)
    cfg = from_dict(RunConfig, merged, prefix="")
    _check_length_override(cfg, given)
    if validate:
        cfg.validate()
    return cfg


def _check_length_override(cfg: RunConfig, given: set[str]) -> None:
    """An override of train.train_iters that a token budget of the config file would silently outrank
    (training/schedule.py: chinchilla, then train_tokens, then train_iters) is refused."""
    t = cfg.train
    if "train.train_iters" not in given or t.train_iters is None:
        return
    if t.chinchilla and "train.chinchilla" not in given:
        raise ConfigError(
            f"train.train_iters={t.train_iters} would be ignored: the config sets train.chinchilla=true, "
            "which decides the run's length; add train.chinchilla=false"
        )
    if t.train_tokens is not None and "train.train_tokens" not in given:
        raise ConfigError(
            f"train.train_iters={t.train_iters} would be ignored: the config sets "
            f"train.train_tokens={t.train_tokens}, which decides the run's length; add "
            "train.train_tokens=null (or give the length as train.train_tokens)"
        )


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (YAML would keep the last
    silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice in the same mapping; keep one",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, included_by: Path | None = None) -> dict:
    """The top-level mapping of one YAML file; every way it can be unusable is one line naming it."""
    where = f"{path} (included by {included_by})" if included_by else str(path)
    if path.is_dir():
        raise ConfigError(f"{where} is a directory: give a YAML config file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if included_by:
            raise ConfigError(
                f"{included_by}: included file not found: {path}; fix the 'include' entry "
                "(relative paths are relative to the including file)"
            ) from None
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(
            f"{where}: cannot read the config file ({exc.strerror}); check the path and its permissions"
        ) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{where} is not a UTF-8 text file (byte 0x{raw[exc.start]:02x} at offset {exc.start}): "
            "give a YAML config file"
        ) from None
    if "\0" in text:
        raise ConfigError(f"{where} is binary (it contains NUL bytes): give a YAML config file")
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(exc.problem or exc.context or "syntax error").split())
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: invalid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        raise ConfigError(
            f"{where} is empty: give config sections such as 'model:' and 'train:', or leave the file out"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _read_tree(path: Path, chain: tuple[Path, ...], included_by: Path | None = None) -> dict:
    """One file's mapping merged over its includes (earlier includes first, the file itself last).

    `chain` holds the files that include this one, so a cycle is named instead of recursing forever.
    """
    data = _read_yaml(path, included_by)
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) and i.strip() for i in includes):
        raise ConfigError(f"{path}: 'include' must be a file name or a list of file names, got {includes!r}")
    merged: dict[str, Any] = {}
    stack = (*chain, path)
    for inc in includes:
        target = path.parent / inc
        if any(_same_file(target, p) for p in stack):
            cycle = " -> ".join(str(p) for p in (*stack, target))
            raise ConfigError(f"include cycle: {cycle}; remove the include that closes the loop")
        _deep_merge(merged, _read_tree(target, stack, included_by=path))
    return _deep_merge(merged, data)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def parse_override(item: str) -> tuple[str, Any]:
    """`model.lev.k=4` -> ("model.lev.k", 4); values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. model.embedding=lev")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or "." not in key:
        raise ConfigError(f"override {item!r}: the key must be dotted, e.g. train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def from_dict(cls, data: Any, prefix: str):
    """Build dataclass `cls` from a mapping, checking keys and types; errors name the key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {type(data).__name__}: {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"; did you mean '{join(prefix, close[0])}'?" if close else ""
        raise ConfigError(
            f"unknown config key '{join(prefix, key)}'{hint} (allowed: {', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, join(prefix, name))
    return cls(**kwargs)


def _coerce(tp, value, key):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for arg in non_none:
            try:
                return _coerce(arg, value, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin is list:
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__}: {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        ):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value


def _deep_merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v
    return dst


def set_dotted(tree: dict, key: str, value: Any, what: str = "override") -> None:
    """`tree["a"]["b"]["c"] = value` for `key="a.b.c"`, making the sections on the way; a part that
    holds a value instead of a section is a ConfigError naming `what` and the key."""
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{what} {key}: '{part}' is a value, not a section")
        node = nxt
    node[parts[-1]] = value
