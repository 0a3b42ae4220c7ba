"""Shapes, dtypes and byte sizes of every tensor.

TensorFlow's own shape inference does the work: the GraphDef is imported into a `tf.Graph`, whose
C++ shape functions (with constant inputs evaluated) give each output a dtype and shape.
`_output_shapes` attributes fill in dimensions inference left unknown. `--input-shape` fixes the
unknown dimensions of placeholders before inference. Whatever stays unknown is reported by
`Shapes.unknown`, never counted as 1.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, field

from tensorflow.core.framework import types_pb2

from . import dtypes, loops
from .errors import GraphRewriteError
from .graph import Graph
from .tensor_ref import TensorRef

log = logging.getLogger(__name__)

# Bytes per element; handles (resource) are tiny and owned elsewhere, so they count as 0.
_ITEM_BYTES = {
    types_pb2.DT_FLOAT: 4, types_pb2.DT_DOUBLE: 8, types_pb2.DT_HALF: 2, types_pb2.DT_BFLOAT16: 2,
    types_pb2.DT_INT8: 1, types_pb2.DT_UINT8: 1, types_pb2.DT_INT16: 2, types_pb2.DT_UINT16: 2,
    types_pb2.DT_INT32: 4, types_pb2.DT_UINT32: 4, types_pb2.DT_INT64: 8, types_pb2.DT_UINT64: 8,
    types_pb2.DT_BOOL: 1, types_pb2.DT_COMPLEX64: 8, types_pb2.DT_COMPLEX128: 16,
    types_pb2.DT_QINT8: 1, types_pb2.DT_QUINT8: 1, types_pb2.DT_QINT32: 4,
    types_pb2.DT_RESOURCE: 0,
}
# Outputs whose size the kernel decides (shape inference says "unknown"): an empty tensor on the
# CPU, a small cuDNN workspace on a GPU. Counted as empty rather than reported as unknown.
KERNEL_SIZED = {("FusedBatchNormV3", 5), ("_FusedBatchNormEx", 5)}
SAME_SHAPE_OPS = frozenset({"ZerosLike", "OnesLike", "Identity", "StopGradient"})


@dataclass(frozen=True)
class TensorInfo:
    """dtype (DataType enum, refs resolved) and shape (None: unknown rank; None dims: unknown)."""

    dtype: int
    shape: tuple | None

    @functools.cached_property  # read hundreds of thousands of times by each simulation
    def nbytes(self) -> int | None:
        """Bytes of the tensor's buffer, or None when a dimension or the element size is unknown."""
        item = _ITEM_BYTES.get(dtypes.base(self.dtype))
        if item is None or self.shape is None or any(d is None for d in self.shape):
            return None
        return item * math.prod(self.shape)


@dataclass
class Shapes:
    """Every output tensor of a graph with what is known of it."""

    tensors: dict[TensorRef, TensorInfo] = field(default_factory=dict)

    def __post_init__(self):
        # node -> its output refs, built from `tensors` in one pass and rebuilt when `tensors`
        # is replaced or gains entries (entries are added or overwritten, never deleted).
        self._outputs_of: dict[str, list[TensorRef]] = {}
        self._indexed: tuple[dict | None, int] = (None, -1)  # the `tensors` indexed, its length

    def __getitem__(self, ref: TensorRef) -> TensorInfo | None:
        return self.tensors.get(ref)

    def nbytes(self, ref: TensorRef) -> int | None:
        info = self.tensors.get(ref)
        return None if info is None else info.nbytes

    def outputs(self, node: str) -> list[TensorRef]:
        """The node's output tensors (port order); empty for nodes TensorFlow could not import."""
        return list(self._index().get(node, ()))

    def outputs_of(self, nodes) -> dict[str, list[TensorRef]]:
        """`outputs` of each of `nodes`, at once (a simulation asks for every node's)."""
        index = self._index()
        return {node: list(index.get(node, ())) for node in nodes}

    def _index(self) -> dict[str, list[TensorRef]]:
        tensors = self.tensors
        indexed, size = self._indexed
        if indexed is not tensors or size != len(tensors):
            self._outputs_of = _outputs_index(tensors)
            self._indexed = (tensors, len(tensors))
        return self._outputs_of

    @property
    def unknown(self) -> list[TensorRef]:
        """Tensors whose size is unknown (unknown dims, unknown rank, or variable-size dtype)."""
        return sorted(ref for ref, info in self.tensors.items() if info.nbytes is None)


