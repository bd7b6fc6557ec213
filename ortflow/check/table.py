"""The table `ortflow-check` prints: a row per mode and precision; in its caption, eager's own noise (the envelope
each row is held to) and the smallest errors the check catches."""

from typing import Any

from rich.table import Table

from ortflow.check import parity
from ortflow.config import FP32

RANDOM_FORWARD = (
    "The model still draws random numbers with its dropout modules at p=0 (functional dropout such as F.dropout or "
    "scaled_dot_product_attention's dropout_p, or a random augmentation): each mode draws its own, so the loss "
    "differences against eager include different random draws, not only the runtimes' arithmetic."
)


def _names(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"'{n}'" for n in names[:shown]) + more


def detectable_text(detectable: dict[str, Any]) -> str:
    """The smallest errors the check catches, in words."""
    parts = []
    for what, label in (("gradient", "step-1 gradient"), ("buffer", "buffer after step 1")):
        found = detectable.get(what)
        if found is None:
            continue
        noisy = found["rounding_noise"]
        if found["error"] is None:
            text = f"no {label} determined by the model"
        elif found["bounded_by"] is None:
            text = f"any {label} off by more than {found['error']:.1e} (relative; the floor, fp32 rounding)"
        else:
            text = (
                f"any {label} off by more than {found['error']:.1e} (relative; {parity.MARGIN:g}x the most one-ulp "
                f"weights moved any, '{found['bounded_by']}''s: {found['spread']:.1e})"
            )
        if noisy:
            text += (
                f", except {len(noisy)} whose values are eager's own rounding noise (one-ulp weights move them by more "
                f"than {parity.NOISY:g}): {_names(noisy)}"
            )
        parts.append(text)
    if found := detectable.get("update"):
        parts.append(f"a first update more than {found['ulps']} ulps of a weight from torch's optimizer's")
    if loss := detectable.get("loss"):
        parts.append(f"a loss off by more than {loss['step_1']:.1e} at step 1 ({loss['last_step']:.1e} at the last)")
    return "smallest errors caught: " + "; ".join(parts)


def envelope_text(report: dict[str, Any]) -> str:
    if not report.get("envelopes"):
        return "eager's own noise: not measured (eager did not train)"
    lines = []
    for precision, envelope in report["envelopes"].items():
        band = " ".join(f"{b:.0e}" for b in envelope["loss_band"])
        lines.append(
            f"{precision}: eager's own noise, {envelope['seeds']} runs from one-ulp weights: loss band by step {band}; "
            f"a row passes within {parity.LOSS_SAMPLING:g}x to {envelope['loss_margin']:g}x it as its own step 1 "
            f"earns (at least {envelope['floors']['loss']:.0e}), its "
            f"step-1 gradients and buffers within {envelope['margin']:g}x their own spread (at least "
            f"{envelope['floors']['gradient']:.0e}). " + detectable_text(envelope["detectable"])
        )
    return "\n".join(lines)


def _gradients(row: dict[str, Any]) -> str:
    found = row.get("gradients")
    if not found or found.get("worst") is None:
        return "-"
    return f"{found['difference']:.1e} ('{found['worst']}', tol {found['tolerance']:.0e})"


def table(report: dict[str, Any]) -> Table:
    caption = [envelope_text(report), *([RANDOM_FORWARD] if report["random_forward"] else [])]
    table = Table(
        title=f"ortflow-check: {report['model']} ({report['steps']} steps, dropout off)", caption="\n".join(caption)
    )
    columns = ("accel", "precision", "trains", "executed by", "loss vs eager", "step-1 grads vs eager (worst)")
    for column in (*columns, "verdict", "step ms", "first step s", "graph fixes"):
        table.add_column(column)
    for r in report["rows"]:
        if not r["trains"]:
            reason = "[red]no[/red]: " + r.get("reason", r.get("executed_by", ""))
            table.add_row(r["mode"], r.get("precision", FP32), reason, "", "", "", "", "", "", "")
            continue
        loss = r.get("max_rel_loss_diff")
        reference = r["mode"] == "none"
        table.add_row(
            r["mode"],
            r.get("precision", FP32),
            "[green]yes[/green]",
            r["executed_by"],
            "reference" if reference else (f"{loss:.1e}" if loss is not None else "-"),
            "reference" if reference else _gradients(r),
            "reference" if reference else r.get("verdict", "-"),
            f"{r['step_ms']:.1f}",
            f"{r['first_step_s']:.2f}",
            ", ".join(f"{k}={v}" for k, v in r["graph_fixes"].items()) or "-",
        )
    return table
