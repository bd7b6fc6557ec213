"""The table `ortflow-check` prints: a row per mode and precision, eager's noise floor in the caption."""

from typing import Any

from rich.table import Table

from ortflow.check import parity
from ortflow.config import FP32

RANDOM_FORWARD = (
    "The model still draws random numbers with its dropout modules at p=0 (functional dropout such as F.dropout or "
    "scaled_dot_product_attention's dropout_p, or a random augmentation): each mode draws its own, so the loss "
    "differences against eager include different random draws, not only the runtimes' arithmetic."
)


def floor_text(report: dict[str, Any]) -> str:
    floor = report.get("noise_floor")
    if floor is None:
        return "eager's noise floor: not measured (eager did not train)"
    text = (
        f"eager's own noise floor {floor:.1e}: the largest loss difference of eager against itself with every weight "
        f"moved by one ulp ({len(report['noise_floors'])} seeds, the same steps)"
    )
    if (gradients := report.get("gradient_floor")) is not None:
        text += f"; their step-1 gradients {gradients:.1e} from eager's"
    if report.get("chaotic"):
        text += (
            f"; over {parity.CHAOTIC_FLOOR:.0e}: a chaotic model, whose loss after a few steps depends on the last "
            "bit of its weights"
        )
    for precision, low in report.get("precision_floors", {}).items():
        grads = f"{low['step1_grads']:.1e}" if low["step1_grads"] is not None else "-"
        text += (
            f"\n{precision} rows are held to eager {precision}'s own distance from eager fp32: loss {low['loss']:.1e}, "
            f"step-1 gradients {grads}"
        )
    return text


def table(report: dict[str, Any]) -> Table:
    caption = [floor_text(report), *([RANDOM_FORWARD] if report["random_forward"] else [])]
    table = Table(
        title=f"ortflow-check: {report['model']} ({report['steps']} steps, dropout off)", caption="\n".join(caption)
    )
    columns = ("accel", "precision", "trains", "executed by", "loss vs eager", "step-1 grads vs eager", "verdict")
    columns = (*columns, "step ms")
    for column in (*columns, "first step s", "graph fixes"):
        table.add_column(column)
    for r in report["rows"]:
        if not r["trains"]:
            reason = "[red]no[/red]: " + r.get("reason", r.get("executed_by", ""))
            table.add_row(r["mode"], r.get("precision", FP32), reason, "", "", "", "", "", "", "")
            continue
        loss = r.get("max_rel_loss_diff")
        grads = r.get("grad_rel_diff")
        table.add_row(
            r["mode"],
            r.get("precision", FP32),
            "[green]yes[/green]",
            r["executed_by"],
            "reference" if r["mode"] == "none" else (f"{loss:.1e}" if loss is not None else "-"),
            "reference" if r["mode"] == "none" else (f"{grads:.1e}" if grads is not None else "-"),
            "reference" if r["mode"] == "none" else r.get("verdict", "-"),
            f"{r['step_ms']:.1f}",
            f"{r['first_step_s']:.2f}",
            ", ".join(f"{k}={v}" for k, v in r["graph_fixes"].items()) or "-",
        )
    return table
