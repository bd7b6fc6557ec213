"""`ortflow-bench`: one recipe in every accel mode (torch.compile on request), modes alternating, repeated.

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

    ortflow-bench                                    # transformer recipe: none, ortmodule, artifacts; 2 repeats
    ortflow-bench model.d_model=512 model.num_layers=4 data.block_size=128 data.batch_size=16
    ortflow-bench --modes none,ortmodule,artifacts,compile --budget 20 --repeats 3   # longer, torch.compile too
    ortflow-bench --sweep model.d_model=128,256,512 model.num_layers=4   # scaling with model width: table, PNG
    ortflow-bench --sweep model.d_model=64,128,256 --sweep data.batch_size=16,32,64   # one PNG, a panel per sweep
    ortflow-bench --resume outputs/bench/2026-11-24_10-00-00.json   # continue a stopped bench
    ortflow-bench --precision fp32,bf16-mixed        # every mode in each precision (trainer.precision)
    ortflow-bench --profile                          # top operators per step: ORT's profiler beside torch.profiler
    ortflow-bench --modes 'none,ortmodule,ortmodule:accel.rewrite_gathers=false;accel.allow_spinning=true'
                                                     # a mode with its own overrides: before/after in one run
"""

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ortflow import machine
from ortflow.bench.progress import Reporter
from ortflow.bench.summary import summarize
from ortflow.bench.tables import profile_table, short, table
from ortflow.config import BF16, FP32
from ortflow.report import terminal
from ortflow.report.plots import plot_scaling

# torch.compile is a reference point, not an accel mode: the eager engine around a compiled model. Not measured by
# default: its first step (compilation) costs 20-40 s a measurement on 2 cores at d_model 512.
MODES = ("none", "ortmodule", "artifacts", "compile")
DEFAULT_MODES = ("none", "ortmodule", "artifacts")
FORMAT = 1  # the JSON file's layout, for --resume


def matmul_peak_gflops(n: int = 1024, repeats: int = 20) -> dict[str, float]:
    """Best fp32 n x n matmul throughput on this machine in GFLOP/s, of torch and of ONNX Runtime (each with its
    default thread count): the peak model FLOP utilisation is measured against is the higher of the two, so that
    a runtime with faster matmuls cannot show more than 100%.

    Measured before and after the runs (main takes the higher): on a shared machine one short measurement can
    land in a slow moment."""
    import numpy as np
    import onnx
    import onnxruntime
    from onnx import TensorProto, helper

    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    torch_best = min(_timed(lambda: a @ b) for _ in range(repeats))
    spec = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [n, n]) for name in ("a", "b", "c")]
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul", spec[:2], spec[2:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=onnx.IR_VERSION_2023_5_5)
    with terminal.native_stderr("onnxruntime"):
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"a": a.numpy(), "b": b.numpy()}
    out = np.empty((n, n), np.float32)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("c", "cpu", 0, np.float32, [n, n], out.ctypes.data)
    for _ in range(3):
        session.run_with_iobinding(binding)
    ort_best = min(_timed(lambda: session.run_with_iobinding(binding)) for _ in range(repeats))
    return {"torch": 2 * n**3 / torch_best / 1e9, "onnxruntime": 2 * n**3 / ort_best / 1e9}


def bf16_matmul_peak_gflops(n: int = 1024, repeats: int = 20) -> float:
    """Best bf16 n x n matmul throughput of torch in GFLOP/s: the peak bf16-mixed rows' MFU is measured against."""
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    for _ in range(3):
        a @ b
    return 2 * n**3 / min(_timed(lambda: a @ b) for _ in range(repeats)) / 1e9


