"""The allowed values of a config key, written beside the key: `field(metadata=...)` of its section.

    num_layers: int = ranged(2, count(cap=4 * K))     # an integer >= 1 and <= 4096
    name: str | None = nonempty(None)                  # when given, not an empty string

Each section's `validate` calls `check_fields(self, "model")`, which refuses a value outside its
`Range` (or an empty string where a name is needed) in one line naming the dotted key. Every
int/float field of every section carries a range: `field_ranges` and `numeric_fields` let a test
check that none is missing.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from megatron_lev.errors import ConfigError

RANGE = "range"  # the metadata key of a field's `Range`
NONEMPTY = "nonempty"  # the metadata key of a string that, when given, must not be empty


@dataclass(frozen=True)
class Range:
    """The allowed values of one numeric key: finite, between `lo` and `hi` (None: unbounded)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # True: lo itself is not allowed
    hi_open: bool = False
    why: str = ""  # what the key is, shown with the error
    cap: float | None = None  # a sanity bound far above any real run (refuses typos and absurd values)

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        if self.cap is not None and value > self.cap:
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def text(self) -> str:
        lo, hi = _number(self.lo), _number(self.hi)
        cap = f" and <= {_number(self.cap)}" if self.cap is not None else ""
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}{cap}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {lo}{cap}"
        return f"{'<' if self.hi_open else '<='} {hi}" if self.hi is not None else f"finite{cap}"


def _number(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else f"{x:g}" if x is not None else ""


def count(why: str = "", lo: int = 1, cap: int | None = None) -> Range:
    """An integer range from `lo` (a size, a count, an interval)."""
    return Range(lo, why=why, cap=cap)


FRACTION = Range(0, 1, hi_open=True)  # dropout, warmup fraction, Adam betas
SEED = Range(0, 2**32 - 1, why="seeds of numpy and torch")
# Upper bounds: far above any model this code trains (the 1.2B config has hidden 2048, 16 layers,
# sequences of 2048; the largest published dense models have hidden < 30,000, fewer than 200
# layers, vocabularies of about 256k), so they refuse only typos and absurd values, e.g. a
# hidden size of 2^20 (a 1e12-parameter layer) or an LR of 1e9. The memory estimate
# (`plan.memory`) judges what fits in between.
K, M = 1024, 1024 * 1024


def ranged(default: Any, rule: Range) -> Any:
    """A numeric field with its default and allowed values (None, where the type allows it, passes)."""
    return field(default=default, metadata={RANGE: rule})


def nonempty(default: str | None) -> Any:
    """A string field that names a file, directory or run: when given, it must not be empty."""
    return field(default=default, metadata={NONEMPTY: True})


def check_fields(section: Any, prefix: str) -> None:
    """Refuse a value of `section`'s own fields (keys `prefix.<name>`) outside its range, then an empty
    string where a name is needed. Nested sections check themselves."""
    fields = dataclasses.fields(section)
    for f in fields:
        rule = f.metadata.get(RANGE)
        value = getattr(section, f.name)
        if rule is None or value is None or rule.contains(value):
            continue
        kind = "an integer" if isinstance(value, int) else "a finite number"
        why = f" ({rule.why})" if rule.why else ""
        raise ConfigError(f"{prefix}.{f.name}={value!r} is out of range: must be {kind} {rule.text()}{why}")
    for f in fields:
        value = getattr(section, f.name)
        if f.metadata.get(NONEMPTY) and value is not None and not str(value).strip():
            raise ConfigError(
                f"{prefix}.{f.name} is an empty string: give a value, or null to leave it unset"
            )


def field_ranges(cls: type, prefix: str = "") -> dict[str, Range]:
    """`{dotted key: Range}` of every ranged field of `cls` and its nested sections."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Range] = {}
    for f in dataclasses.fields(cls):
        key = join(prefix, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(field_ranges(hints[f.name], key))
        elif RANGE in f.metadata:
            out[key] = f.metadata[RANGE]
    return out


def numeric_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every int/float field of `cls` and its nested sections (scalars: a list of
    numbers, such as `logging.profile_steps`, is checked by its section's `validate`)."""
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        key = join(prefix, name)
        args = [a for a in (typing.get_args(tp) or (tp,)) if a is not type(None)]
        if dataclasses.is_dataclass(tp):
            keys += numeric_fields(tp, key)
        elif typing.get_origin(tp) in (list, tuple):
            continue
        elif any(a in (int, float) for a in args):
            keys.append(key)
    return keys


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else str(name)
