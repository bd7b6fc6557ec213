"""The device export's parts that need no export: the optimizer model's learning-rate scale, BatchNorm's momentum
in the graph, refusals, the flat parameter buffer's way back, the torch-free loader, the server's headers."""

import http.client
import json
import sys
import threading
import urllib.parse
import urllib.request

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from ortflow.device import artifact_set, graphs, params, serve
from ortflow.errors import OrtflowError


def _optimizer_model() -> onnx.ModelProto:
    inputs = [
        helper.make_tensor_value_info("learning_rate", TensorProto.FLOAT, [1]),
        helper.make_tensor_value_info("step", TensorProto.INT64, [1]),
    ]
    node = helper.make_node("AdamWOptimizer", ["learning_rate", "step"], ["flag"], domain="com.microsoft")
    outputs = [helper.make_tensor_value_info("flag", TensorProto.BOOL, [1])]
    return helper.make_model(helper.make_graph([node], "optimizer", inputs, outputs))


def test_the_learning_rate_is_scaled_once_inside_the_optimizer_model():
    model = _optimizer_model()
    assert graphs.scale_learning_rate(model, 3.0) == 1
    assert graphs.scale_learning_rate(model, 3.0) == 0  # already scaled: not twice
    assert graphs.learning_rate_scale(model) == 3.0
    mul = model.graph.node[0]
    assert mul.op_type == "Mul" and list(mul.input) == ["learning_rate", graphs.LR_SCALE]
    assert model.graph.node[1].input[0] == mul.output[0]
    assert [i.name for i in model.graph.input] == ["learning_rate", "step"]  # what runtimes feed, unchanged


def test_torch_kernels_and_mask_inputs_are_named():
    aten = helper.make_node("ATen", ["x"], ["y"], domain=graphs.TORCH_DOMAIN, operator="upsample_bilinear2d")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("x", "dropout_mask_0")]
    model = helper.make_model(helper.make_graph([aten], "g", inputs, []))
    problems = graphs.portability_problems("training_model.onnx", model, {"x"})
    assert "upsample_bilinear2d" in problems[0] and "dropout_mask_0" in problems[1]
    assert len(graphs.portability_problems("optimizer_model.onnx", model, None)) == 1  # inputs not checked


def test_momentum_none_is_refused_naming_the_layer():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None))
    with pytest.raises(OrtflowError, match=r"BatchNorm '1' has momentum=None"):
        artifact_set.batchnorm_momenta(model)


def test_dropout_is_off_in_the_copy_only():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3), nn.MultiheadAttention(4, 2, dropout=0.2))
    quiet = artifact_set.without_dropout(model)
    assert quiet[1].p == 0.0 and quiet[2].dropout == 0.0
    assert model[1].p == 0.3 and model[2].dropout == 0.2


def test_a_flat_buffer_comes_back_in_the_manifests_order(tmp_path):
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    model[0].weight.requires_grad_(False)
    tensors, offset, trainable = [], 0, 0
    for name, shape, train in (
        ("0.weight", [3, 2], False),
        ("0.bias", [3], True),
        ("1.weight", [3], True),
        ("1.bias", [3], True),
        ("1.running_mean", [3], False),
        ("1.running_var", [3], False),
    ):
        tensors.append(
            {
                "torch_name": name,
                "shape": shape,
                "trainable": train,
                "offset": offset,
                "trainable_offset": trainable if train else None,
            }
        )
        offset += int(np.prod(shape))
        trainable += int(np.prod(shape)) if train else 0
    manifest = {"parameters": {"count": offset, "trainable_count": trainable, "tensors": tensors}}
    buffer = np.arange(offset, dtype=np.float32)
    (tmp_path / "p.bin").write_bytes(buffer.tobytes())
    back = params.into_model(params.read_buffer(tmp_path / "p.bin"), manifest, model, "p.bin")
    assert torch.equal(back[0].weight, torch.arange(6.0).reshape(3, 2))
    assert torch.equal(back[1].running_var, torch.arange(18.0, 21.0))
    assert back[1].num_batches_tracked == model[1].num_batches_tracked  # kept from the run
    only = params.into_model(np.arange(trainable, dtype=np.float32), manifest, model, "p.bin")
    assert torch.equal(only[0].bias, torch.arange(3.0)) and torch.equal(only[0].weight, model[0].weight)
    with pytest.raises(OrtflowError, match="holds 5 float32 values"):
        params.into_model(np.zeros(5, np.float32), manifest, model, "p.bin")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(OrtflowError, match="not a whole number"):
        params.read_buffer(tmp_path / "odd.bin")