def _outputs_index(tensors: dict[TensorRef, TensorInfo]) -> dict[str, list[TensorRef]]:
    """node -> [node:0, node:1, ...] up to the first port `tensors` lacks."""
    ports: dict[str, dict[int, TensorRef]] = {}
    for ref in tensors:
        ports.setdefault(ref.node, {})[ref.port] = ref
    index = {}
    for node, by_port in ports.items():
        refs = []
        while len(refs) in by_port:
            refs.append(by_port[len(refs)])
        if refs:
            index[node] = refs
    return index


def parse_input_shape(text: str) -> tuple[str, tuple]:
    """`x:4,224,224,3` -> ('x', (4, 224, 224, 3)); `?` or -1 keeps a dimension unknown.

    >>> parse_input_shape("images:8,-1,3")
    ('images', (8, None, 3))
    """
    name, sep, dims = text.rpartition(":")
    if not sep or not name:
        raise ValueError(f"expected NAME:d0,d1,... not '{text}'")
    try:
        shape = tuple(None if d.strip() in ("?", "-1") else int(d) for d in dims.split(",")
                      if d.strip()) if dims.strip() else ()
    except ValueError:
        raise ValueError(f"dimensions of '{name}' must be integers: '{dims}'") from None
    if any(d is not None and d < 0 for d in shape):
        raise ValueError(f"negative dimension in '{text}'")
    return name, shape


def infer(graph: Graph, input_shapes: dict[str, tuple] | None = None) -> Shapes:
    """Shapes of every tensor, by TensorFlow's shape inference (plus `_output_shapes`)."""
    graph_def = graph.to_graph_def()
    for name, shape in (input_shapes or {}).items():
        _fix_placeholder(graph, graph_def, name, shape)
    shapes = Shapes()
    inferred = _tensorflow_shapes(graph_def)
    loops.refine_shapes(graph_def, inferred, _tensorflow_shapes)
    for node in graph_def.node:
        recorded = [_from_proto(s) for s in node.attr["_output_shapes"].list.shape] \
            if "_output_shapes" in node.attr and node.name not in (input_shapes or {}) else []
        for port, (dtype, shape) in enumerate(inferred.get(node.name, [])):
            if port < len(recorded):
                shape = _merge(shape, recorded[port])
            if (node.op, port) in KERNEL_SIZED and (shape is None or None in shape):
                shape = (0,)
            shapes.tensors[TensorRef(node.name, port)] = TensorInfo(dtype, shape)
    _follow_kernel_sized(graph, shapes)
    return shapes


def record(graph: Graph, name: str, shapes: Shapes) -> None:
    """Write what `shapes` knows of node `name`'s outputs as its `_output_shapes`."""
    from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2

    infos = [shapes[ref] for ref in shapes.outputs(name)]
    if not infos or any(i is None or i.shape is None for i in infos):
        return
    value = attr_value_pb2.AttrValue()
    for info in infos:
        value.list.shape.append(tensor_shape_pb2.TensorShapeProto(dim=[
            tensor_shape_pb2.TensorShapeProto.Dim(size=-1 if d is None else d)
            for d in info.shape]))
    graph.set_attr(name, "_output_shapes", value)


def _follow_kernel_sized(graph: Graph, shapes: Shapes) -> None:
    """Ops shaped like their input (ZerosLike of a kernel-sized output) take the input's size."""
    unsized = {ref.node for ref, info in shapes.tensors.items() if info.nbytes is None}
    if not any(graph.op(name) in SAME_SHAPE_OPS for name in unsized if name in graph):
        return  # nothing to fill in: no walk over the whole graph (0.8 s at 99k nodes)
    for name in graph.topological_order():
        if graph.op(name) not in SAME_SHAPE_OPS:
            continue
        ref, inputs = TensorRef(name), graph.data_inputs(name)
        info = shapes[ref]
        if info is not None and info.nbytes is None and inputs and shapes[inputs[0]] is not None:
            shapes.tensors[ref] = TensorInfo(info.dtype, shapes[inputs[0]].shape)


