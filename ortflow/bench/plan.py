"""What a bench measures, in order: every mode (each in every --precision) in every --sweep setting, the modes
alternating over the repeats; each measurement's config, all of them checked before the first runs."""

import argparse
from dataclasses import dataclass
from typing import Any

from ortflow import accel
from ortflow.bench.workloads import subject
from ortflow.config import FP32
from ortflow.paths import search_dirs

# Every accel mode that trains itself (conf/accel/), eager first; accel=compile among them (its compilation lands in
# the first step, outside the timed steps, and inductor's cache makes the repeats compile in seconds).
DEFAULT_MODES = MODES = tuple(accel.engines())


def known_modes(overrides: list[str]) -> tuple[str, ...]:
    """The modes a bench with these overrides can measure: ortflow's engines and those of the config directories
    the overrides put on Hydra's search path (`--modes none,mine`)."""
    return tuple(accel.engines(search_dirs(overrides)))


@dataclass(frozen=True)
class Measurement:
    """One worker process of the bench: a mode in a setting, the `repeat`-th time (1-based)."""

    index: int  # position in the plan, 1-based
    setting: str  # "key=value" of a --sweep, or "-"
    mode: str
    repeat: int
    repeats: int

    def key(self) -> tuple[str, str, int]:
        return self.setting, self.mode, self.repeat

    def label(self) -> str:
        where = "" if self.setting == "-" else f"{self.setting}: "
        return f"{where}{self.mode}, repeat {self.repeat}/{self.repeats}"


def plan(args: argparse.Namespace) -> list[Measurement]:
    """Every measurement of the bench in the order they run: per setting, the modes alternate, each repeat
    starting one mode later (no mode always runs first); --profile measures each mode once."""
    modes = mode_specs(args)
    repeats = 1 if args.profile else args.repeats
    out = []
    for setting in settings_of(args):
        for repeat in range(repeats):
            for mode in modes[repeat % len(modes) :] + modes[: repeat % len(modes)]:
                out.append(Measurement(len(out) + 1, setting, mode, repeat + 1, repeats))
    return out


def mode_specs(args: argparse.Namespace) -> list[str]:
    """--modes, each in every --precision: `mode` for fp32 (or no --precision), `mode:trainer.precision=P` else."""
    modes = args.modes.split(",")
    precisions = args.precision.split(",") if args.precision else [FP32]
    specs = []
    for precision in precisions:
        for mode in modes:
            if precision == FP32:
                specs.append(mode)
            else:
                specs.append(f"{mode}{';' if ':' in mode else ':'}trainer.precision={precision}")
    return specs


def settings_of(args: argparse.Namespace) -> list[str]:
    """Each --sweep KEY=V1,V2 as KEY=V1, KEY=V2 (the sweeps one after another, not crossed), or "-" without."""
    settings = [f"{key}={v}" for key, _, values in (x.partition("=") for x in args.sweep) for v in values.split(",")]
    return settings or ["-"]


def mode_config(spec: str, overrides: list[str]) -> Any:
    """The config of mode `spec` (a mode, optionally with its own overrides: `ortmodule:k=v;k2=v2`) on top of
    `overrides`."""
    from ortflow.paths import compose_config

    mode, _, own = spec.partition(":")
    settings = [*overrides, f"accel={mode}", *filter(None, own.split(";"))]
    cfg = compose_config([*settings, "logger.progress=false"])
    if "verify" in cfg.accel and not any(s.startswith(("accel.verify=", "verify=")) for s in settings):
        cfg.accel.verify = False  # the bench times steps; the first-step check is a run's start (ortmodule:verify=true)
    return cfg


def overrides_for(args: argparse.Namespace, setting: str) -> list[str]:
    return [*subject(args.recipe, args.workload), *args.overrides, *([setting] if setting != "-" else [])]


def check_configs(args: argparse.Namespace) -> None:
    """Compose and validate every setting x mode's config before any measurement: a typo in an override fails
    here, in a second, instead of in every worker.

    Raises:
        SystemExit: a config does not compose or validate (the message names the setting and mode)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ortflow.api import register_configs
    from ortflow.errors import OrtflowError
    from ortflow.validate import validate

    register_configs()
    for setting in settings_of(args):
        for spec in mode_specs(args):
            try:
                validate(mode_config(spec, overrides_for(args, setting)))
            except (OrtflowError, HydraException, OmegaConfBaseException) as err:
                where = f"{'' if setting == '-' else setting + ', '}mode {spec}"
                raise SystemExit(f"ortflow-bench: error: {where}: {err}") from None
