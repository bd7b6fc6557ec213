"""ORTModule 1.19.2's C++ extensions on torch releases newer than it was written for.

ORT ships the extensions' sources and builds them against the installed torch. From torch 2.7 on the sources no
longer build or load, and on every supported torch a custom Function using ctx.mark_dirty fails inside ORTModule:
ortflow copies the sources out of the onnxruntime package, applies the patches below (each keyed on the torch
version it is for, with its reason in one line) and builds the copy (`extensions.py`). Nothing
inside the installed onnxruntime package is edited. Each patch names the exact text it replaces; a source that
does not contain it stops the build with an error naming the patch (a different ORT would need new patches).
"""

from dataclasses import dataclass
from pathlib import Path

from ortflow.accel.compat.torch_patches import Version, torch_version
from ortflow.errors import OrtflowError

INTEROP = "torch_interop_utils"


@dataclass(frozen=True)
class SourcePatch:
    name: str
    since: Version
    reason: str
    file: str  # relative to the extensions' cpu/ folder
    old: str
    new: str


_OWNING_HELPER = """
#ifdef NVTX3_ENABLED
#include <nvtx3/nvToolsExt.h>
#endif

// An owning pointer to an autograd node: THPFunction::cdata was a weak_ptr (lock() it) before torch moved autograd
// nodes to intrusive pointers, and an owning intrusive_ptr since.
template <typename P>
static auto ortflow_owning(const P& pointer) {
  if constexpr (requires { pointer.lock(); }) {
    return pointer.lock();
  } else {
    return pointer;
  }
}
"""

_FROM_DLPACK_HELPER = """#include <torch/extension.h>
#include <ATen/DLConvertor.h>

// What torch::utils::tensor_fromDLPack does (no longer exported by libtorch_python): wrap the capsule's tensor
// and mark the capsule used, so that the tensor alone owns (and frees) it.
inline at::Tensor ortflow_from_dlpack(PyObject* capsule) {
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  TORCH_CHECK(managed != nullptr, "invalid DLPack capsule");
  at::Tensor tensor = at::fromDLPack(managed);
  PyCapsule_SetName(capsule, "used_dltensor");
  return tensor;
}
"""