def _fix_placeholder(graph: Graph, graph_def, name: str, shape: tuple) -> None:
    if name not in graph:
        raise GraphRewriteError(f"--input-shape names '{name}', which is not a node of the graph")
    node = next(n for n in graph_def.node if n.name == name)
    if "shape" not in node.attr:
        raise GraphRewriteError(f"--input-shape: '{name}' is a {node.op}, not a placeholder")
    proto = node.attr["shape"].shape
    proto.Clear()
    for dim in shape:
        proto.dim.add(size=-1 if dim is None else dim)


def _tensorflow_shapes(graph_def) -> dict[str, list[tuple[int, tuple | None]]]:
    """node -> [(dtype, shape)] per output, from importing into a tf.Graph; {} if that fails."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    try:
        operations = _imported(graph_def)
    except (ValueError, TypeError, tf.errors.OpError) as err:
        log.warning("TensorFlow cannot import the graph for shape inference (%s); only recorded "
                    "_output_shapes are used", str(err).splitlines()[0][:200])
        return _recorded_only(graph_def)
    result = {}
    for op in operations:
        result[op.name] = []
        for tensor in op.outputs:
            dims, unknown_rank = tensor._shape  # the C++ tensor's; `.shape` wraps it
            result[op.name].append((tensor.dtype.as_datatype_enum,
                                    None if unknown_rank else tuple(dims)))
    return result


def _imported(graph_def, public: bool = False) -> list:
    """The graph's operations after TensorFlow's importer ran its shape functions: through
    `_c_imported`, or, should TensorFlow's internals differ or `public` ask for it, through
    `tf.graph_util.import_graph_def` (same shapes, slower)."""
    import tensorflow as tf

    if not public:
        try:
            return _c_imported(graph_def)
        except (AttributeError, ImportError) as err:  # not this TensorFlow's internals
            log.debug("shape inference through the public importer (%s)", err)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return graph.get_operations()


def _c_imported(graph_def) -> list:
    """`import_graph_def` without the Python side it builds for every operation (colocation
    groups, control-flow contexts, name scopes: three quarters of its time on a 37k-node graph,
    3.4 s of 4.4, none of it needed to read shapes). The C++ import is called as the public one
    calls it, and each operation gets only its output tensors."""
    import tensorflow as tf
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import c_api_util, importer, ops

    graph = tf.Graph()
    scoped = c_api_util.ScopedTFImportGraphDefOptions()
    importer._PopulateTFImportGraphDefOptions(scoped.options, "", {}, None, False, False)
    with c_api_util.tf_buffer(graph_def.SerializeToString()) as serialized:
        with graph._c_graph.get() as c_graph:
            results = c_api.TF_GraphImportGraphDefWithResults(c_graph, serialized,
                                                              scoped.options)
    c_api_util.ScopedTFImportGraphDefResults(results)  # frees them
    operations = []
    for c_op in graph.new_operations():
        op = ops.Operation(c_op, ops.SymbolicTensor)
        op.graph = graph
        op._init_outputs()
        operations.append(op)
    return operations


def _recorded_only(graph_def) -> dict:
    result = {}
    for node in graph_def.node:
        if "_output_shapes" in node.attr:
            result[node.name] = [(types_pb2.DT_INVALID, _from_proto(s))
                                 for s in node.attr["_output_shapes"].list.shape]
    return result


def _from_proto(proto) -> tuple | None:
    if proto.unknown_rank:
        return None
    return tuple(None if d.size < 0 else d.size for d in proto.dim)


def _merge(inferred: tuple | None, recorded: tuple | None) -> tuple | None:
    """Inferred dims win; recorded ones fill the gaps (when ranks agree)."""
    if inferred is None:
        return recorded
    if recorded is None or len(recorded) != len(inferred):
        return inferred
    return tuple(r if i is None else i for i, r in zip(inferred, recorded))
