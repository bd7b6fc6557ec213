"""The matmul peaks model FLOP utilisation is measured against: fp32 of torch and of ONNX Runtime, bf16 of torch."""

import time
from collections.abc import Callable

import torch

from ortflow.report import terminal


def matmul_peak_gflops(n: int = 1024, repeats: int = 20) -> dict[str, float]:
    """Best fp32 n x n matmul throughput on this machine in GFLOP/s, of torch and of ONNX Runtime (each with its
    default thread count): the peak model FLOP utilisation is measured against is the higher of the two, so that
    a runtime with faster matmuls cannot show more than 100%.

    Measured before and after the runs (the bench takes the higher): on a shared machine one short measurement can
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


def peaks_text(peaks: dict[str, float]) -> str:
    return ", ".join(f"{name} {gflops:.0f} GFLOP/s" for name, gflops in peaks.items())


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
