"""What the diet pass asks of a graph about its variables: shapes, initializers, writers, and
why one stays float32."""

from __future__ import annotations

import numpy as np
from tensorflow.core.framework import attr_value_pb2

from ...analysis import bind, optimizers
from ...core import ops
from ...core.errors import GraphRewriteError
from ...core.graph import Graph
from ...core.tensor_ref import TensorRef
from .build import shape_attr
from .options import APPLY_OPS, SLOT_USERS

__all__ = ["shapes_attr", "record_shape", "matrix_shape", "initializer_groups",
           "initial_value", "through_identity_n", "escapes", "ancestors_in", "placeholder_spec",
           "writers"]


def shapes_attr(shapes) -> attr_value_pb2.AttrValue:
    value = attr_value_pb2.AttrValue()
    for dims in shapes:
        value.list.shape.add().CopyFrom(shape_attr(dims).shape)
    return value


def record_shape(graph: Graph, name: str, shape: tuple | None) -> None:
    """Give a new node's one output its `_output_shapes`: TensorFlow's shape inference cannot
    see through a TF2 step's resource placeholders, and a captured variable's shape is known
    to `bind` and the memory model only from what its reads record."""
    if shape is not None:
        graph.set_attr(name, "_output_shapes", shapes_attr([shape]))


def matrix_shape(shape: tuple) -> tuple | None:
    """The (rows, columns) a second moment of `shape` is factored over: a matrix as it is, a
    convolution kernel (kh, kw, cin, cout) as (kh*kw*cin, cout); None for vectors and for
    shapes where one side is 1 (nothing to save)."""
    if len(shape) < 2:
        return None
    rows = int(np.prod(shape[:-1]))
    if rows == 1 or shape[-1] == 1:
        return None
    return rows, int(shape[-1])


def initializer_groups(graph: Graph, var: str, update: str) -> list[str]:
    """The NoOps that wait for `var`'s initializer (`global_variables_initializer()`'s `init`,
    a Scaffold's or a user's group of initializers, whatever its name): a new slot's
    initializer joins them, so the graph's own init op still initialises every variable.
    Restores (their value read from a RestoreV2) and the update are not initializers."""
    return sorted({n for user in _initializers(graph, var, update)
                   for n, s in graph.consumers(user) if s == -1 and graph.op(n) == "NoOp"})


def _initializers(graph: Graph, var: str, update: str) -> list[str]:
    """The writes of `var` other than `update` and restores (their value from a RestoreV2)."""
    return [user for user, slot in graph.consumers(TensorRef(var))
            if slot == 0 and user != update and graph.op(user) in ("Assign", "AssignVariableOp")
            and "RestoreV2" not in {graph.op(n) for n in graph.data_ancestors([user])}]


def initial_value(graph: Graph, var: str, update: str) -> float | None:
    """The one value every element of `var` starts at, as its initializers write it (an
    Adagrad accumulator's 0.1); None when it is not one constant."""
    from ...analysis.loops import constant_value

    found = set()
    for user in _initializers(graph, var, update):
        value = constant_value(graph, None, graph.data_inputs(user)[1])
        if value is None or np.size(value) == 0 or np.ptp(value) != 0:
            return None
        found.add(float(np.ravel(value)[0]))
    return found.pop() if len(found) == 1 else None


def through_identity_n(graph: Graph, ref: TensorRef) -> str:
    """The node behind `ref`, seen through an IdentityN (a TF2 step's over every gradient,
    which Grappler removes): waiting on the IdentityN would wait on every gradient."""
    if graph.op(ref.node) == "IdentityN" and ref.port >= 0:
        inputs = graph.data_inputs(ref.node)
        if ref.port < len(inputs):
            return inputs[ref.port].node
    return ref.node


def escapes(graph: Graph, name: str, doomed: set[str]) -> bool:
    """Whether `name`, downstream of a slot to remove, changes anything that stays: a write of
    another variable, or a stateful op (a tf1 slot's users are all in SLOT_USERS; a Keras
    slot's are its reads, its own write and the arithmetic between them)."""
    op = graph.op(name)
    if op in SLOT_USERS and op not in ("AssignVariableOp", "Assign"):
        return False
    if op in ("AssignVariableOp", "Assign", "ResourceScatterAdd",
              *optimizers.DECOMPOSED_WRITES):
        return graph.data_inputs(name)[0].node not in doomed
    return ops.is_stateful(op)


def ancestors_in(graph: Graph, name: str, within: set[str]) -> set[str]:
    found, todo = set(), [name]
    while todo:
        for ref in graph.inputs(todo.pop()):
            if ref.node in within and ref.node not in found:
                found.add(ref.node)
                todo.append(ref.node)
    return found


def placeholder_spec(graph: Graph, shapes, name: str):
    try:
        spec = bind.value_spec(graph, shapes, name)
    except GraphRewriteError:  # no shape recorded: not listed
        return None
    return spec.dtype, int(np.prod(spec.shape))


def writers(graph: Graph, var: str) -> list[str]:
    """Ops that change the variable in the step (not initializers, restores or reads)."""
    out = []
    for user, slot in graph.consumers(TensorRef(var)):
        op = graph.op(user)
        if slot == 0 and (op in APPLY_OPS or op.startswith((
                "ResourceApply", "Apply", "ResourceSparseApply", "SparseApply", "AssignAdd",
                "AssignSub", "ResourceScatter", "Scatter"))):
            out.append(user)
    return out


