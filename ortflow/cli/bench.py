"""`ortflow-bench`: one recipe in every accel mode (accel=compile, torch.compile's engine, too), modes alternating,
repeated.

Reports per mode: samples/s (median and min-max over repeats) and its ratio to eager measured in the same run,
time to first step (export + session creation; ORTModule's extension build excluded), peak resident memory,
model FLOP utilisation against a matmul peak measured in the same run, and the runner's overhead two ways: "vs
bare" compares ortflow's loop with a bare hand-written loop on the same engine (alternating pairs; as noisy as
two timings), "outside" is the time ortflow's loop spends outside the engine's calls, relative to the time inside
them, measured in the same steps. A benchmark, not a test: it asserts no speed.

Each measurement runs in its own process and times about --budget seconds of steps, however large the model:
the first step (export, session creation, compilation) and a few warm-up steps are left out, single steps are
timed until the step time is known, and that decides how many steps fit (--steps N fixes the count instead).
The JSON file is rewritten after every measurement with everything so far, so a stopped bench keeps what it
finished and `--resume FILE` runs only the rest. Other libraries' notices go to a log beside it (FILE.log).

    ortflow-bench                                    # transformer recipe: none, ortmodule, artifacts, compile
    ortflow-bench model.d_model=512 model.num_layers=4 data.block_size=128 data.batch_size=16
    ortflow-bench --modes none,compile --budget 20 --repeats 3   # eager against torch.compile, longer
    ortflow-bench --sweep model.d_model=128,256,512 model.num_layers=4   # scaling with model width: table, PNG
    ortflow-bench --sweep model.d_model=64,128,256 --sweep data.batch_size=16,32,64   # one PNG, a panel per sweep
    ortflow-bench --resume outputs/bench/2026-11-24_10-00-00.json   # continue a stopped bench
    ortflow-bench --precision fp32,bf16-mixed        # every mode in each precision (trainer.precision)
    ortflow-bench --workload gpt2-124m --precision bf16-mixed   # a named size (d512, gpt2-124m, qwen2-lora)
    ortflow-bench --recipe none model=hf model.model_type=gpt2 ++model.config.n_layer=4   # any model=hf or
                                                     # model=custom config: no recipe, the overrides say it all
    ortflow-bench --profile                          # top operators per step: ORT's profiler beside torch.profiler
    ortflow-bench --modes 'none,ortmodule,ortmodule:accel.rewrite_gathers=false;accel.allow_spinning=true'
                                                     # a mode with its own overrides: before/after in one run
"""

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ortflow.bench.plan import DEFAULT_MODES, MODES, known_modes
from ortflow.bench.workloads import WORKLOADS
from ortflow.bench.workloads import help_text as workloads_help
from ortflow.config import BF16, FP32
from ortflow.errors import OrtflowError

_AddArgument = Callable[..., None]  # argparse's add_argument, with the default left out where defaults are off


def _parser(defaults: bool = True) -> argparse.ArgumentParser:
    """The command line; with defaults=False, an option left out is absent from the result (what --resume compares
    against the bench it continues)."""
    p = argparse.ArgumentParser(
        prog="ortflow-bench",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
        argument_default=None if defaults else argparse.SUPPRESS,
    )

    def arg(*names: str, default: Any = None, **kw: Any) -> None:
        p.add_argument(*names, **kw, **({"default": default} if defaults else {}))

    # In the order --help lists them.
    _add_subject(arg)
    _add_timing(arg)
    _add_variants(arg)
    _add_profiling(arg)
    _add_files(arg)
    arg("overrides", nargs="*", default=[], help="Hydra overrides applied to every run, e.g. model.num_layers=4")
    return p


def _add_subject(arg: _AddArgument) -> None:
    """What is measured: the recipe and the accel modes it runs in."""
    arg(
        "--recipe",
        default="transformer",
        help="recipe to benchmark (default: transformer); none: no recipe, for a model=hf or model=custom config "
        "given as overrides",
    )
    arg(
        "--workload",
        default=None,
        choices=sorted(WORKLOADS),
        metavar="NAME",
        help="a named model size instead of --recipe (overrides after it win):\n" + workloads_help(),
    )
    arg(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, from {','.join(MODES)} (default {','.join(DEFAULT_MODES)}); MODE:k=v;k2=v2 gives "
        "a mode its own overrides",
    )


