"""Upsampling (nn.Upsample, F.interpolate) by torch's kernels inside ONNX Runtime's graphs, with torch's gradient.

Why: torch exports upsampling as ONNX Resize, and ORT 1.19's CPU build has no kernel for its gradient ("Could not
find an implementation for ResizeGrad"): segmentation heads (LR-ASPP, DeepLab, U-Nets that upsample) could not
train in either engine. ORTModule's own export handles nearest and bicubic modes with ATen nodes, not the
(bi/tri)linear ones the segmentation heads use, and the artifacts engine has none of them.

How (its declaration at the end: the plan's `upsample` op, on the torch path in the fast target; the portable target
refuses it, naming the module: ORT has no ORT-native way to train it on CPU): while an ORT engine exports
(symbolics.py), every `aten::upsample_*` becomes one `org.pytorch.aten::ATen` node running torch's own operator
(`vec` overload: the output size or the scale factors, whichever the model gave); its gradient node runs
`aten::upsample_*_backward` with the output and input sizes read from the graph (ORTModule's registry already
defines it for nearest and bicubic; the linear modes are registered here in the same form). The torch operators
take no gradient for their scale or size inputs, so no mask is needed.
"""

from typing import Any

from ortflow.accel.graph import aten_nodes, symbolics
from ortflow.accel.graph import plan as graph_plan

DIMS = {
    "upsample_nearest1d": 1,
    "upsample_nearest2d": 2,
    "upsample_nearest3d": 3,
    "upsample_linear1d": 1,
    "upsample_bilinear2d": 2,
    "upsample_trilinear3d": 3,
    "upsample_bicubic2d": 2,
}
ALIGN_CORNERS = {"upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d"}
_OURS = ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d")  # gradients ORTModule lacks


def _symbolic(name: str):
    def symbolic(g: Any, input: Any, output_size: Any, *args: Any) -> Any:
        inputs = [input, output_size, *args]  # (align_corners,) scale_factors
        output = g.op("org.pytorch.aten::ATen", *inputs, operator_s=name, overload_name_s="vec")
        output.setType(g.original_node.output().type())
        return output

    return symbolic


def _gradient(name: str):
    dims = DIMS[name]

    def definition() -> list[tuple]:
        """Like ORTModule's upsample gradients: the output's spatial size and the input's shape from the graph,
        align_corners from the forward node, no scales (torch derives them from the sizes)."""
        return [
            ("Shape", ["I(0)"], ["Shape_X"]),
            ("Shape", ["O(0)"], ["Shape_Y"]),
            ("Constant", [], ["Const_Start"], {"value": {"value": [2], "dtype": "int", "is_tensor": True}}),
            ("Constant", [], ["Const_End"], {"value": {"value": [2 + dims], "dtype": "int", "is_tensor": True}}),
            ("Slice", ["Shape_Y", "Const_Start", "Const_End"], ["Sliced_Shape_Y"]),
            (
                ("ATen", "org.pytorch.aten"),
                ["GO(0)", "Sliced_Shape_Y", "Shape_X", "I(2)", *([""] * dims)],
                ["GI(0)"],
                {"operator": {"value": f"{name}_backward", "dtype": "string"}},
            ),
        ]

    return definition


# The linear modes' gradients are ortflow's; ORTModule's registry holds the nearest and bicubic ones.
for _name in DIMS:
    aten_nodes.register(
        aten_nodes.AtenOp(
            _name,
            f"{_name}_backward",
            differentiable=(0,),
            mask_input=None,
            gradient=_gradient(_name) if _name in _OURS else None,
            fix_name="upsamples_run_by_torch",
            overload="vec",
        )
    )


def _upsample(name: str) -> graph_plan.SymbolicFactory:
    def factory(plan: graph_plan.GraphPlan, native) -> Any:
        if plan.by_torch(NAME):
            return _symbolic(name)

        def refused(g: Any, *args: Any) -> Any:
            raise graph_plan.NoPortablePath(
                f"an upsampling ({name})",
                symbolics.scope(g),
                "ONNX exports it as Resize, and ONNX Runtime's CPU build has no gradient for Resize (ortflow runs it "
                "with torch's kernels, which a device does not have)",
            )

        return refused

    return factory


NAME = "upsample"
OP = graph_plan.one_path(
    NAME,
    graph_plan.Path.torch,
    replaces="Resize (aten::upsample_*: nn.Upsample, F.interpolate), which ORT's CPU build cannot differentiate",
    module=__name__,
    symbolics={f"::{name}": _upsample(name) for name in DIMS},
)