PATCHES = (
    SourcePatch(
        "dirty_inputs_by_grad_fn",
        (2, 6),
        "ctx.dirty_tensors is already cleared when ORT reads it, so a Function using ctx.mark_dirty failed "
        "('PythonOp ... Get null result'): an input was modified in place when its grad_fn is the Function's node",
        f"{INTEROP}/custom_function_fw.cc",
        """  std::vector<bool> are_tensors_marked_dirty(tensors_to_check.size(), false);
  if (!py_fn->dirty_tensors)
    return are_tensors_marked_dirty;
""",
        """  std::vector<bool> are_tensors_marked_dirty(tensors_to_check.size(), false);
  if (!py_fn->dirty_tensors) {
    for (const auto j : c10::irange(tensors_to_check.size())) {
      are_tensors_marked_dirty[j] = tensors_to_check[j].grad_fn().get() == grad_fn.get();
    }
    return are_tensors_marked_dirty;
  }
""",
    ),
    SourcePatch(
        "cxx20",
        (2, 7),
        "the patches below use C++20 (if constexpr + requires), which newer torch headers require anyway",
        f"{INTEROP}/setup.py",
        '"-std=c++17"',
        '"-std=c++20"',
    ),
    SourcePatch(
        "owning_node_pointer",
        (2, 7),
        "autograd nodes became intrusive pointers: THPFunction::cdata is owning and has no lock()",
        f"{INTEROP}/custom_function_fw.cc",
        "\n#ifdef NVTX3_ENABLED\n#include <nvtx3/nvToolsExt.h>\n#endif\n",
        _OWNING_HELPER,
    ),
    SourcePatch(
        "owning_node_pointer_use",
        (2, 7),
        "(the same) take the node through the helper that works for either pointer kind",
        f"{INTEROP}/custom_function_fw.cc",
        "auto saved_for = py_fn->cdata.lock();",
        "auto saved_for = ortflow_owning(py_fn->cdata);",
    ),
    SourcePatch(
        "pool_node_pointer_type",
        (2, 7),
        "the grad_fn pool stored std::shared_ptr<Node>; store whatever pointer type AutogradMeta::grad_fn_ has",
        f"{INTEROP}/ctx_pool.h",
        "std::unordered_map<size_t, std::shared_ptr<torch::autograd::Node>> grad_fns_;",
        "std::unordered_map<size_t, decltype(torch::autograd::AutogradMeta::grad_fn_)> grad_fns_;",
    ),
    SourcePatch(
        "python_function_without_pynode",
        (2, 7),
        "PyNode's typeinfo is no longer exported (dynamic_cast fails to link) and PyNode::obj is gone: get the "
        "THPFunction through functionToPyObject",
        f"{INTEROP}/custom_function_fw.cc",
        """  auto py_node_fn = dynamic_cast<torch::autograd::PyNode*>(grad_fn.get());
  TORCH_CHECK(py_node_fn != nullptr, "grad_fn is not PyNode type.");
  THPFunction* py_fn = (THPFunction*)py_node_fn->obj;
""",
        """  py::object py_fn_object = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(grad_fn));
  TORCH_CHECK(py_fn_object && THPFunction_Check(py_fn_object.ptr()), "grad_fn is not a Python Function node.");
  THPFunction* py_fn = (THPFunction*)py_fn_object.ptr();
""",
    ),
    SourcePatch(
        "python_function_without_pynode_ctx",
        (2, 7),
        "(the same) for the context object returned to ORT",
        f"{INTEROP}/custom_function_fw.cc",
        """  const std::shared_ptr<torch::autograd::Node>& cdata = tensor_owning_ctx.value().grad_fn();
  auto py_node_fn = dynamic_cast<torch::autograd::PyNode*>(cdata.get());
  TORCH_CHECK(py_node_fn != nullptr, "cdata is not PyNode type.");

  // ret is THPFunction
  THPFunction* py_fn = (THPFunction*)py_node_fn->obj;
  py::object ret = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(cdata));
""",
        """  const auto& cdata = tensor_owning_ctx.value().grad_fn();
  // ret is THPFunction
  py::object ret = py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(cdata));
  TORCH_CHECK(ret && THPFunction_Check(ret.ptr()), "cdata is not a Python Function node.");
  THPFunction* py_fn = (THPFunction*)ret.ptr();
""",
    ),
    SourcePatch(
        "dlpack_helper",
        (2, 7),
        "torch::utils::tensor_fromDLPack is no longer exported: convert with at::fromDLPack",
        f"{INTEROP}/custom_function_shared.h",
        "#include <torch/extension.h>\n",
        _FROM_DLPACK_HELPER,
    ),
    SourcePatch(
        "dlpack_forward",
        (2, 7),
        "(the same) in the forward runner",
        f"{INTEROP}/custom_function_fw.cc",
        "at::Tensor tensor = torch::utils::tensor_fromDLPack(args[arg_index]);",
        "at::Tensor tensor = ortflow_from_dlpack(args[arg_index]);",
    ),
    SourcePatch(
        "dlpack_backward",
        (2, 7),
        "(the same) in the backward runner",
        f"{INTEROP}/custom_function_bw.cc",
        "tensor = torch::utils::tensor_fromDLPack(args[arg_index]);",
        "tensor = ortflow_from_dlpack(args[arg_index]);",
    ),
)


def needed(version: Version | None = None) -> list[SourcePatch]:
    """The source patches the given (default: installed) torch needs."""
    version = version or torch_version()
    return [patch for patch in PATCHES if version >= patch.since]


def apply(cpu_dir: Path, version: Version | None = None) -> list[str]:
    """Patch a copy of the extensions' cpu/ sources in place for the given torch; returns the patch names.

    Raises:
        OrtflowError: a patch's text is not in its file (these sources are not ORT 1.19.2's).
    """
    applied = []
    torch_named = ".".join(map(str, version or torch_version()))
    for patch in needed(version):
        path = cpu_dir / patch.file
        text = path.read_text()
        if text.count(patch.old) != 1:
            raise OrtflowError(
                f"cannot patch ORTModule's C++ extension source {patch.file} for torch {torch_named}: "
                f"patch '{patch.name}' expects its text exactly once and found it {text.count(patch.old)} times. "
                "These sources are not those of onnxruntime-training 1.19.2, which ortflow's patches were written for."
            )
        path.write_text(text.replace(patch.old, patch.new))
        applied.append(patch.name)
    return applied
