"""What ortflow-bench shows: the summary rows (medians over repeats, the ratio to eager, MFU) and their table, the
per-operator tables of --profile, and a line as each measurement starts and ends, with the bench's elapsed time
and ETA (on a terminal also a bar for the whole bench; elsewhere plain lines)."""

import statistics
import time
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ortflow.report.profile import total_ms


class Planned(Protocol):
    """A measurement of the plan, as the progress lines need it."""

    index: int
    setting: str
    mode: str

    def label(self) -> str: ...


def summarize(
    runs: list[dict[str, Any]], peak_gflops: float, bf16_peak_gflops: float | None = None
) -> list[dict[str, Any]]:
    """One row per (setting, mode): medians over repeats and the ratio to eager in the same setting (and to eager in
    the same trainer.precision); MFU against the fp32 matmul peak, or the bf16 one for bf16-mixed rows."""
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == setting]
        for mode in dict.fromkeys(r["mode"] for r in mine):
            ok = [r for r in mine if r["mode"] == mode and "error" not in r]
            peak = bf16_peak_gflops if precision_of(mode) == "bf16-mixed" and bf16_peak_gflops else peak_gflops
            row: dict[str, Any] = {"setting": setting, "mode": mode, "repeats": len(ok)}
            if not ok:
                row["error"] = next(r["error"] for r in mine if r["mode"] == mode)
                rows.append(row)
                continue
            sps = [r["samples_per_s"] for r in ok]
            median = statistics.median(sps)
            row |= {
                "executed_by": ok[0]["executed_by"],
                "samples_per_s": median,
                "samples_per_s_min": min(sps),
                "samples_per_s_max": max(sps),
                "steps": statistics.median(r.get("steps", 0) for r in ok),
                "passes": ok[0].get("passes"),
                "first_step_s": statistics.median(r["first_step_s"] for r in ok),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in ok),
                "trainable_params": ok[0].get("parameters", {}).get("trainable"),
                "runner_overhead": statistics.median(r["runner_overhead"] for r in ok),
                "loop_outside_engine": statistics.median(r["loop_outside_engine"] for r in ok),
                "mfu": ok[0]["flops_per_step"] * median / ok[0]["batch_size"] / (peak * 1e9),
            }
            rows.append(row)
        eager = next((r for r in rows if r["setting"] == setting and r["mode"] == "none" and "error" not in r), None)
        for r in rows:
            if r["setting"] == setting and eager and "error" not in r:
                r["vs_eager"] = r["samples_per_s"] / eager["samples_per_s"]
            precision = precision_of(r["mode"])
            same = f"none:trainer.precision={precision}"
            if r["setting"] == setting and precision and "error" not in r:
                twin = next(
                    (e for e in rows if e["setting"] == setting and e["mode"] == same and "error" not in e), None
                )
                if twin is not None:
                    r["vs_eager_same_precision"] = r["samples_per_s"] / twin["samples_per_s"]
    return rows


def mode_label(mode: str) -> str:
    """A mode spec as the table shows it: `artifacts bf16-mixed` for `artifacts:trainer.precision=bf16-mixed`."""
    precision = precision_of(mode)
    if precision is None:
        return mode
    base, _, own = mode.partition(":")
    rest = ";".join(o for o in own.split(";") if not o.startswith("trainer.precision="))
    return f"{base}{':' + rest if rest else ''} {precision}"


