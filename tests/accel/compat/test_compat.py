"""compat.py knows the versions it was written for: an unknown combination is refused in one paragraph (before any
patch or export), unless the documented override is set."""

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

from ortflow.accel.compat import cpp_patches, extensions, torch_patches, versions
from ortflow.errors import OrtflowError


def test_the_installed_stack_is_supported():
    assert versions.untested_versions() == {}
    versions.require_supported_versions()


@pytest.mark.parametrize("torch_version", ["2.5.1", "2.16.0+cpu", "3.0.0"])
def test_an_unknown_torch_is_refused_naming_installed_and_supported(monkeypatch, torch_version):
    installed = {**versions.installed_versions(), "torch": torch_version}
    monkeypatch.setattr(versions, "installed_versions", lambda: installed)
    monkeypatch.delenv(versions.ALLOW_UNTESTED, raising=False)
    with pytest.raises(OrtflowError) as refused:
        versions.require_supported_versions()
    message = str(refused.value)
    assert f"torch {torch_version}" in message and "torch 2.6 to 2.15" in message and versions.ALLOW_UNTESTED in message
    assert "\n" not in message
    monkeypatch.setenv(versions.ALLOW_UNTESTED, "1")
    versions.require_supported_versions()  # the override lets a user try anyway
    assert versions.untested_versions() == {"torch": torch_version}


# ------------------------------------------------------------------------------ patches keyed on the torch version
def test_patches_are_keyed_on_the_torch_version():
    def names(version, cpu_only=False):  # cpu_only=False: a CUDA build, as PyPI's default torch
        return [patch.name for patch in torch_patches.needed(version, cpu_only)]

    assert names((2, 6)) == names((2, 8)) == []  # the Python side broke in 2.9
    assert names((2, 9)) == [
        "alias_moved_onnx_modules",
        "stub_removed_beartype",
        "torchscript_export_for_ortmodule",
        "alias_moved_convolution_symbolics",
    ]
    assert names((2, 6), cpu_only=True) == ["no_nvtx_ranges_on_cpu_builds"]
    assert names((2, 13), cpu_only=True) == [patch.name for patch in torch_patches.PATCHES]
    assert [patch.name for patch in cpp_patches.needed((2, 6))] == ["dirty_inputs_by_grad_fn"]  # ORT's own bug
    assert cpp_patches.needed((2, 7)) == cpp_patches.needed((2, 15)) == list(cpp_patches.PATCHES)
    for patch in [*torch_patches.PATCHES, *cpp_patches.PATCHES]:
        assert patch.reason and "\n" not in patch.reason


def test_the_installed_torch_gets_exactly_the_python_patches_it_needs():
    applied = versions.prepare()
    assert applied == [patch.name for patch in torch_patches.needed()]
    from onnxruntime.training.ortmodule import ORTModule  # imports only with those patches on torch >= 2.9

    assert ORTModule is not None


def test_source_patches_apply_to_ort_1_19_2_sources(tmp_path):
    pristine = extensions.extensions_dir() / "cpu"
    for version, expected in (((2, 6), ["dirty_inputs_by_grad_fn"]), ((2, 14), [p.name for p in cpp_patches.PATCHES])):
        cpu = tmp_path / f"{version[0]}.{version[1]}"
        shutil.copytree(pristine, cpu)
        assert cpp_patches.apply(cpu, version) == expected
    new = (tmp_path / "2.14" / "torch_interop_utils" / "custom_function_fw.cc").read_text()
    old = (tmp_path / "2.6" / "torch_interop_utils" / "custom_function_fw.cc").read_text()
    assert old != (pristine / "torch_interop_utils" / "custom_function_fw.cc").read_text()
    assert (tmp_path / "2.6" / "torch_interop_utils" / "setup.py").read_text() == (
        pristine / "torch_interop_utils" / "setup.py"
    ).read_text()
    assert "dynamic_cast<torch::autograd::PyNode*>" in old and "PyNode*>" not in new
    assert "torch::utils::tensor_fromDLPack(" not in new and "cdata.lock()" not in new


