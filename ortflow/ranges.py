"""Valid ranges declared with the keys, and the one generic check that enforces them.

A schema field declares its range where it is declared, with annotated-types' constraint objects (the vocabulary
pydantic uses): `lr: float = ranged(1e-3, Gt(0))`, `betas: list[float] = ranged([0.9, 0.999], Len(2, 2),
each=Interval(ge=0, lt=1))`. `problems(cfg)` walks a composed config, finds every node whose schema declares ranges
and reports every value outside them at once (NaN is outside every range). None passes: a null value means "off"
wherever the schema allows it.
"""

import dataclasses
import math
from typing import Any

from annotated_types import Ge, Gt, Interval, Le, Len, Lt
from omegaconf import DictConfig, ListConfig, OmegaConf

Constraint = Ge | Gt | Le | Lt | Interval | Len


def ranged(default: Any, *constraints: Constraint, each: Constraint | None = None) -> Any:
    """A dataclass field with `default` and its valid range (`each`: the range of every element of a list)."""
    metadata = {"range": constraints, "each": each}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _bounds(constraint: Constraint) -> list[tuple[str, Any]]:
    if isinstance(constraint, Interval):
        return [(op, getattr(constraint, op)) for op in ("gt", "ge", "lt", "le") if getattr(constraint, op) is not None]
    if isinstance(constraint, Len):
        return [("min_length", constraint.min_length), ("max_length", constraint.max_length)]
    op = type(constraint).__name__.lower()
    return [(op, getattr(constraint, op))]


_SYMBOL = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def describe(constraints: tuple[Constraint, ...]) -> str:
    """'>= 0 and < 1', 'a list of exactly 2'..."""
    parts = []
    for constraint in constraints:
        if isinstance(constraint, Len):
            low, high = constraint.min_length, constraint.max_length
            parts.append(f"a list of exactly {low}" if low == high else f"a list of {low} to {high} items")
        else:
            parts += [f"{_SYMBOL[op]} {bound}" for op, bound in _bounds(constraint)]
    return " and ".join(parts)


def _inside(value: Any, constraint: Constraint) -> bool:
    if isinstance(constraint, Len):
        high = constraint.max_length
        return constraint.min_length <= len(value) and (high is None or len(value) <= high)
    if isinstance(value, float) and math.isnan(value):
        return False
    checks = {"gt": value.__gt__, "ge": value.__ge__, "lt": value.__lt__, "le": value.__le__}
    return all(checks[op](bound) for op, bound in _bounds(constraint))


def _check(key: str, value: Any, spec: dict[str, Any]) -> list[str]:
    if value is None:
        return []
    constraints, each = spec.get("range", ()), spec.get("each")
    if isinstance(value, ListConfig | list):
        items = list(value)
        found = (
            [] if all(_inside(items, c) for c in constraints) else [f"{key}={items}: must be {describe(constraints)}."]
        )
        if each is not None and not all(isinstance(v, int | float) and _inside(v, each) for v in items):
            found.append(f"{key}={items}: every item must be {describe((each,))}.")
        return found
    if not isinstance(value, int | float) or isinstance(value, bool):
        return []
    if all(_inside(value, c) for c in constraints):
        return []
    return [f"{key}={value}: must be {describe(constraints)}."]


def problems(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Every value in `cfg` outside the range its schema declares, as 'key=value: must be ...'."""
    found: list[str] = []
    schema = OmegaConf.get_type(cfg)
    specs = {f.name: f.metadata for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    for key in cfg:
        node = cfg._get_node(key)
        if isinstance(node, DictConfig):
            found += problems(node, f"{prefix}{key}.")
        elif key in specs and "range" in specs[key]:
            found += _check(f"{prefix}{key}", cfg[key], specs[key])
    return found