def precision_of(mode: str) -> str | None:
    """The trainer.precision a mode spec sets (`ortmodule:trainer.precision=bf16-mixed`), None when it sets none."""
    for override in mode.partition(":")[2].split(";"):
        key, _, value = override.partition("=")
        if key == "trainer.precision":
            return value
    return None


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title)
    columns = (
        "setting",
        "mode",
        "trainable",
        "samples/s (min-max)",
        "x eager",
        "x eager same prec.",
        "timed steps",
        "first step",
        "peak RSS",
        "MFU",
        "vs bare",
        "outside",
    )
    for col in columns:
        t.add_column(col, justify="left" if col in ("setting", "mode") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(
                r["setting"], mode_label(r["mode"]), "", f"failed: {short(r['error'])}", *[""] * (len(columns) - 4)
            )
            continue
        trainable = r.get("trainable_params")
        t.add_row(
            r["setting"],
            mode_label(r["mode"]),
            f"{trainable / 1e6:.2f}M" if trainable is not None else "-",
            f"{rate(r['samples_per_s'])} ({rate(r['samples_per_s_min'])}-{rate(r['samples_per_s_max'])})",
            f"{r['vs_eager']:.2f}" if "vs_eager" in r else "-",
            f"{r['vs_eager_same_precision']:.2f}" if "vs_eager_same_precision" in r else "-",
            f"{r['passes']} x {r['steps']:.0f}" if r.get("passes") else "-",
            f"{r['first_step_s']:.1f} s",
            f"{r['peak_rss_mb']:.0f} MB",
            f"{100 * r['mfu']:.1f}%",
            f"{100 * r['runner_overhead']:+.1f}%",
            f"{100 * r['loop_outside_engine']:.2f}%",
        )
    return t


def rate(samples_per_s: float) -> str:
    """Samples/s to the unit from 10 up, two significant digits below (a large model's 0.48, not 0)."""
    return f"{samples_per_s:.0f}" if samples_per_s >= 10 else f"{samples_per_s:.2g}"


def short(error: str, limit: int = 160) -> str:
    line = error.strip().splitlines()[0] if error.strip() else error
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _clock(seconds: float) -> str:
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


class Reporter:
    """What a person watches: a line as each measurement starts and ends (setting, mode, repeat, samples/s, the
    bench's elapsed time and ETA); on a terminal also a bar for the whole bench. The ETA adds, for each measurement
    left, the mean duration of the finished ones of its mode in its setting (else of its mode, else of all); `done`
    are the measurements of earlier sessions of a resumed bench, whose durations count too."""

    def __init__(self, console: Console, todo: list[Planned], done: list[dict[str, Any]], log: Path) -> None:
        self.console, self.todo, self.done, self.log = console, list(todo), list(done), log
        self.total = len(todo) + len(done)
        self.elapsed_before = sum(r.get("wall_s", 0.0) for r in done)
        self.started = time.monotonic()
        self.bar: Progress | None = None
        if console.is_terminal and todo:
            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[eta]}"),
                console=console,
                transient=True,
            )
            self.task = self.bar.add_task("", total=self.total, completed=len(done), eta="")
            self.bar.start()

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    def eta(self) -> float | None:
        """Seconds the measurements left should take, from the finished ones' durations (None before any)."""
        finished = [r for r in self.done if "wall_s" in r]
        if not finished:
            return None

        def estimate(m: Planned) -> float:
            alike = [r["wall_s"] for r in finished if (r["setting"], r["mode"]) == (m.setting, m.mode)]
            alike = alike or [r["wall_s"] for r in finished if r["mode"] == m.mode]
            return statistics.mean(alike or [r["wall_s"] for r in finished])

        return sum(estimate(m) for m in self.todo)

    def start(self, m: Planned) -> None:
        self._line(f"[{m.index}/{self.total}] {m.label()} ...")
        if self.bar:
            self.bar.update(self.task, description=m.label())

    def end(self, m: Planned, run: dict[str, Any]) -> None:
        self.done.append(run)
        self.todo.remove(m)
        eta = self.eta() if self.todo else None
        when = f"bench {_clock(self.elapsed())}" + (f", ETA {_clock(eta)}" if eta is not None else "")
        if "error" in run:
            what = f"failed: {short(run['error'])} (see {self.log})"
        elif "ort_ops" in run:
            what = f"profiled {run['steps']} steps, {run['step_ms']:.1f} ms/step under the profilers"
        else:
            what = (
                f"{rate(run['samples_per_s'])} samples/s ({run['passes']} x {run['steps']} steps timed, "
                f"first step {run['first_step_s']:.1f} s)"
            )
        self._line(f"[{m.index}/{self.total}] {m.label()}: {what} in {run['wall_s']:.0f} s; {when}")
        if self.bar:
            self.bar.update(self.task, advance=1, eta=f"ETA {_clock(eta)}" if eta is not None else "")

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)  # above the bar while it shows

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


def profile_table(result: dict[str, Any], top: int, title: str) -> Table:
    """ORT's operators beside torch's for one mode, top `top` of each by time per step."""
    t = Table(title=title)
    for col in ("ORT operator", "ms/step", "calls", "torch operator", "ms/step ", "calls "):
        t.add_column(col, justify="left" if "operator" in col else "right")
    ort, torch_ = result.get("ort_ops", []), result.get("torch_ops", [])

    def cells(rows: list[dict[str, Any]], i: int) -> list[str]:
        if i >= len(rows):
            return ["", "", ""]
        r = rows[i]
        op = f"{r['op']} [dim](ORT ran inside)[/dim]" if r.get("ort_run") else r["op"]
        return [op, f"{r['ms_per_step']:.2f}", f"{r['calls_per_step']:g}"]

    for i in range(min(top, max(len(ort), len(torch_)))):
        t.add_row(*cells(ort, i), *cells(torch_, i))
    t.add_row(
        "[bold]all ORT kernels[/bold]" if ort else "(no ORT session)",
        f"{total_ms(ort):.2f}" if ort else "",
        "",
        "[bold]all torch operators (self, ORT's runs left out)[/bold]",
        f"{total_ms(torch_):.2f}",
        "",
    )
    return t
