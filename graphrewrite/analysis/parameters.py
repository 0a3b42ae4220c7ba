"""Variables and parameters: one concept every analysis and pass asks, instead of op types.

A *variable* is where a training step's persistent state lives: a TF1 `VariableV2` (a reference
tensor), a `VarHandleOp` (a resource variable), or, in a GraphDef exported from a TF2
`tf.function`, a `Placeholder` of dtype `resource` that the function captured (the program binds
it to its variable when it calls the function). A *parameter* is a value computed from constants
and variables alone: a `ReadVariableOp`, a ref variable's `Identity`, a cast or reshape of a
weight. Parameters are never recomputed for their own sake (only copied with a recomputed
node that reads them, when computed from resource reads: `Context.copyable_parameters`), never
a way around a bottleneck and never the source of activations; an activation is anything
computed from fed data.

The value of a captured variable has no shape on its placeholder; it comes from the tensors its
readers and writers carry (`_output_shapes` written by `as_graph_def(add_shapes=True)`).
"""

from __future__ import annotations

from ..core import dtypes, ops
from ..core.errors import GraphRewriteError
from ..core.graph import Graph
from ..core.tensor_ref import TensorRef
from . import bind
from .shapes import Shapes, TensorInfo

__all__ = ["VARIABLE_OPS", "READ_OPS", "is_variable", "variables", "parameter_nodes", "value_info",
           "unknown_variables"]

VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp", "AutoReloadVariable"})
# Reads of a variable's current value: stateful in the registry, but parameters all the same.
READ_OPS = frozenset({"ReadVariableOp", "VariableShape"})


def is_variable(graph: Graph, name: str) -> bool:
    """A TF1 or resource variable, or a TF2 function's captured-variable placeholder."""
    node = graph.node_def(name)
    return node.op in VARIABLE_OPS or bind.is_resource_placeholder(node)


def variables(graph: Graph) -> list[str]:
    """The graph's variables (not a `tf.data` iterator's handle, also a resource placeholder)."""
    handles = bind.iterators(graph)
    return [n for n in graph.nodes() if is_variable(graph, n) and n not in handles]


def parameter_nodes(graph: Graph, constant: frozenset | set,
                    order: list[str] | None = None) -> frozenset:
    """Variables and the nodes computed from variables and constants alone (at least one
    variable among their sources: what only constants feed is `constant`, not a parameter)."""
    found: set[str] = set()
    for name in order or graph.topological_order():
        if name in constant:
            continue
        op = graph.op(name)
        if is_variable(graph, name):
            found.add(name)
            continue
        if op not in READ_OPS and (op == "Const" or ops.is_stateful(op)):
            continue
        inputs = graph.data_inputs(name)
        if inputs and all(r.node in found or r.node in constant for r in inputs) and any(
                r.node in found for r in inputs):
            found.add(name)
    return frozenset(found)


def value_info(graph: Graph, shapes: Shapes, name: str) -> TensorInfo | None:
    """Dtype and shape of a variable's value (not of its handle); None when nothing says."""
    node = graph.node_def(name)
    if node.op == "VarHandleOp":
        shape = node.attr["shape"].shape
        dims = None if shape.unknown_rank else tuple(None if d.size < 0 else d.size
                                                      for d in shape.dim)
        return TensorInfo(node.attr["dtype"].type, dims)
    if node.op not in bind.PLACEHOLDERS:
        return shapes[TensorRef(name)]
    try:
        spec = bind.value_spec(graph, shapes, name)
    except GraphRewriteError:
        return None
    return TensorInfo(dtypes.base(spec.dtype), spec.shape)


def unknown_variables(graph: Graph, shapes: Shapes) -> list[str]:
    """Captured-variable placeholders whose value shape nothing in the graph gives."""
    return [n for n in bind.resource_placeholders(graph) if value_info(graph, shapes, n) is None]

