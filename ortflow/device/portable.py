"""What a device export asks of the artifacts engine: the one place that lists its settings.

A set for a device is what the graph plan's portable target trains (accel/graph/plan.py): only ONNX and com.microsoft
ops (no org.pytorch.aten node: no torch kernel inside ORT), dropout as ORT's own Dropout inside the graph (no mask
inputs), BatchNorm's running statistics updated by ORT's kernel inside the graph, in fp32.
"""

from typing import Any

from ortflow.config import FP32

# accel=artifacts keys for a device export (the graph settings: GraphSettings in ortflow/accel/graph/plan.py).
ENGINE_SETTINGS: dict[str, Any] = {"target": "portable"}
PRECISION = FP32  # every runtime's training kernels are fp32; a bf16-mixed run's weights are fp32 already

# ORT's on-device Optimizer starts at this learning rate; onnxruntime-web 1.19 has no setter and keeps it, and a
# checkpoint restores only `initial_lr` and `step` where the runtime honours it. The set carries the rate in its
# optimizer model instead (graphs.scale_learning_rate).
RUNTIME_LR = 1e-3

# onnxruntime-web's last release with a training build (1.20 and later have none), and its files the page loads.
ORT_WEB_PACKAGE, ORT_WEB_VERSION = "onnxruntime-web", "1.19.2"
ORT_WEB_FILES = (
    "ort.training.wasm.min.js",
    "ort-training-wasm-simd-threaded.mjs",
    "ort-training-wasm-simd-threaded.wasm",
)
