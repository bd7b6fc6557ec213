"""A malformed-input corpus generated from the schema: for every option, values just outside its declared range, a
value of the wrong type, and an empty value where a string may not be empty. Each is refused naming the key; through
the command (one case per schema and kind of value, and every empty string) it stops with exit status 2 (ortflow's
check) or 1 (Hydra's type check), prints no traceback, and changes no existing file."""

import dataclasses
import enum
import hashlib
import math
import typing

import pytest
from annotated_types import Ge, Gt, Interval, Le, Len, Lt

import ortflow
from ortflow.accel import artifacts, ortmodule
from ortflow.config import (
    CheckpointConfig,
    Config,
    DebugConfig,
    DigitsDataConfig,
    DistributedConfig,
    LoggerConfig,
    MLPModelConfig,
    OptimConfig,
    SchedulerConfig,
    TextDataConfig,
    TrainerConfig,
    TransformerModelConfig,
)
from ortflow.errors import ConfigError

DIGITS = ["model=mlp", "data=digits"]
# (overrides selecting the option, key prefix, its schema)
SCHEMAS = [
    ([], "model.", TransformerModelConfig),
    (DIGITS, "model.", MLPModelConfig),
    ([], "data.", TextDataConfig),
    (DIGITS, "data.", DigitsDataConfig),
    (["accel=ortmodule"], "accel.", ortmodule.Settings),
    (["accel=artifacts"], "accel.", artifacts.Settings),
    ([], "distributed.", DistributedConfig),
    (["accel=ortmodule"], "debug.", DebugConfig),
    ([], "optim.", OptimConfig),
    ([], "scheduler.", SchedulerConfig),
    ([], "trainer.", TrainerConfig),
    ([], "trainer.checkpoint.", CheckpointConfig),
    ([], "logger.", LoggerConfig),
    ([], "", Config),
]
# String options where an empty value is meaningless (elsewhere an empty string is a legitimate value).
EMPTY_STRINGS_REFUSED = {"data.source", "trainer.resume", "objective", "distributed.backend", "distributed.name"}


def _outside(constraint, is_int: bool) -> list:
    """Values just outside one constraint."""
    if isinstance(constraint, Len):
        out = [[0.5] * (constraint.max_length + 1)] if constraint.max_length is not None else []
        return out + ([[0.5] * (constraint.min_length - 1)] if constraint.min_length > 0 else [])
    step = 1 if is_int else 1e-6
    parts = (
        [constraint]
        if not isinstance(constraint, Interval)
        else [
            cls(getattr(constraint, op))
            for op, cls in (("gt", Gt), ("ge", Ge), ("lt", Lt), ("le", Le))
            if getattr(constraint, op) is not None
        ]
    )
    values = []
    for part in parts:
        if isinstance(part, Ge):
            values.append(part.ge - step)
        elif isinstance(part, Gt):
            values.append(part.gt)
        elif isinstance(part, Le):
            values.append(part.le + step)
        elif isinstance(part, Lt):
            values.append(part.lt)
    return values


def _fmt(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_fmt(v) for v in value) + "]"
    if isinstance(value, float) and not math.isnan(value):
        return repr(value)
    return str(value)


def _base_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args and typing.get_origin(annotation) is not list else annotation


def cases() -> list:
    found = []
    for select, prefix, schema in SCHEMAS:
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            key, kind = prefix + f.name, _base_type(hints[f.name])
            if f.name == "_target_" or dataclasses.is_dataclass(kind) or kind is typing.Any:
                continue
            is_list = typing.get_origin(kind) is list
            values = []
            for constraint in f.metadata.get("range", ()):
                values += [("outside", v) for v in _outside(constraint, kind is int)]
            if (each := f.metadata.get("each")) is not None:
                default = f.default_factory()
                values += [("outside", [v, *default[1:]]) for v in _outside(each, typing.get_args(kind)[0] is int)]
            if (
                kind in (int, float)
                or is_list
                or kind is bool
                or (isinstance(kind, type) and issubclass(kind, enum.Enum))
            ):
                values.append(("wrong-type", "abc"))  # an empty value fails the same type check
            elif key in EMPTY_STRINGS_REFUSED:
                values.append(("empty", ""))
            for what, value in values:
                found.append(pytest.param(select, key, _fmt(value), id=f"{key}-{what}-{_fmt(value)}"))
    return found


def _first_of_each_kind(cases: list) -> list:
    """One case per schema and kind of bad value (outside, wrong type, empty): the ones run through the command."""
    seen, first = set(), []
    for case in cases:
        select, key, _ = case.values
        kind = (tuple(select), key.rsplit(".", 1)[0] if "." in key else "", case.id.split("-")[1])
        if kind not in seen:
            seen.add(kind)
            first.append(case)
    return first


CASES = cases()
# The command's error path (exit status, no traceback, no file touched) is the same for every key: the command runs
# one case per schema and kind of bad value; every other case is composed and validated in-process (~3x faster), as
# the command composes it.
# Empty strings are refused where the value is used (data.source when the data is built), not by the schema: the
# command runs each of those.
EMPTY = [case for case in CASES if "-empty-" in case.id]
COMMAND_CASES = _first_of_each_kind([case for case in CASES if case not in EMPTY]) + EMPTY


def _files(root):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("select", "key", "value"), [case for case in CASES if case not in EMPTY])
def test_a_value_outside_its_option_is_refused_naming_its_key(select, key, value):
    with pytest.raises(ConfigError) as refused:
        ortflow.compose([*select, f"{key}={value}"])
    said = str(refused.value).split("do not compose into a config:")[-1]  # not the overrides echoed back
    assert key in said, str(refused.value)


@pytest.mark.parametrize(("select", "key", "value"), COMMAND_CASES)
def test_a_value_outside_its_option_gets_a_clear_error(select, key, value, tmp_path, ortflow_cli):
    (tmp_path / "keep.txt").write_text("an existing file")
    before = _files(tmp_path)
    status, stderr = ortflow_cli(*select, f"{key}={value}", "logger.progress=false", cwd=tmp_path)
    assert status in (1, 2), f"{key}={value} was accepted (exit {status})"
    assert key in stderr, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    after = _files(tmp_path)
    assert {p: after.get(p) for p in before} == before
