"""A TF2 step's captured variables: resource placeholders, and variables bound to them to run it.

A GraphDef exported from a `tf.function` (`concrete_fn.graph.as_graph_def(add_shapes=True)`)
takes each captured variable as a `Placeholder` of dtype resource whose own shape says nothing;
the variable's dtype is on its readers (`ReadVariableOp`, `Assign*VariableOp`, `ResourceGather`:
`dtype`; `ResourceApply*`: `T`) and its value shape on what they read or write (`_output_shapes`
that `add_shapes=True` records, or what TensorFlow's shape inference finds).

Running such a step means giving each placeholder a variable. The convention used by `measure`
and `verify`: a feed given for a resource placeholder is the *initial value* of a fresh variable
bound to it, not a tensor to feed. The variable is a `VarHandleOp` the graph is imported onto
(`input_map`), assigned once from a fed placeholder, so its bytes are held once, by the variable.
`seeded_value` makes those initial values: small, finite, the same for the same seed and name.
A variable the diet pass stored in 16 bits (its placeholder marked `_graphrewrite_diet`) gets
the same value quantized, so a diet step starts from the original's weights.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import types_pb2

from ..core import dtypes, ops
from ..core.errors import GraphRewriteError
from ..core.graph import Graph
from ..core.names import DIET_ATTR
from ..core.tensor_ref import TensorRef
from . import loops

__all__ = ["PLACEHOLDERS", "HANDLE_FORWARDERS", "VALUE_ARGS", "SCALE", "EXPORT_HINT", "BIND_SCOPE",
           "INT16_MAX", "ValueSpec", "is_resource_placeholder", "resource_placeholders",
           "ITERATOR_OPS", "iterators",
           "value_spec", "export_hint", "ROW_OPS", "seeded_value", "dieted", "seeded_values",
           "diet_mark",
           "users", "DENSE_WRITES", "BRANCHES", "CALLS", "through_forwarders", "Bound",
           "resource_placeholder_names", "fed_copy", "bind", "INDEX_FORWARDERS", "index_limit"]

log = logging.getLogger(__name__)

PLACEHOLDERS = ("Placeholder", "PlaceholderV2")
# Ops that read or write a variable's rows by index: none of them records its row count.
ROW_OPS = ("ResourceGather", "ResourceGatherNd", "ResourceScatterAdd", "ResourceScatterSub",
           "ResourceScatterUpdate", "ResourceScatterMul", "ResourceScatterDiv",
           "ResourceScatterMin", "ResourceScatterMax", "ResourceScatterNdAdd",
           "ResourceScatterNdUpdate")
# Ops that pass a handle through unchanged: the readers behind them read the same variable
# (`Switch`: a functional `If` as Grappler lowers it), and which of their outputs do.
HANDLE_FORWARDERS = {"Identity": (0,), "IdentityN": None, "Switch": (0, 1), "Enter": (0,)}
# Input argument of a writer that holds a value of the variable's shape.
VALUE_ARGS = ("value", "grad", "delta")
# Seeded variables are drawn from [0, SCALE): finite, small, and not negative, because the step
# cannot tell a weight from a second-moment slot whose square root it takes.
SCALE = 0.1
EXPORT_HINT = "export the step with concrete_fn.graph.as_graph_def(add_shapes=True)"
BIND_SCOPE = "graphrewrite_bound"
INT16_MAX = 32767  # diet's int16 range is symmetric: [-INT16_MAX, INT16_MAX]


@dataclass(frozen=True)
class ValueSpec:
    """What a resource placeholder's variable holds: a DataType enum and a fully known shape."""

    dtype: int
    shape: tuple


ITERATOR_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional"})


def is_resource_placeholder(node) -> bool:
    """A NodeDef that is a placeholder of dtype resource: a TF2 step's captured variable."""
    return node.op in PLACEHOLDERS and node.attr["dtype"].type == dtypes.RESOURCE


def resource_placeholders(graph: Graph) -> list[str]:
    """Names of the graph's placeholders of dtype resource that hold variables, sorted: not a
    `tf.data` iterator's (what Keras's `model.train_function` reads its batches from)."""
    handles = iterators(graph)
    return sorted(n for n in graph.nodes() if is_resource_placeholder(graph.node_def(n))
                  and n not in handles)


def iterators(graph: Graph) -> set[str]:
    """The resource placeholders only iterator ops read, in the graph or in the functions a
    call or a loop passes them to (Keras's `steps_per_execution` loop reads its batches in its
    body): a `tf.data` iterator's handle."""
    def reader_ops(name):
        for user, slot in graph.consumers(TensorRef(name)):
            if slot is None or slot < 0:
                continue
            if graph.op(user) not in CALLS:
                yield graph.op(user)
            for function, arg in _arguments(graph, user, slot):
                yield from (n.op for n in function.node_def if arg in n.input)

    found = set()
    for name in graph.nodes():
        if is_resource_placeholder(graph.node_def(name)):
            ops_read = list(reader_ops(name))
            if ops_read and all(op in ITERATOR_OPS for op in ops_read):
                found.add(name)
    return found