def _peaks_text(peaks: dict[str, float]) -> str:
    return ", ".join(f"{name} {gflops:.0f} GFLOP/s" for name, gflops in peaks.items())


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
    `overrides`; compile is the eager engine (the worker compiles the model)."""
    from ortflow.paths import compose_config

    mode, _, own = spec.partition(":")
    accel = "none" if mode == "compile" else mode
    return compose_config([*overrides, f"accel={accel}", *filter(None, own.split(";")), "logger.progress=false"])


def overrides_for(args: argparse.Namespace, setting: str) -> list[str]:
    return [f"+recipe={args.recipe}", *args.overrides, *([setting] if setting != "-" else [])]


def run_worker(args: argparse.Namespace, m: Measurement, log: Path) -> dict[str, Any]:
    """Measurement `m` in a fresh process whose output goes to `log`; its result, or {"error": ...}."""
    with tempfile.TemporaryDirectory(prefix="ortflow-bench-result-") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "ortflow.cli.bench_worker", "--result", str(result_file)]
        cmd += ["--budget", str(args.budget), "--min-steps", str(args.min_steps), "--warmup", str(args.warmup)]
        cmd += [*(["--steps", str(args.steps)] if args.steps else []), *(["--profile"] if args.profile else [])]
        cmd += [m.mode, *overrides_for(args, m.setting)]
        env = os.environ | {"ORTFLOW_BENCH_PARENT": str(os.getpid())}
        with open(log, "ab") as out:
            out.write(f"\n==== measurement {m.index}: {m.label()} ({' '.join(cmd[2:])})\n".encode())
            out.flush()
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
            out.write(f"==== pid {proc.pid}\n".encode())
            out.flush()
            try:
                code = proc.wait()
            except BaseException:  # the bench is being stopped: so is its measurement
                _stop(proc)
                raise
        with contextlib.suppress(OSError, ValueError):  # none, or cut short: the process was killed
            return json.loads(result_file.read_text())
    how = f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
    if code == -signal.SIGKILL:
        how += ": out of memory?"
    return {"mode": m.mode, "error": f"the measurement's process ended without a result ({how})"}


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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

    arg("--recipe", default="transformer", help="recipe to benchmark (default: transformer)")
    arg(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, from {','.join(MODES)} (default {','.join(DEFAULT_MODES)}); MODE:k=v;k2=v2 gives "
        "a mode its own overrides",
    )
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
    arg(
        "--profile",
        action="store_true",
        default=False,
        help="instead of timing: each mode's top operators per step, ORT's profiler beside torch.profiler",
    )
    arg("--top", type=int, default=10, metavar="N", help="operators shown per mode with --profile (JSON keeps all)")
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
    arg("overrides", nargs="*", default=[], help="Hydra overrides applied to every run, e.g. model.num_layers=4")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: positive counts, --sweep as KEY=V1,V2, overrides as KEY=VALUE, known modes."""
    p = _parser()
    args = p.parse_intermixed_args(argv)
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
    unknown = sorted({m for m in args.modes.split(",") if m.partition(":")[0] not in MODES})
    if unknown:
        p.error(f"--modes: unknown mode(s) {unknown}; choose from {','.join(MODES)}")
    return args


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def resumed_args(argv: list[str] | None, record: dict[str, Any], path: Path) -> argparse.Namespace:
    """The arguments of the bench in `record` (read from `path`). Arguments given beside --resume must be the
    same as the bench's: a bench continued with others would mix two benchmarks in one table."""
    saved = record["args"]
    given = vars(_parser(defaults=False).parse_intermixed_args(argv))
    given.pop("resume", None)
    if "out" in given and Path(given["out"]).resolve() == path.resolve():
        given.pop("out")
    differ = {k: v for k, v in given.items() if _jsonable(v) != saved.get(k)}
    if differ:

        def show(key: str, value: Any) -> str:
            if key == "overrides":
                return "overrides " + (" ".join(value) or "(none)")
            return f"--{key.replace('_', '-')} {' '.join(value) if isinstance(value, list) else value}"

        raise SystemExit(
            f"ortflow-bench: error: --resume {path}: "
            + "; ".join(f"{show(k, v)} differs from the bench's {show(k, saved.get(k))}" for k, v in differ.items())
            + ". A resumed bench runs with the arguments it started with (they are in the file): leave these out, "
            "or start a new bench without --resume."
        )
    args = argparse.Namespace(**{**saved, "out": path, "resume": path})
    args.sweep, args.overrides = list(args.sweep), list(args.overrides)
    return args