def _add_timing(arg: _AddArgument) -> None:
    """How one measurement is timed: its budget of seconds, or its number of steps, and the warm-up before it."""
    arg(
        "--budget",
        type=float,
        metavar="SECONDS",
        default=10.0,
        help="seconds of timed steps per measurement (default 10); the first step, warm-up and start-up come on top",
    )
    arg(
        "--min-steps",
        type=int,
        metavar="N",
        default=2,
        help="timed steps per pass at least, however slow a step (default 2; a measurement times 4 passes: a bare "
        "loop and ortflow's loop, twice)",
    )
    arg(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="timed steps per pass, instead of choosing them from --budget",
    )
    arg("--warmup", type=int, default=2, metavar="N", help="untimed steps after the first one (default 2)")


def _add_variants(arg: _AddArgument) -> None:
    """Which measurements the bench repeats: each precision, each repeat and each value of a sweep."""
    arg(
        "--precision",
        default=None,
        metavar="P1,P2",
        help="measure every mode in each of these trainer.precision values (fp32, bf16-mixed); the table gives each "
        "mode's ratio to eager fp32 and to eager in the same precision",
    )
    arg("--repeats", type=int, default=2, metavar="N", help="measurements per mode, modes alternating (default 2)")
    arg(
        "--sweep",
        action="append",
        metavar="KEY=V1,V2",
        default=[],
        help="repeat everything for each value (scaling); may be given more than once; writes a PNG",
    )


def _add_profiling(arg: _AddArgument) -> None:
    """Profiling instead of timing: whether to profile, and how many operators to show."""
    arg(
        "--profile",
        action="store_true",
        default=False,
        help="instead of timing: each mode's top operators per step, ORT's profiler beside torch.profiler",
    )
    arg("--top", type=int, default=10, metavar="N", help="operators shown per mode with --profile (JSON keeps all)")


def _add_files(arg: _AddArgument) -> None:
    """Where the results go: the JSON file to write, or the one whose bench to continue."""
    arg(
        "--out",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSON file (default: outputs/bench/<time>.json; its log beside it)",
    )
    arg(
        "--resume",
        type=Path,
        default=None,
        metavar="FILE",
        help="continue the bench in this JSON file, with its arguments",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: positive counts, --sweep as KEY=V1,V2, overrides as KEY=VALUE, known modes."""
    p = _parser()
    args = p.parse_intermixed_args(argv)
    if args.workload is not None and "recipe" in vars(_parser(defaults=False).parse_intermixed_args(argv)):
        p.error(f"--workload {args.workload} names its own recipe: leave --recipe out (or use --recipe with overrides)")
    for name in ("budget", "min_steps", "warmup", "repeats", "steps", "top"):
        value = getattr(args, name)
        if value is not None and (value < 0 if name == "warmup" else value <= 0):
            p.error(f"--{name.replace('_', '-')} {value}: must be {'>= 0' if name == 'warmup' else '> 0'}")
    for sweep in args.sweep:
        key, eq, values = sweep.partition("=")
        if not key or not eq or not all(values.split(",")):
            p.error(f"--sweep {sweep}: expected KEY=V1,V2,... (e.g. --sweep model.d_model=128,256,512)")
    for override in args.overrides:
        if "=" not in override and not override.startswith("~"):
            p.error(f"{override}: overrides are KEY=VALUE (e.g. model.num_layers=4); --sweep takes KEY=V1,V2,...")
    if args.precision and (wrong := [p for p in args.precision.split(",") if p not in (FP32, BF16)]):
        p.error(f"--precision: unknown precision(s) {wrong}; choose from {FP32},{BF16}")
    try:  # ortflow's engines and those of the search path the overrides add
        known = known_modes(args.overrides)
    except OrtflowError as err:
        p.error(str(err))
    unknown = sorted({m for m in args.modes.split(",") if m.partition(":")[0] not in known})
    if unknown:
        p.error(f"--modes: unknown mode(s) {unknown}; choose from {','.join(known)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # With --resume, the options given beside it (none defaulted): they must agree with the bench's own.
    given = vars(_parser(defaults=False).parse_intermixed_args(argv)) if args.resume else {}
    from ortflow.bench.session import run  # torch loads here: --help and a refused command line do not wait for it

    run(args, given)


if __name__ == "__main__":
    main()
