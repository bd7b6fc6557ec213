"""What a device export asks of the artifacts engine: the one place that lists its settings.

A set for a device holds only ONNX and com.microsoft ops (no org.pytorch.aten node: no torch kernel inside ORT),
dropout as ORT's own Dropout inside the graph (no mask inputs), in fp32. Today these are the artifacts engine's
keys below; once the engine has a `target` key, ENGINE_SETTINGS becomes {"target": "portable"}.
"""

from typing import Any

from ortflow.config import FP32

# accel=artifacts keys for a device export (conf/accel/artifacts.yaml names and explains each one).
ENGINE_SETTINGS: dict[str, Any] = {
    "rewrite_dropout": False,  # ORT's Dropout in the graph: a device has no host that draws and feeds masks
    "aten_conv": False,  # ORT's Conv/ConvGrad, not torch's kernels (a device has no torch)
    "aten_layer_norm": False,  # the same for LayerNorm, GELU and the loss, whatever the run's precision
    "aten_gelu": False,
    "aten_cross_entropy": False,
}
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