def read_record(path: Path) -> dict[str, Any]:
    """A bench's JSON file, for --resume.

    Raises:
        SystemExit: the file is missing, is not a bench's JSON, or is from another machine or software version."""
    try:
        record = json.loads(path.read_text())
    except OSError as err:
        raise SystemExit(f"ortflow-bench: error: --resume {path}: cannot read it ({err.strerror}).") from None
    except ValueError as err:
        raise SystemExit(f"ortflow-bench: error: --resume {path}: not JSON ({err}).") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or "args" not in record:
        raise SystemExit(
            f"ortflow-bench: error: --resume {path}: not a file ortflow-bench can continue (it has no "
            f"format {FORMAT} record of its arguments); start a new bench."
        )
    here = machine_facts()
    changed = [k for k in ("cpu", "torch", "onnxruntime") if record.get("machine", {}).get(k) != here[k]]
    if changed:
        then = ", ".join(f"{k} {record.get('machine', {}).get(k)}" for k in changed)
        raise SystemExit(
            f"ortflow-bench: error: --resume {path}: it was measured with {then}; here it is "
            f"{', '.join(f'{k} {here[k]}' for k in changed)}. Numbers from both would not compare: start a new bench."
        )
    return record


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Replace `path` by `record` in one step (a temporary file renamed over it): a bench killed at any moment
    leaves the previous complete file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # stopping waits for the rename
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
            json.dump(record, tmp, indent=2)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp.name, path)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class Stopped(Exception):
    """SIGTERM (or SIGINT) arrived: the bench stops after killing its running measurement."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise Stopped, so that the running measurement's process is ended with the bench."""

    def stop(signum: int, frame: Any) -> None:
        restore()  # a second signal is not caught: the bench ends at once (its measurement with it, on Linux)
        raise Stopped(signum)

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        restore()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stamp = f"{datetime.now():%Y-%m-%d_%H-%M-%S}"
    out = args.resume or args.out or Path("outputs") / "bench" / f"{'profile-' if args.profile else ''}{stamp}.json"
    console = Console(width=None if sys.stdout.isatty() else 140, highlight=False, soft_wrap=True)  # paths whole
    # This process's log records and other libraries' notices go to the log beside the JSON (the measurement processes
    # write their output there too), not to the terminal.
    with terminal.job_logging(out.with_suffix(".log")):
        terminal.quiet_import("torch.utils.cpp_extension")  # its CUDA_HOME notice; `import onnxruntime` imports it
        record = None
        if args.resume:
            record = read_record(args.resume)
            args = resumed_args(argv, record, args.resume)
        args.out = out
        check_configs(args)
        run_bench(args, record, console)
    console.print(f"written: {out}")


def run_bench(args: argparse.Namespace, record: dict[str, Any] | None, console: Console) -> None:
    """Every measurement of the plan not in `record` yet (a new bench: None), the JSON file rewritten after each;
    then the table (or the profiles) and, with --sweep, the PNG.

    Raises:
        SystemExit: stopped by SIGTERM or SIGINT (128 + the signal), after ending the running measurement."""
    measurements, log = plan(args), args.out.with_suffix(".log")
    if record is None:
        record = {"format": FORMAT, "args": _jsonable(vars(args)), "machine": machine_facts(), "complete": False}
        record["planned"] = len(measurements)
    runs: list[dict[str, Any]] = record.setdefault("profiles" if args.profile else "runs", [])
    finished = {(r["setting"], r["mode"], r["repeat"]) for r in runs}
    todo = [m for m in measurements if m.key() not in finished]
    if args.resume:
        record["resumed"] = record.get("resumed", 0) + 1
        console.print(f"resuming {args.out}: {len(runs)} of {len(measurements)} measurements done, {len(todo)} to run")
    if not args.profile:
        record.setdefault("matmul_peaks_gflops", matmul_peak_gflops())
        console.print(f"fp32 matmul peak: {_peaks_text(record['matmul_peaks_gflops'])}")
        if args.precision and BF16 in args.precision.split(","):
            record.setdefault("bf16_matmul_peak_gflops", bf16_matmul_peak_gflops())
            console.print(f"bf16 matmul peak: torch {record['bf16_matmul_peak_gflops']:.0f} GFLOP/s")
    if any(m.mode.startswith("ortmodule") for m in todo):
        from ortflow.accel.extensions import ensure_built

        ensure_built()  # the one-time build is not part of any measurement
    write_record(args.out, record)
    console.print(f"results: {args.out} (rewritten after each measurement), log: {log}")
    reporter = Reporter(console, todo, runs, log)
    try:
        with _stop_on_signals():
            for m in todo:
                reporter.start(m)
                start = time.monotonic()
                run = run_worker(args, m, log)
                run |= {"setting": m.setting, "mode": m.mode, "repeat": m.repeat, "index": m.index}
                run["wall_s"] = time.monotonic() - start
                runs.append(run)
                if not args.profile:
                    peak = max(record["matmul_peaks_gflops"].values())
                    record["rows"] = summarize(runs, peak, record.get("bf16_matmul_peak_gflops"))
                write_record(args.out, record)
                reporter.end(m, run)
    except Stopped as stopped:
        reporter.close()
        console.print(
            f"stopped ({stopped}): {len(runs)} of {len(measurements)} measurements are in {args.out}; "
            f"continue with: ortflow-bench --resume {args.out}"
        )
        raise SystemExit(128 + stopped.signum) from None
    reporter.close()
    if args.profile:
        finish_profile(args, record, console)
    else:
        finish(args, record, console)
    record["complete"] = True
    write_record(args.out, record)


