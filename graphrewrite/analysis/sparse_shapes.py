"""A sparse matrix's dense shape, when it is fed: read from the dense operands it multiplies.

A graph convolution multiplies a `tf.SparseTensor` adjacency built from three fed tensors
(indices, values, dense shape) with dense features: `sparse_dense_matmul`. The dense shape is
a value, which shape inference does not know, so every product's rows and all computed from
them stay unknown (a TF1 GCN built outside the repo: 36 tensors, half its measured peak counted
as nothing). The products themselves say it: a `SparseTensorDenseMatMul` multiplies A (or its
transpose) by B, so A's columns (its rows, transposed) are B's rows, and the gradient's product
by the transpose gives the other side. Where one side is found and the other is not, A is taken
as square (an adjacency is) and the tensors are listed as estimated. Shapes are then inferred
again with the dense shape a constant.
"""

from __future__ import annotations

import copy

from tensorflow.core.framework import types_pb2
from tensorflow.python.framework import tensor_util

from . import loop_shapes

__all__ = ["refine_shapes"]

PRODUCT = "SparseTensorDenseMatMul"


def refine_shapes(graph_def, inferred: dict, infer) -> list[str]:
    """Fill in what a fed dense shape left unknown (`inferred`: node -> [(dtype, shape)] per
    output, updated in place); `infer` is `shapes.tensorflow_shapes`. Returns the products
    whose dense shape was taken as square."""
    nodes = {n.name: n for n in graph_def.node}
    sides: dict[str, list] = {}  # dense-shape tensor -> [rows, cols] read from the products
    readers: dict[str, list[str]] = {}
    for node in graph_def.node:
        if node.op != PRODUCT or len(node.input) < 4 or _constant(nodes, node.input[2]):
            continue
        dense = _canonical(node.input[2])
        readers.setdefault(dense, []).append(node.name)
        b_shape = _shape(inferred, node.input[3])
        b_rows = None if b_shape is None or len(b_shape) != 2 else \
            b_shape[1 if node.attr["adjoint_b"].b else 0]
        if b_rows is not None:
            sides.setdefault(dense, [None, None])[0 if node.attr["adjoint_a"].b else 1] = b_rows
    values, square = {}, []
    for dense, (rows, cols) in sides.items():
        if rows is None or cols is None:
            square.extend(readers[dense])
        values[dense] = (cols if rows is None else rows, rows if cols is None else cols)
    if not values:
        return []
    trial = copy.deepcopy(graph_def)
    for dense, value in values.items():
        const = trial.node.add(name=f"{_name(dense)}/_dense_shape_{len(trial.node)}", op="Const")
        const.attr["dtype"].type = types_pb2.DT_INT64
        const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value,
                                                                          types_pb2.DT_INT64))
        for node in trial.node:
            if node.name in readers[dense]:
                node.input[2] = const.name
    loop_shapes.merge_into(inferred, infer(trial))
    return sorted(square)


def _constant(nodes, text: str) -> bool:
    node = nodes.get(_name(text))
    return node is not None and node.op == "Const"


def _shape(inferred, text: str):
    outputs = inferred.get(_name(text))
    port = int(_canonical(text).rpartition(":")[2])
    return outputs[port][1] if outputs and port < len(outputs) else None


def _canonical(text: str) -> str:
    return text if ":" in text else f"{text}:0"


def _name(text: str) -> str:
    return text.lstrip("^").split(":")[0]