def test_a_source_the_patches_do_not_fit_stops_the_build_naming_the_patch(tmp_path):
    cpu = tmp_path / "cpu"
    shutil.copytree(extensions.extensions_dir() / "cpu", cpu)
    setup = cpu / "torch_interop_utils" / "setup.py"
    setup.write_text(setup.read_text().replace('"-std=c++17"', '"-std=c++14"'))
    with pytest.raises(OrtflowError, match=r"patch 'cxx20'.*onnxruntime-training 1\.19\.2"):
        cpp_patches.apply(cpu, (2, 14))


def test_ortmodule_export_defaults_to_the_torchscript_exporter_only_inside_ortmodule(monkeypatch):
    calls = []

    def export(model, args, f, *, dynamo=None, opset_version=None):
        calls.append(dynamo)

    monkeypatch.setattr(torch.onnx, "export", export)
    torch_patches._torchscript_export_for_ort()
    torch.onnx.export(None, (), "a.onnx")
    with torch_patches.exporting():
        torch.onnx.export(None, (), "b.onnx")
        torch.onnx.export(None, (), "c.onnx", dynamo=True)  # an explicit choice is kept
    assert calls == [None, False, True]
    assert inspect.signature(torch.onnx.export) == inspect.signature(export)  # ORT inspects the signature


def test_extensions_built_for_another_torch_are_rebuilt(tmp_path):
    assert not extensions.is_built(tmp_path)
    (tmp_path / "torch_interop_utils.so").write_bytes(b"")
    assert extensions.is_built(tmp_path) == (not cpp_patches.needed())  # ORT's installer: no record
    (tmp_path / extensions.RECORD).write_text(json.dumps({"torch": "2.0.0", "patches": []}))
    assert not extensions.is_built(tmp_path)
    patches = [patch.name for patch in cpp_patches.needed()]
    (tmp_path / extensions.RECORD).write_text(json.dumps({"torch": torch.__version__, "patches": patches[:-1]}))
    assert not extensions.is_built(tmp_path)  # built before ortflow carried its latest patch
    (tmp_path / extensions.RECORD).write_text(json.dumps({"torch": torch.__version__, "patches": patches}))
    assert extensions.is_built(tmp_path)


def test_the_installed_extensions_were_built_for_this_torch_with_its_patches():
    record = extensions.build_record()
    if record is None:  # built by ORT's own installer (torch 2.6, before ortflow kept a record)
        assert not cpp_patches.needed()
    else:
        assert record["torch"] == torch.__version__
        assert record["patches"] == [patch.name for patch in cpp_patches.needed()]
    assert extensions.is_built()


def test_the_unity_build_compiles_every_source_once_without_debug_info(tmp_path):
    from ortflow.accel.compat import extension_setup

    sources = [tmp_path / "a.cc", tmp_path / "b.cc"]
    for source in sources:
        source.write_text("int x;\n")
    made = []
    unity = extension_setup._unity_extension(lambda name, sources, **kwargs: made.append((name, sources, kwargs)))
    unity("ext", [str(source) for source in sources], extra_compile_args={"cxx": ["-O3", "-std=c++20"]})
    unity("one", [str(sources[0])])
    (name, [unit], kwargs), (_, single, plain) = made
    assert name == "ext" and kwargs["extra_compile_args"] == {"cxx": ["-O3", "-std=c++20", "-g0"]}
    assert [line.split('"')[1] for line in Path(unit).read_text().splitlines()] == [str(source) for source in sources]
    assert single == [str(sources[0])] and plain["extra_compile_args"] == ["-g0"]


