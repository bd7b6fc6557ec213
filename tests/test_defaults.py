"""Defaults in one place: the structured configs (ortflow/config.py, each engine's Settings) are the source, and a
YAML file that repeats a default says the same value. For every option that has a schema of its own (each model,
data, loss and peft option, each accel engine) every key its YAML gives is compared; for the groups with one schema
for all their options (trainer, optim, scheduler, logger, distributed, debug), the option config.yaml selects."""

import dataclasses
from enum import Enum
from typing import Any

import pytest
from omegaconf import MISSING, OmegaConf

from ortflow import accel, config
from ortflow.paths import config_dir

CONF = config_dir()
SHARED = {f.name: f.type for f in dataclasses.fields(config.Config) if dataclasses.is_dataclass(f.type)}
SELECTED = {  # config.yaml's defaults list: the option each group starts from
    next(iter(entry)): next(iter(entry.values()))
    for entry in OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["defaults"]
    if isinstance(entry, dict) and "override" not in next(iter(entry))
}


def _cases() -> list[tuple[str, str, type]]:
    cases = []
    for group, schemas in config._SCHEMAS.items():
        cases += [
            (group, name, schema) for name, schema in schemas.items() if (CONF / group / f"{name}.yaml").is_file()
        ]
    cases += [("accel", name, module.Settings) for name, module in _engines().items()]
    cases += [(group, str(SELECTED[group]), schema) for group, schema in SHARED.items() if group in SELECTED]
    return cases


def _engines() -> dict[str, Any]:
    found = dict(accel.engines())
    found["auto"] = accel.engine_module(OmegaConf.load(CONF / "accel" / "auto.yaml"))
    return found


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _differences(given: Any, defaults: Any, path: str) -> list[str]:
    found = []
    for key, value in given.items():
        if key in ("defaults", "_target_") or key not in defaults:
            continue
        want = defaults[key]
        if isinstance(value, dict) and isinstance(want, dict):
            found += _differences(value, want, f"{path}{key}.")
        elif isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation wires the key to another (model.vocab_size from data's): not a default
        elif want != MISSING and _plain(value) != _plain(want):
            found.append(f"{path}{key}: the YAML says {value!r}, the schema {want!r}")
    return found


@pytest.mark.parametrize(("group", "option", "schema"), _cases(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_yaml_default_says_what_its_schema_says(group, option, schema):
    given = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))
    defaults = OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True)
    assert not _differences(given, defaults, f"conf/{group}/{option}.yaml: "), _differences(given, defaults, "")
