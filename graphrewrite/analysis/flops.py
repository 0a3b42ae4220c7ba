"""Floating-point operations per node: analytic for the expensive ops, element count for the rest.

A multiply-add counts as 2 FLOPs. Unknown shapes give 0 (and the shapes report lists them).
"""

from __future__ import annotations

import math

from ..core.graph import Graph
from ..core.tensor_ref import TensorRef
from .shapes import Shapes

__all__ = ["ZERO_COST", "CONVOLUTIONS", "node_flops", "node_traffic", "total_flops"]

ZERO_COST = frozenset({
    "Const", "Placeholder", "PlaceholderWithDefault", "Identity", "IdentityN", "NoOp", "Reshape",
    "Squeeze", "ExpandDims", "Shape", "ShapeN", "Size", "Rank", "StopGradient", "VarHandleOp",
    "ReadVariableOp", "Enter", "Exit", "Merge", "Switch", "NextIteration", "LoopCond",
    "ZerosLike", "OnesLike", "Fill", "BroadcastGradientArgs", "Snapshot", "PreventGradient",
})


CONVOLUTIONS = frozenset({
    "Conv2D", "_FusedConv2D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    "Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter", "Conv3D", "Conv3DBackpropInputV2",
    "Conv3DBackpropFilterV2"})


def node_flops(graph: Graph, shapes: Shapes, name: str) -> int:
    """FLOPs of one execution of `name`."""
    op = graph.op(name)
    if op in ZERO_COST:
        return 0
    node = graph.node_def(name)
    inputs = [_dims(shapes, r) for r in graph.data_inputs(name)]
    out = _dims(shapes, TensorRef(name, 0))
    if op in ("MatMul", "_MklMatMul"):
        a = inputs[0]
        if a is None or out is None or len(a) != 2:
            return 0
        k = a[0] if node.attr["transpose_a"].b else a[1]
        return 2 * math.prod(out) * k
    if op in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        a = inputs[0]
        if a is None or out is None or len(a) < 2:
            return 0
        adj = node.attr["adj_x"].b
        k = a[-2] if adj else a[-1]
        return 2 * math.prod(out) * k
    if op in CONVOLUTIONS:
        return _conv_flops(op, inputs, out)
    if op == "Einsum":
        return _einsum_flops(node.attr["equation"].s.decode(), inputs)
    if op.startswith("FusedBatchNorm"):
        x = inputs[0]
        return 0 if x is None else (10 if "Grad" in op else 5) * math.prod(x)
    return 0 if out is None else math.prod(out)


def node_traffic(graph: Graph, shapes: Shapes, name: str) -> int:
    """Bytes one execution of `name` reads and writes: its data inputs and its outputs."""
    return sum(shapes.nbytes(r) or 0 for r in graph.data_inputs(name) + shapes.outputs(name))


def total_flops(graph: Graph, shapes: Shapes, nodes=None) -> int:
    return sum(node_flops(graph, shapes, n) for n in (graph.nodes() if nodes is None else nodes))


def _dims(shapes: Shapes, ref: TensorRef) -> tuple | None:
    info = shapes[ref]
    if info is None or info.shape is None or any(d is None for d in info.shape):
        return None
    return info.shape


def _conv_flops(op: str, inputs, out) -> int:
    """2 x (elements of the forward output) x (the kernel's window x in-channels; the window
    alone if depthwise), in 2-D and 3-D (a video CNN built outside the repo counted a 340
    MFLOP convolution as 2 MFLOP, one per output element).

    Conv(x, filter) -> y; BackpropInput(sizes, filter, dy); BackpropFilter(x, sizes, dy) -> filter.
    """
    if "BackpropFilter" in op:
        filter_shape, forward_out = out, inputs[2]
    elif "BackpropInput" in op:
        filter_shape, forward_out = inputs[1], inputs[2]
    else:
        filter_shape, forward_out = inputs[1], out
    if filter_shape is None or forward_out is None or len(filter_shape) not in (4, 5):
        return 0
    window = filter_shape[:-2]
    per_output = math.prod(window) * (1 if op.startswith("Depthwise") else filter_shape[-2])
    return 2 * math.prod(forward_out) * per_output


def _einsum_flops(equation: str, inputs) -> int:
    """2 x the product of every distinct index's extent (the loop nest a naive einsum runs)."""
    lhs = equation.split("->")[0].replace(" ", "")
    sizes = {}
    for spec, dims in zip(lhs.split(","), inputs):
        if dims is None or "." in spec or len(spec) != len(dims):
            return 0
        sizes.update(zip(spec, dims))
    return 2 * math.prod(sizes.values())