def test_extensions_in_the_machine_cache_are_copied_not_compiled(tmp_path, monkeypatch):
    folder = tmp_path / "venv_extensions"
    shutil.copytree(extensions.extensions_dir() / "cpu", folder / "cpu", ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "stale.so").write_bytes(b"old")
    monkeypatch.setattr(extensions, "extensions_dir", lambda: folder)
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(extensions, "_compile", lambda *args: pytest.fail("compiled although cached"))
    patched = tmp_path / "patched"
    shutil.copytree(folder / "cpu", patched)
    patches = cpp_patches.apply(patched)
    cached = extensions.cache_root() / extensions.build_key(patched)
    cached.mkdir(parents=True)
    (cached / "torch_interop_utils.so").write_bytes(b"built")
    (cached / extensions.RECORD).write_text(json.dumps({"torch": torch.__version__, "patches": patches, "key": "k"}))
    assert extensions.ensure_built() is True
    assert (folder / "torch_interop_utils.so").read_bytes() == b"built" and not (folder / "stale.so").exists()
    assert extensions.is_built(folder) and extensions.ensure_built() is False
    # Another torch (or patch set, compiler, ORT, Python) is another key: nothing cached for it.
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    assert extensions.build_key(patched) != cached.name


def _export_like_warnings() -> None:
    import warnings

    warnings.warn("Converting a tensor to a Python boolean", torch.jit.TracerWarning, stacklevel=1)
    warnings.warn("You are using the legacy TorchScript-based ONNX export", DeprecationWarning, stacklevel=1)
    warnings.warn(
        "ONNX Preprocess - Removing mutation from node aten::add_ on block input: 'model.bn.num_batches_tracked'.",
        UserWarning,
        stacklevel=1,
    )
    warnings.warn("ONNX Preprocess - Removing mutation from node aten::add_ on block input: 'x'.", stacklevel=1)
    warnings.warn("something else", UserWarning, stacklevel=1)


def test_only_the_exporters_expected_warnings_are_silenced_and_said_once(caplog, monkeypatch):
    import logging
    import warnings

    from ortflow.accel.compat import export_warnings

    monkeypatch.setattr(export_warnings, "_said", False)
    with caplog.at_level(logging.INFO, logger="ortflow.accel.compat.export_warnings"):
        for _ in range(2):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with export_warnings.expected():
                    _export_like_warnings()
            assert [str(w.message) for w in seen] == [
                "ONNX Preprocess - Removing mutation from node aten::add_ on block input: 'x'.",
                "something else",
            ]
    assert sum("expected warnings are silenced" in r.getMessage() for r in caplog.records) == 1


def test_a_failed_extension_build_names_its_log_and_quotes_its_end(tmp_path):
    cpu = tmp_path / "cpu"
    (cpu / "broken").mkdir(parents=True)
    (cpu / "broken" / "setup.py").write_text("print('error: no compiler here')\nraise SystemExit(3)\n")
    log = tmp_path / "build.log"
    with pytest.raises(OrtflowError, match=r"(?s)extension\(s\) broken failed.*build\.log.*no compiler here"):
        extensions._compile(cpu, tmp_path, log)


def test_ortmodules_output_probe_runs_on_the_module_itself_and_puts_its_buffers_back():
    """Before each export ORTModule runs one forward to learn its outputs, on a deep copy of the module in ORT 1.19.2;
    patched, it runs on the module (no copy of its weights held), whose buffers it then puts back, and under
    ORTModule's no_grad even inside the export's hooks (which trace the forward with grad on: no autograd graph)."""
    import logging

    from ortflow.accel.compat import ortmodule_patches
    from ortflow.accel.graph import ortmodule_export, stop_gradients

    ortmodule_patches.patch_ortmodule(ortmodule_export.HOOKS)
    from onnxruntime.training.ortmodule import _io

    class Probed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(3)
            self.calls = 0
            self._output_schema = None

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            self.calls += 1
            self.grad_enabled = torch.is_grad_enabled()
            return (self.norm(x),)

    module = Probed().train()
    before = {name: b.clone() for name, b in module.named_buffers()}
    with stop_gradients.traced_with_grad(module):
        names, _, _ = _io.parse_outputs_for_onnx_export_and_extract_schema(
            module, [torch.randn(4, 3) + 5], logging.getLogger("test"), True
        )
    assert names == ["output-0"]
    assert module.calls == 1  # the module itself ran, not a copy
    assert module.grad_enabled is False
    for name, value in module.named_buffers():
        assert torch.equal(value, before[name]), name