def value_spec(graph: Graph, shapes, name: str) -> ValueSpec:
    """The dtype and shape of the variable behind resource placeholder `name`, from its readers
    and writers; a GraphRewriteError (one line) when they do not tell."""
    dtype, shape = None, None
    for user, slot in users(graph, name):
        if graph.op(user) in CALLS:
            inside = _read_in_functions(graph, user, slot)
            if inside is not None:
                return inside
            continue
        node = graph.node_def(user)
        attr = "dtype" if "dtype" in node.attr else "T"
        if dtype is None and attr in node.attr and node.attr[attr].type:
            dtype = node.attr[attr].type
        if shape is None:
            shape = _known(_value_shape(graph, shapes, user, slot))
        if dtype is not None and shape is not None:
            return ValueSpec(dtype, shape)
    shape = shape or _scattered_like(graph, shapes, name)
    if dtype is not None and shape is not None:
        return ValueSpec(dtype, shape)
    what = "value shape" if dtype is not None else "dtype and value shape"
    raise GraphRewriteError(f"the {what} of captured variable '{name}' (a resource placeholder) "
                            f"is not recorded on its readers; {export_hint(graph, name)}")


def export_hint(graph: Graph, name: str | None = None) -> str:
    """What to do about a variable whose shape no reader records: export with shapes, unless
    the graph was exported so (advice that was followed already misleads). A variable only
    gathered and scattered by rows (an embedding and its slot under a sparse gradient) records
    no row count in any export: its value must be given."""
    ops = sorted({graph.op(user) for user, _ in users(graph, name)}) if name else []
    if ops and all(op in ROW_OPS or op.startswith("ResourceSparseApply") for op in ops):
        return (f"it is read and written only a few rows at a time ({', '.join(ops)}), so no "
                "shape in the graph holds its row count: give verify its value with --feed "
                f"{name}=FILE.npy")
    if any("_output_shapes" in graph.node_def(n).attr for n in graph.nodes()):
        return ("the export recorded shapes (add_shapes=True), but none of this variable's "
                "readers shows its value (please report the op that reads it)")
    return EXPORT_HINT


def seeded_value(name: str, spec: ValueSpec, seed: int, diet: str = "") -> np.ndarray:
    """The initial value bound to `name`: a function of the seed and the name alone.

    Floats uniform in [0, SCALE); integers (an optimizer's iteration counter), booleans and
    anything else start at zero. `diet` (a placeholder's DIET_ATTR mark) makes it the float
    value the original graph's variable gets, stored as the diet variable stores it: int16
    rounded to the nearest multiple of the scale, or bfloat16.
    """
    import tensorflow as tf

    if diet:
        return dieted(seeded_value(name, ValueSpec(types_pb2.DT_FLOAT, spec.shape), seed), diet)
    dtype = tf.dtypes.as_dtype(spec.dtype).as_numpy_dtype
    if np.issubdtype(dtype, np.floating):
        rng = np.random.RandomState(zlib.crc32(f"{seed}:{name}".encode()))
        return rng.uniform(0.0, SCALE, spec.shape).astype(dtype)
    return np.zeros(spec.shape, dtype)


def dieted(value: np.ndarray, diet: str) -> np.ndarray:
    """A float value as a variable marked `diet` stores it: int16 rounded to the nearest
    multiple of the scale, or bfloat16."""
    import tensorflow as tf

    fmt, _, scale = diet.partition(" ")
    if fmt == "int16":
        return np.clip(np.round(value / np.float32(scale)), -INT16_MAX,
                       INT16_MAX).astype(np.int16)
    return value.astype(tf.bfloat16.as_numpy_dtype)


