"""What ortflow-bench shows: the table of the summary rows and the per-operator tables of --profile."""

from typing import Any

from rich.table import Table

from ortflow.bench.categories import KINDS
from ortflow.bench.summary import precision_of
from ortflow.report.profile import total_ms


def mode_label(mode: str) -> str:
    """A mode spec as the table shows it: `artifacts bf16-mixed` for `artifacts:trainer.precision=bf16-mixed`."""
    precision = precision_of(mode)
    if precision is None:
        return mode
    base, _, own = mode.partition(":")
    rest = ";".join(o for o in own.split(";") if not o.startswith("trainer.precision="))
    return f"{base}{':' + rest if rest else ''} {precision}"


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


def conversions_line(result: dict[str, Any], profiles: list[dict[str, Any]]) -> str:
    """One mode's dtype conversions per step (count, MB read and written, ms; torch's and ORT's), and their volume
    against eager's in the same setting and precision where the profile has it."""
    c = result["conversions"]
    total, by_torch, by_ort = c["total"], c["torch"], c["onnxruntime"]
    line = (
        f"dtype conversions per step: {total['count']:g} ({total['mb']:.1f} MB, {total['ms']:.2f} ms): torch "
        f"{by_torch['count']:g} ({by_torch['mb']:.1f} MB, {by_torch['ms']:.2f} ms), ORT Casts {by_ort['count']:g} "
        f"({by_ort['mb']:.1f} MB, {by_ort['ms']:.2f} ms)"
    )
    mode, _, own = str(result.get("mode", "")).partition(":")
    eager_mode = f"none:{own}" if own else "none"  # the same precision and overrides, eager
    eager = next(
        (
            p["conversions"]["total"]
            for p in profiles
            if p.get("mode") == eager_mode and p.get("setting") == result.get("setting") and "conversions" in p
        ),
        None,
    )
    if eager is not None and mode != "none" and eager["mb"] > 0:
        line += f"; {total['mb'] / eager['mb']:.2f}x eager's volume"
    return line


def kinds_table(profiles: list[dict[str, Any]], title: str) -> Table:
    """Each profiled mode's step by kind of work (bench.categories), ms per step and share of the step."""
    done = [p for p in profiles if "error" not in p]
    t = Table(title=title)
    t.add_column("kind of work")
    for p in done:
        setting = "" if p["setting"] == "-" else p["setting"] + " "
        t.add_column(f"{setting}{mode_label(p['mode'])}", justify="right")
    for kind in KINDS:
        t.add_row(kind, *(f"{p['by_kind'][kind]:.1f} ({p['by_kind'][kind] / p['step_ms']:.0%})" for p in done))
    t.add_row("[bold]step[/bold]", *(f"{p['step_ms']:.1f}" for p in done))
    return t