def finish(args: argparse.Namespace, record: dict[str, Any], console: Console) -> None:
    """The table (and with --sweep, the PNG) from every measurement, MFU against the best matmul peak measured."""
    after = matmul_peak_gflops()
    peaks = {k: max(v, after[k]) for k, v in record["matmul_peaks_gflops"].items()}
    peak = max(peaks.values())
    console.print(
        f"fp32 matmul peak, best of before and after the runs: {_peaks_text(peaks)}; MFU is against {peak:.0f}"
    )
    if "bf16_matmul_peak_gflops" in record:
        record["bf16_matmul_peak_gflops"] = max(record["bf16_matmul_peak_gflops"], bf16_matmul_peak_gflops())
        console.print(f"bf16 matmul peak, best of before and after: torch {record['bf16_matmul_peak_gflops']:.0f}")
    rows = summarize(record["runs"], peak, record.get("bf16_matmul_peak_gflops"))
    record |= {"matmul_peaks_gflops": peaks, "matmul_peak_gflops": peak, "rows": rows}
    machine = record["machine"]
    how = f"{args.steps} steps" if args.steps else f"{args.budget:g} s of steps"
    console.print(table(record["rows"], f"ortflow-bench: +recipe={args.recipe}, {how} x {args.repeats} repeats"))
    console.print(f"machine: {describe_machine(machine)}")
    if args.sweep:
        title = f"ortflow-bench +recipe={args.recipe}: {describe_machine(machine)}"
        png = plot_scaling(record["rows"], args.out.with_suffix(".png"), title)
        record["png"] = str(png)
        console.print(f"written: {png}")


def finish_profile(args: argparse.Namespace, record: dict[str, Any], console: Console) -> None:
    for result in record["profiles"]:
        setting = "" if result["setting"] == "-" else result["setting"] + ": "
        if "error" in result:
            console.print(f"{setting}{result['mode']}: failed: {short(result['error'])}")
            continue
        title = (
            f"{setting}{result['mode']} (executed by {result['executed_by']}), "
            f"{result['step_ms']:.1f} ms/step under the profilers, {result['steps']} steps"
        )
        console.print(profile_table(result, args.top, title))


def check_configs(args: argparse.Namespace) -> None:
    """Compose and validate every setting x mode's config before any measurement: a typo in an override fails
    here, in a second, instead of in every worker.

    Raises:
        SystemExit: a config does not compose or validate (the message names the setting and mode)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ortflow.config import register_configs
    from ortflow.errors import OrtflowError
    from ortflow.paths import compose_config
    from ortflow.validate import validate

    register_configs()
    for setting in settings_of(args):
        for spec in mode_specs(args):
            mode, _, own = spec.partition(":")
            accel = "none" if mode == "compile" else mode
            try:
                validate(
                    compose_config([*overrides_for(args, setting), f"accel={accel}", *filter(None, own.split(";"))])
                )
            except (OrtflowError, HydraException, OmegaConfBaseException) as err:
                where = f"{'' if setting == '-' else setting + ', '}mode {spec}"
                raise SystemExit(f"ortflow-bench: error: {where}: {err}") from None


def describe_machine(machine: dict[str, Any]) -> str:
    flags = [f for f in machine.get("flags", []) if f.startswith(("avx512", "amx", "bf16"))]
    bf16 = f", bf16 matmul {machine['bf16_matmul_speedup']:.2f}x fp32" if "bf16_matmul_speedup" in machine else ""
    return (
        f"{machine['cpu']} ({machine['cpu_count']} cores{', ' + ' '.join(flags) if flags else ''}{bf16}), "
        f"torch {machine['torch']}, onnxruntime {machine['onnxruntime']}"
    )


def machine_facts() -> dict[str, Any]:
    import onnxruntime

    return {
        **machine.describe(measure_bf16=True),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


if __name__ == "__main__":
    main()