def test_the_server_sets_the_types_and_isolation_headers(tmp_path):
    (tmp_path / "a.wasm").write_bytes(b"\0asm")
    (tmp_path / "b.mjs").write_text("export {}")
    server = serve.make_server(tmp_path, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with urllib.request.urlopen(f"{base}/a.wasm") as wasm, urllib.request.urlopen(f"{base}/b.mjs") as mjs:
            assert wasm.headers["Content-Type"] == "application/wasm"
            assert mjs.headers["Content-Type"] == "text/javascript"
            assert wasm.headers["Cross-Origin-Opener-Policy"] == "same-origin"
            assert wasm.headers["Cross-Origin-Embedder-Policy"] == "require-corp"
    finally:
        server.shutdown()
        server.server_close()


def _status(url: str) -> int:
    """The HTTP status of a GET of `url`, its path sent as written (`..` included)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request("GET", url[len(f"{parts.scheme}://{parts.netloc}") :])
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_server_serves_the_export_folder_alone_and_lists_only_the_data_folder(tmp_path):
    root, outside = tmp_path / "set", tmp_path / "secret"
    for path in (root / "web" / "index.html", root / "data" / "mine" / "a" / "1.png", root / "manifest.json"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    (root / "data" / "mine" / ".hidden.png").write_text("x")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("x")
    outside.mkdir()
    (outside / "key.txt").write_text("x")
    (root / "data" / "link").symlink_to(outside, target_is_directory=True)
    server = serve.make_server(root, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert _status(f"{base}/web/index.html") == 200 and _status(f"{base}/manifest.json") == 200
        with urllib.request.urlopen(f"{base}/data/mine/?list") as listing:
            assert json.loads(listing.read()) == ["a/1.png"]
        with urllib.request.urlopen(f"{base}/data/?list") as listing:
            assert json.loads(listing.read()) == ["mine/a/1.png"]  # not the link's files
        for refused in (
            "/?list", "/web/?list", "/data/link/?list", "/data/../?list", "/data/mine/../../?list",
            "/web/../../secret/key.txt", "/../secret/key.txt", "/%2e%2e/secret/key.txt", "/data/link/key.txt",
            "/.git/config", "/data/mine/.hidden.png", "/data/", "/data/mine/a/",
        ):  # fmt: skip
            assert _status(base + refused) == 404, refused
    finally:
        server.shutdown()
        server.server_close()


def test_the_torch_free_loader_sees_no_torch(tmp_path):
    """The loader itself, in a fresh interpreter: torch unimportable, the training package's __init__ not run."""
    import subprocess

    from ortflow.device import torch_free

    code = (
        "import sys, runpy; m = runpy.run_path(sys.argv[1]); m['load_training_api']();"
        "import importlib; assert sys.modules['torch'] is None;"
        "assert not hasattr(sys.modules['onnxruntime.training'], '__file__');"
        "print(m['mapped_forbidden']())"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code, torch_free.__file__], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_with_optimizer_state_is_refused_before_anything_is_written(tmp_path, capsys):
    from ortflow.cli import export_artifacts

    with pytest.raises(SystemExit) as exit_:
        export_artifacts.main([str(tmp_path / "run"), "--with-optimizer-state", "--out", str(tmp_path / "set")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--with-optimizer-state" in err and "start their optimizer fresh" in err
    assert not (tmp_path / "set").exists()


def test_the_torch_free_check_fails_on_each_planted_fault():
    """Eager's noise at zero (every tolerance at its floor): each planted fault fails, a clean device passes."""
    from ortflow.device.check import PARAMETER_TOLERANCE, TOLERANCE, UPDATE_TOLERANCE, DeviceRun, Envelope, compare
    from ortflow.device.reference import FirstStep, Reference

    weights, mean, var = np.array([0.5, -2.0, 1.0]), np.array([0.1, 0.2]), np.array([1.0, 0.9])
    tensors = [
        {"torch_name": "layer.weight", "shape": [3], "offset": 0, "trainable": True, "trainable_offset": 0},
        {"torch_name": "bn.running_mean", "shape": [2], "offset": 3, "trainable": False},
        {"torch_name": "bn.running_var", "shape": [2], "offset": 5, "trainable": False},
    ]
    before = {"layer.weight": weights + 0.1}  # the weights before step 1; the first update moved them by -0.1
    initial = {"bn.running_mean": np.zeros(2), "bn.running_var": np.ones(2)}
    first_stats = {"bn.running_mean": mean, "bn.running_var": var}
    gradients = np.array([0.3, -0.2, 0.1])
    first = FirstStep({"layer.weight": gradients}, {"layer.weight": weights}, first_stats)
    reference = Reference([2.0, 1.5], 1.4, {"layer.weight": weights}, {"bn": mean}, {"bn": var}, {}, first, initial)
    envelope = Envelope.measure(reference, [reference])  # no noise: every tolerance at its floor
    clean = {"forbidden_maps": [], "torch_importable": False, "training_package_init_run": False}

    def run(losses=(2.0, 1.5), eval_loss=1.4, w=weights, m=mean, v=var, g=gradients, w1=weights, record=clean, on=None):
        after_first = np.concatenate([w1, mean, var])
        device = DeviceRun(list(losses), eval_loss, np.concatenate([w, m, v]), record, g, after_first)
        dropout_on = None if on is None else DeviceRun(list(on[0]), on[1], device.parameters, record)
        replay = (before, {"layer.weight": weights})
        return compare(device, reference, tensors, dropout_on, 0 if on is None else 2, envelope, replay).failures

    assert run() == []
    assert run(losses=(2.0 * (1 + 2 * TOLERANCE), 1.5))  # the step-1 loss at twice the tolerance
    assert run(losses=(2.0, 1.5 * (1 + 2 * TOLERANCE)))  # a later step's (eager's band at 0: the floor)
    assert run(eval_loss=1.4 * (1 + 2 * TOLERANCE))
    assert run(w=weights + np.array([0.0, 2 * 2.0 * PARAMETER_TOLERANCE, 0.0]))  # one weight after the steps
    assert run(m=mean + np.array([0.0, 1e-4]))  # one running mean
    assert run(v=var * np.array([1.0, 1 + 1e-4]))  # one running variance (torch's unbiased one, say)
    assert run(g=gradients * np.array([1.0, 1.0, 1 + 1e-4]))  # one step-1 gradient
    assert run(w1=weights - 0.1 * 2 * UPDATE_TOLERANCE)  # the first update, off by twice its tolerance
    assert run(record={**clean, "forbidden_maps": ["/site-packages/torch/lib/libtorch_cpu.so"]})
    assert run(on=((2.1, 1.6), 1.5)) == []  # dropout on: another first loss, every loss finite
    assert run(on=((2.1, float("nan")), 1.5))  # the shipped set trained to NaN with its dropout on
    assert run(on=((2.1, 1.6), float("inf")))  # or evaluated to inf