def seeded_values(graph: Graph, shapes, seed: int = 0,
                  given: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """Initial values for every resource placeholder not `given`."""
    return {name: seeded_value(name, value_spec(graph, shapes, name), seed,
                               diet_mark(graph, name))
            for name in resource_placeholders(graph) if name not in given}


def diet_mark(graph: Graph, name: str) -> str:
    attr = graph.node_def(name).attr
    return attr[DIET_ATTR].s.decode() if DIET_ATTR in attr else ""


def users(graph: Graph, name: str) -> list[tuple[str, int]]:
    """(node, input slot) of every op that takes the handle, through Identity forwarders."""
    found, todo, seen = [], [TensorRef(name)], set()
    while todo:
        ref = todo.pop()
        for user, slot in graph.consumers(ref):
            if slot is None or slot < 0 or (user, slot) in seen:
                continue
            seen.add((user, slot))
            if graph.op(user) in HANDLE_FORWARDERS:
                ports = HANDLE_FORWARDERS[graph.op(user)]
                todo.extend(TensorRef(user, port) for port in (ports or (slot,)))
            else:
                found.append((user, slot))
    return sorted(found, key=lambda u: (graph.op(u[0]) != "ReadVariableOp", u))


DENSE_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
# Functional ops -> (attributes naming the functions they call, inputs before the arguments).
BRANCHES = ("then_branch", "else_branch")
CALLS = {"If": (BRANCHES, 1), "StatelessIf": (BRANCHES, 1),
         "Case": (("branches",), 1), "StatelessCase": (("branches",), 1),
         "While": (("body",), 0), "StatelessWhile": (("body",), 0),
         "PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0)}


def _arguments(graph: Graph, user: str, slot: int) -> list:
    """(FunctionDef, argument name) of each function the call or loop `user` passes its input
    `slot` to; none for another op."""
    if graph.op(user) not in CALLS:
        return []
    attrs, skipped = CALLS[graph.op(user)]
    node = graph.node_def(user)
    names = [f.name for a in attrs for f in ([node.attr[a].func] if node.attr[a].HasField("func")
                                             else node.attr[a].list.func)]
    library = {f.signature.name: f for f in graph.shell.library.function}
    return [(function, function.signature.input_arg[slot - skipped].name)
            for function in filter(None, map(library.get, names))
            if 0 <= slot - skipped < len(function.signature.input_arg)]


def _read_in_functions(graph: Graph, user: str, slot: int) -> ValueSpec | None:
    """The variable's dtype and shape from a read inside a function `user` calls with it (a
    loss-scale optimizer's update reads its slots only inside its `cond`'s branches): the
    `_output_shapes` a function body's `ReadVariableOp` records."""
    for function, arg in _arguments(graph, user, slot):
        body = {n.name: n for n in function.node_def}
        for body_node in function.node_def:
            if body_node.input[:1] != [arg]:
                continue
            if body_node.op == "ReadVariableOp":
                shown, dtype = body_node, body_node.attr["dtype"].type
            elif body_node.op in DENSE_WRITES and len(body_node.input) > 1:
                shown = body.get(body_node.input[1].split(":")[0])
                dtype = body_node.attr["dtype"].type
            else:
                continue
            recorded = shown.attr["_output_shapes"].list.shape if shown is not None else []
            if len(recorded) == 1 and not recorded[0].unknown_rank:
                dims = tuple(None if d.size < 0 else d.size for d in recorded[0].dim)
                if _known(dims) is not None:
                    return ValueSpec(dtype, dims)
    return None


def _value_shape(graph: Graph, shapes, user: str, slot: int) -> tuple | None:
    """The shape of the variable's value as `user` sees it: a read's output, a dense write's
    value input; None when the op does not show it."""
    op = graph.op(user)
    if op == "ReadVariableOp":
        info = shapes[TensorRef(user)]
        return None if info is None else info.shape
    definition = ops.op_def(op)
    if definition is None or "Sparse" in op or not (op.startswith("ResourceApply")
                                                    or op.endswith("VariableOp")):
        return None
    args = list(definition.input_arg)
    if any(a.number_attr or a.type_list_attr for a in args):
        return None
    index = next((i for i, a in enumerate(args) if a.name in VALUE_ARGS), None)
    data = graph.data_inputs(user)
    if index is None or index >= len(data) or index == slot:
        return None
    info = shapes[data[index]]
    return None if info is None else info.shape


def _scattered_like(graph: Graph, shapes, name: str) -> tuple | None:
    """The shape of a variable read only by gathers and updated only by scatters (an
    embedding's sparse update) from another variable scattered into at the same indices and
    read whole elsewhere: an optimizer's slot for it, which has its shape."""
    scatters = [u for u, slot in users(graph, name) if graph.op(u).startswith("ResourceScatter")
                and slot == 0]
    indices = {graph.data_inputs(u)[1] for u in scatters if len(graph.data_inputs(u)) > 1}
    for ref in indices:
        for other, slot in graph.consumers(ref):
            if other in scatters or not graph.op(other).startswith("ResourceScatter") \
                    or slot != 1:
                continue
            handle = through_forwarders(graph, graph.data_inputs(other)[0])
            if handle.node == name or not is_resource_placeholder(graph.node_def(handle.node)):
                continue
            for user, user_slot in users(graph, handle.node):
                shape = _known(_value_shape(graph, shapes, user, user_slot))
                if shape is not None:
                    return shape
    return None


def through_forwarders(graph: Graph, ref: TensorRef) -> TensorRef:
    """Where a handle comes from, before the Identities that pass it on."""
    while graph.op(ref.node) in HANDLE_FORWARDERS and graph.data_inputs(ref.node):
        ref = graph.data_inputs(ref.node)[0 if graph.op(ref.node) != "IdentityN" else ref.port]
    return ref


# Ops an integer input passes through unchanged in value on its way to what it indexes.
INDEX_FORWARDERS = frozenset({"Identity", "Reshape", "Cast", "Squeeze", "ExpandDims",
                              "Transpose", "StopGradient"})


def index_limit(graph: Graph, shapes, name: str) -> int | None:
    """How many classes or rows integer input `name` indexes, from what reads it: the logits'
    last dimension of a sparse softmax cross entropy, the rows of a gather's table. TensorFlow's
    CPU kernels refuse an index past it (a U-Net's two-class masks); None when no reader
    tells."""
    limits, todo, seen = [], [TensorRef(name)], set()
    while todo:
        ref = todo.pop()
        for user, slot in graph.consumers(ref):
            if slot is None or slot < 0 or user in seen:
                continue
            seen.add(user)
            op, data = graph.op(user), graph.data_inputs(user)
            if op in INDEX_FORWARDERS and slot == 0:
                todo.append(TensorRef(user))
            elif op == "SparseSoftmaxCrossEntropyWithLogits" and slot == 1:
                limits.append(_dimension(shapes, data[0], -1))
            elif op in ("GatherV2", "ResourceGather") and slot == 1:
                table = through_forwarders(graph, data[0])
                if op == "GatherV2":
                    axis = loops.constant_value(graph, shapes, data[2]) if len(data) > 2 else 0
                    limits.append(_dimension(shapes, table, 0) if axis == 0 else None)
                elif graph.op(table.node) == "VarHandleOp":
                    dims = graph.node_def(table.node).attr["shape"].shape.dim
                    limits.append(dims[0].size if dims and dims[0].size > 0 else None)
    known = [limit for limit in limits if limit]
    return min(known) if known else None


def _dimension(shapes, ref: TensorRef, axis: int) -> int | None:
    info = shapes[ref]
    return info.shape[axis] if info is not None and info.shape else None


def _known(shape: tuple | None) -> tuple | None:
    return shape if shape is not None and None not in shape else None


# --------------------------------------------------------------------------- in a session

@dataclass
class Bound:
    """Variables made for a graph about to be imported: the `input_map` that puts their handles
    in place of the placeholders, what initialises them (ops, feed dict), and their reads."""

    input_map: dict
    init_ops: list
    init_feeds: dict
    reads: dict  # placeholder name -> tensor reading its variable
    graph: object = None  # the tf.Graph, once `graph_def` is imported into it


def resource_placeholder_names(graph_def) -> set[str]:
    """`resource_placeholders` on a GraphDef message, without building a Graph."""
    return {n.name for n in graph_def.node if is_resource_placeholder(n)}


def fed_copy(bound: Bound, value: np.ndarray, name: str):
    """A tensor holding `value`, fed through a new placeholder (added to `bound.init_feeds`) and
    copied by TensorFlow. A fed array lends its own memory to the tensor, outside TensorFlow's
    allocator; a variable assigned from it would keep that buffer, and its bytes would be missing
    from every measured peak (a whole model's weights and optimizer slots)."""
    import tensorflow as tf

    initial = tf.compat.v1.placeholder(tf.dtypes.as_dtype(value.dtype), value.shape, name=name)
    bound.init_feeds[initial] = value
    return tf.raw_ops.DeepCopy(x=initial, name=name + "_copy")


def bind(graph_def, values: dict[str, np.ndarray]) -> Bound:
    """Make one variable per `values` entry in the current default tf.Graph, before `graph_def`
    is imported into it; their names stay clear of the graph's own."""
    import tensorflow as tf

    taken = {n.name.split("/")[0] for n in graph_def.node}
    scope, k = BIND_SCOPE, 0
    while scope in taken:
        k += 1
        scope = f"{BIND_SCOPE}_{k}"
    bound = Bound({}, [], {}, {})
    with tf.name_scope(scope + "/"):
        for i, (name, value) in enumerate(sorted(values.items())):
            dtype = tf.dtypes.as_dtype(value.dtype)
            handle = tf.raw_ops.VarHandleOp(dtype=dtype, shape=value.shape,
                                            shared_name=f"{scope}/var_{i}", name=f"var_{i}")
            initial = fed_copy(bound, value, f"initial_{i}")
            bound.init_ops.append(tf.raw_ops.AssignVariableOp(resource=handle, value=initial))
            bound.reads[name] = tf.raw_ops.ReadVariableOp(resource=handle, dtype=dtype)
            bound.input_map[f"{name}:0"] = handle
    log.info("bound %d captured variables", len(values))
    return bound
