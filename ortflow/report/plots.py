"""Curves to look at: the training loss and eval curves of several runs on shared axes, as one PNG (matplotlib's
headless Agg canvas, no display needed). Used by ortflow-compare and the sweep summary.

Each run gets one colour (COLORS[i], in the order given) and is labelled by the overrides that set it apart from
the others. Comparing an ONNX Runtime run with an eager run of the same config adds a third panel: the training
loss difference (ORT - eager) at every logged step.
"""

import json
import textwrap
from pathlib import Path
from typing import Any

from ortflow.files import flatten, read_record

# matplotlib's tab10 palette without its grey (the axes' text is grey), one colour per run; a test finds each run's
# curve by its colour
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
PANEL_SIZE = (5.0, 3.6)  # inches per panel
DPI = 100


def read_curves(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} from a run's metrics.jsonl; after a resume, the newer attempt's points win."""
    curves: dict[str, dict[int, float]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return curves
    for line in path.read_text().splitlines():
        try:
            point = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        step = point.get("step")
        if step is None:
            continue
        for key, value in point.items():
            if key != "step" and isinstance(value, int | float):
                curves.setdefault(key, {})[step] = float(value)
    return curves


def labels(records: list[dict[str, Any]], run_dirs: list[Path]) -> list[str]:
    """Each run's overrides that not every run shares (its dir name when all runs share them all)."""
    overrides = [record.get("overrides", []) for record in records]
    common = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    names = [" ".join(o for o in run if o not in common) for run in overrides]
    return [name or run_dir.name for name, run_dir in zip(names, run_dirs, strict=True)]


def eager_pairs(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(ORT run, eager run) index pairs whose configs differ only in the accel group."""
    configs = [flatten(r.get("config", {})) for r in records]
    engines = [r.get("engine", {}).get("executed_by") for r in records]
    pairs = []
    for i, ort in enumerate(engines):
        for j, eager in enumerate(engines):
            if ort != "onnxruntime" or eager != "pytorch":
                continue
            keys = set(configs[i]) | set(configs[j])
            differing = {k for k in keys if configs[i].get(k) != configs[j].get(k)}
            if all(k.startswith("accel.") for k in differing):
                pairs.append((i, j))
    return pairs


def _width(index: int, runs: int) -> float:
    return 1.2 + 2.4 * (runs - 1 - index) / max(runs - 1, 1)


def plot_runs(run_dirs: list[Path], out: Path, title: str = "") -> Path:
    """Write the PNG comparing `run_dirs` to `out`; returns `out`."""
    # Imported here: matplotlib builds its font cache on first import, which a training run never needs.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = [read_record(d) or {} for d in run_dirs]
    curves = [read_curves(d) for d in run_dirs]
    names = labels(records, run_dirs)
    pairs = eager_pairs(records)
    eval_metrics = sorted({k for c in curves for k in c if k.startswith("eval/")}, key=lambda k: (k != "eval/loss", k))
    panels = ["train/loss", *eval_metrics[:2], *(["difference"] if pairs else [])]
    columns = min(len(panels), 2)
    rows = -(-len(panels) // columns)
    fig = Figure(figsize=(PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False).flatten()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes, panels, strict=False):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if panel == "difference":
            ax.set_title("train/loss difference, ORT - eager")
            for i, j in pairs:
                steps = sorted(set(curves[i].get("train/loss", {})) & set(curves[j].get("train/loss", {})))
                diff = [curves[i]["train/loss"][s] - curves[j]["train/loss"][s] for s in steps]
                ax.plot(steps, diff, color=COLORS[i % len(COLORS)], marker=".", label=f"{names[i]} - {names[j]}")
            ax.axhline(0.0, color="black", linewidth=0.5)
        else:
            ax.set_title(panel)
            for i, curve in enumerate(curves):
                points = sorted(curve.get(panel, {}).items())
                if points:
                    steps, values = zip(*points, strict=True)
                    ax.plot(
                        steps,
                        values,
                        color=COLORS[i % len(COLORS)],
                        linewidth=_width(i, len(curves)),  # earlier runs wider: identical curves stay visible
                        marker="." if len(points) < 30 else None,
                    )
    handles = [axes[0].plot([], [], color=COLORS[i % len(COLORS)], label=name)[0] for i, name in enumerate(names)]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(names), 3), fontsize="small")
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def plot_scaling(rows: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """ortflow-bench's sweeps as one PNG: a panel per swept key, samples/s of each mode against the key's values
    (median over repeats, the min-max range as error bars). `rows` are the bench's summary rows, whose
    `setting` is `key=value`. Numeric values go on a log2 axis when all are positive (widths, batch sizes), on a
    linear one otherwise; other values (`true`, `adamw`) are categories in the order swept."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    swept = [r for r in rows if "=" in r["setting"] and "error" not in r]
    keys = list(dict.fromkeys(r["setting"].partition("=")[0] for r in swept))
    modes = list(dict.fromkeys(r["mode"] for r in swept))
    width = PANEL_SIZE[0] * max(len(keys), 1)
    fig = Figure(figsize=(width, PANEL_SIZE[1] + 0.4), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        texts = list(dict.fromkeys(r["setting"].partition("=")[2] for r in swept if r["setting"].startswith(key + "=")))
        numbers = [_number(t) for t in texts]
        numeric = all(n is not None for n in numbers)
        position = dict(zip(texts, numbers if numeric else range(len(texts)), strict=True))
        for j, mode in enumerate(modes):
            mine = [r for r in swept if r["mode"] == mode and r["setting"].partition("=")[0] == key]
            values = [position[r["setting"].partition("=")[2]] for r in mine]
            median = [r["samples_per_s"] for r in mine]
            low = [m - r["samples_per_s_min"] for m, r in zip(median, mine, strict=True)]
            high = [r["samples_per_s_max"] - m for m, r in zip(median, mine, strict=True)]
            ax.errorbar(values, median, yerr=[low, high], color=COLORS[j % len(COLORS)], marker="o", capsize=3,
                        label=mode)  # fmt: skip
        if numeric and all(n > 0 for n in numbers):
            ax.set_xscale("log", base=2)
        elif not numeric:
            ax.set_xlim(-0.5, len(texts) - 0.5)
        ax.set_xticks(list(position.values()), texts)
        ax.set_xlabel(key)
        ax.set_ylabel("samples/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(textwrap.fill(title, int(width * 10)), fontsize="medium")  # ~10 characters an inch: all shown
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
