"""Shapes, dtypes and byte sizes of every tensor.

TensorFlow's own shape inference does the work: the GraphDef is imported into a `tf.Graph`, whose
C++ shape functions (with constant inputs evaluated) give each output a dtype and shape.
`_output_shapes` attributes fill in dimensions inference left unknown. `--input-shape` fixes the
unknown dimensions of placeholders before inference (a shape that conflicts with the graph's is
refused). Whatever stays unknown is reported by `Shapes.unknown`, never counted as 1.

The importer refuses a whole graph for one node (an op not in TensorFlow's registry, a name it
does not allow, a shape function that fails), so such a node is imported under a valid name or
cut out of the import (`_Trial`): everything else is still inferred.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from dataclasses import dataclass, field

from tensorflow.core.framework import types_pb2

from ..core import dtypes, ops, tf_import
from ..core.errors import GraphRewriteError
from ..core.graph import Graph
from ..core.tensor_ref import TensorRef
from . import loop_shapes, partition_shapes, slice_shapes, sparse_shapes

__all__ = ["KERNEL_SIZED", "SAME_SHAPE_OPS", "MAX_CUT", "TensorInfo", "Shapes", "parse_input_shape",
           "infer", "record", "tensorflow_shapes", "imported", "c_imported"]

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
# A node name TensorFlow's importer accepts (`IsValidNodeName`).
_VALID_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_./-]*(>[A-Za-z0-9.][A-Za-z0-9_./-]*)*")
# Where an import error names the node it failed on.
_BLAMED = (re.compile(r"\{\{node ([^}]+)\}\}"), re.compile(r"[Nn]ode '([^']+)'"),
           re.compile(r"of node (\S+) was passed"))
MAX_CUT = 32  # nodes import errors name, cut out before giving up on TensorFlow's inference


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
    # nodes whose size is an estimate, not known (`partition_shapes`: a Where's even share)
    estimated: list[str] = field(default_factory=list)

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

    def with_copies(self, copies, forwards: dict | None = None) -> "Shapes":
        """New Shapes: these tensors and, for each (node, copy) pair of `copies` (new nodes),
        the node's outputs again as the copy's (a rewrite's copies compute what their
        originals do), and for each new node of `forwards` (node -> the tensor it forwards)
        that tensor as its output; the node index is extended, not built again over every
        tensor."""
        index = self._index()
        found = Shapes(dict(self.tensors))
        extended = dict(index)
        for name, copy in copies:
            refs = index.get(name, ())
            for ref in refs:
                found.tensors[TensorRef(copy, ref.port)] = self.tensors[ref]
            if refs:
                extended[copy] = [TensorRef(copy, ref.port) for ref in refs]
        for name, ref in (forwards or {}).items():
            found.tensors[TensorRef(name)] = found.tensors[ref]
            extended[name] = [TensorRef(name)]
        found._outputs_of, found._indexed = extended, (found.tensors, len(found.tensors))
        return found

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


def infer(graph: Graph, input_shapes: dict[str, tuple] | None = None,
          level: int = logging.WARNING) -> Shapes:
    """Shapes of every tensor, by TensorFlow's shape inference (plus `_output_shapes`).
    `input_shapes` (placeholder -> dims, None unknown) that conflict with the graph's shapes are
    a GraphRewriteError. What inference left out is logged at `level` (a graph Grappler wrote
    is none of the user's: its nodes' stale `_output_shapes` are nothing to act on)."""
    graph_def = graph.to_graph_def()
    for name, shape in (input_shapes or {}).items():
        _fix_placeholder(graph, graph_def, name, shape)
    shapes = Shapes()
    inference = _inferred(graph_def)
    if input_shapes and (inference.cut or inference.failed):
        _refuse_conflicts(graph, input_shapes, inference)
    inference.log(level)
    inferred = inference.shapes
    slice_shapes.refine_shapes(graph_def, inferred, tensorflow_shapes)
    shapes.estimated = sparse_shapes.refine_shapes(graph_def, inferred, tensorflow_shapes)
    shapes.estimated += partition_shapes.refine_shapes(graph_def, inferred, tensorflow_shapes)
    loop_shapes.refine_shapes(graph_def, inferred, tensorflow_shapes)
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


def _refuse_conflicts(graph: Graph, input_shapes: dict[str, tuple], inference) -> None:
    """A GraphRewriteError if TensorFlow refuses nodes with `input_shapes` that it accepts
    without them: the shapes given conflict with the graph's."""
    without = _inferred(graph.to_graph_def())
    refused = [(node, why) for node, why in inference.cut.items() if node not in without.cut]
    if inference.failed and not without.failed:
        refused.append(("", inference.failed))
    if refused:
        given = ", ".join(f"{name}:{_dims(shape)}" for name, shape in input_shapes.items())
        raise GraphRewriteError(f"input shape {given} conflicts with the graph's shapes: "
                                f"{refused[0][1]}")


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


def _dims(shape: tuple, sep: str = ",") -> str:
    return sep.join("?" if d is None else str(d) for d in shape)


def _fix_placeholder(graph: Graph, graph_def, name: str, shape: tuple) -> None:
    if name not in graph:
        raise GraphRewriteError(f"${{input_shapes}} names '{name}', which is not a node of the "
                                "graph")
    node = next(n for n in graph_def.node if n.name == name)
    if "shape" not in node.attr:
        raise GraphRewriteError(f"${{input_shapes}}: '{name}' is a {node.op}, not a placeholder")
    proto = node.attr["shape"].shape
    known = None if proto.unknown_rank else tuple(None if d.size < 0 else d.size
                                                  for d in proto.dim)
    if known is not None and (len(known) != len(shape) or any(
            k is not None and d is not None and k != d for k, d in zip(known, shape))):
        raise GraphRewriteError(f"input shape {name}:{_dims(shape)} conflicts with the "
                                f"placeholder's shape [{_dims(known, ', ')}] (only unknown "
                                "dimensions can be fixed)")
    proto.Clear()
    for index, dim in enumerate(shape):  # `?` keeps a dimension the placeholder knows
        dim = known[index] if dim is None and known is not None else dim
        proto.dim.add(size=-1 if dim is None else dim)


def tensorflow_shapes(graph_def) -> dict[str, list[tuple[int, tuple | None]]]:
    """node -> [(dtype, shape)] per output, from importing into a tf.Graph (`_inferred`)."""
    inference = _inferred(graph_def)
    inference.log(logging.DEBUG)
    return inference.shapes


@dataclass
class _Inference:
    """What TensorFlow's importer inferred: node -> [(dtype, shape)] per output; the nodes cut
    out of the import, with why; and, if it gave up, why (only `_output_shapes` are used)."""

    shapes: dict
    cut: dict[str, str] = field(default_factory=dict)
    failed: str = ""

    def log(self, level: int) -> None:
        if self.failed:
            log.warning("TensorFlow cannot import the graph for shape inference (%s); only "
                        "recorded _output_shapes are used", self.failed)
        if self.cut:
            node, why = next(iter(self.cut.items()))
            others = f" and {len(self.cut) - 1} more" if len(self.cut) > 1 else ""
            log.log(level, "shape inference left out node '%s' (%s)%s: their outputs are "
                    "sized by their _output_shapes, else unknown, as is what is computed from "
                    "them", node, why, others)


def _inferred(graph_def) -> _Inference:
    """Import `graph_def` for its shapes. Ops not in TensorFlow's registry are cut out
    (`_Trial`) first; then each node an import error names, and the import tried again, up to
    MAX_CUT times."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    functions = {f.signature.name for f in graph_def.library.function}
    cut = {n.name: f"op '{n.op}' is not in TensorFlow's op registry" for n in graph_def.node
           if not ops.is_known(n.op, functions)}
    for _ in range(MAX_CUT + 1):
        trial = _Trial(graph_def, cut)
        try:
            operations = imported(trial.graph_def)
        except (ValueError, TypeError, tf.errors.OpError) as err:
            why = _reason(err)
            blamed = trial.blamed(str(err))
            if blamed is None:
                break
            cut[blamed] = why
            continue
        return _Inference(trial.results(operations), cut)
    return _Inference(_recorded_only(graph_def), failed=why)


def _reason(err: Exception) -> str:
    """An import error's first line, the node it names written as `node 'NAME'`.

    >>> _reason(ValueError("Shapes differ for '{{node a/b}} = Add[T=DT_FLOAT](x, y)' with ...\\n"))
    "Shapes differ for node 'a/b' with ..."
    """
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return re.sub(r"'\{\{node ([^}]+)\}\}[^']*'", r"node '\1'", line)[:300]


def _recorded(node) -> list:
    """The node's `_output_shapes` protos (read without adding the attribute)."""
    return node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else []


class _Trial:
    """`graph_def` as TensorFlow's importer can take it: nodes with names it refuses renamed,
    and the nodes `cut` left out, each of their outputs that another node reads replaced by a
    placeholder (typed as that reader expects, shaped by the node's `_output_shapes`). The
    graph is copied only when there is something to change."""

    def __init__(self, graph_def, cut: dict[str, str]):
        self.source, self.cut = graph_def, cut
        self.renamed: dict[str, str] = {}  # original -> imported name
        self.stand_ins: dict[str, TensorRef] = {}  # placeholder -> the cut output it replaces
        invalid = [n.name for n in graph_def.node if not _VALID_NAME.fullmatch(n.name)]
        if not invalid and not cut:
            self.graph_def = graph_def
            return
        taken = {n.name for n in graph_def.node}
        fresh = (name for name in (f"graphrewrite_import/{i}" for i in range(len(taken) * 2 + 2))
                 if name not in taken)
        self.renamed = {name: next(fresh) for name in invalid if name not in cut}
        nodes = {n.name: n for n in graph_def.node}
        self.graph_def = type(graph_def)()
        self.graph_def.versions.CopyFrom(graph_def.versions)
        self.graph_def.library.CopyFrom(graph_def.library)
        placeholders: dict[TensorRef, str] = {}
        for node in graph_def.node:
            if node.name in cut:
                continue
            new = self.graph_def.node.add()
            new.CopyFrom(node)
            new.name = self.renamed.get(node.name, node.name)
            if "_class" in new.attr:  # colocation may name a node cut or renamed here
                del new.attr["_class"]
            del new.input[:]
            data_index = -1
            for text in node.input:
                ref = TensorRef.parse(text)
                data_index += not ref.is_control
                if ref.node not in cut:
                    new.input.append(str(ref._replace(node=self.renamed.get(ref.node, ref.node))))
                elif not ref.is_control:
                    if ref not in placeholders:
                        placeholders[ref] = next(fresh)
                        self._stand_in(placeholders[ref], nodes[ref.node], ref.port,
                                       _input_dtype(node, data_index))
                    new.input.append(placeholders[ref])

    def _stand_in(self, name: str, cut_node, port: int, dtype: int | None) -> None:
        placeholder = self.graph_def.node.add(name=name, op="Placeholder")
        placeholder.attr["dtype"].type = dtype or _declared_dtype(cut_node) or types_pb2.DT_FLOAT
        recorded = _recorded(cut_node)
        if port < len(recorded):
            placeholder.attr["shape"].shape.CopyFrom(recorded[port])
        else:
            placeholder.attr["shape"].shape.unknown_rank = True
        self.stand_ins[name] = TensorRef(cut_node.name, port)

    def blamed(self, message: str) -> str | None:
        """The node of the source graph an import error names, if it names one."""
        original = {v: k for k, v in self.renamed.items()}
        names = {n.name for n in self.graph_def.node}
        for pattern in _BLAMED:
            for found in pattern.findall(message):
                if found in names and found not in self.stand_ins:
                    return original.get(found, found)
        return None

    def results(self, operations) -> dict[str, list[tuple[int, tuple | None]]]:
        original = {v: k for k, v in self.renamed.items()}
        result, stood_in = {}, {}
        for op in operations:
            outputs = []
            for tensor in op.outputs:
                dims, unknown_rank = tensor._shape  # the C++ tensor's; `.shape` wraps it
                outputs.append((tensor.dtype.as_datatype_enum,
                                None if unknown_rank else tuple(dims)))
            if op.name in self.stand_ins:
                stood_in[self.stand_ins[op.name]] = outputs[0]
            else:
                result[original.get(op.name, op.name)] = outputs
        for node in self.source.node:
            if node.name not in self.cut:
                continue
            recorded = [_from_proto(s) for s in _recorded(node)]
            count = max([len(recorded)] + [ref.port + 1 for ref in stood_in
                                            if ref.node == node.name])
            declared = _declared_dtype(node) or types_pb2.DT_INVALID
            result[node.name] = [
                stood_in.get(TensorRef(node.name, port),
                             (declared, recorded[port] if port < len(recorded) else None))
                for port in range(count)]
        return result


def _input_dtype(node, index: int) -> int | None:
    """The dtype `node`'s registered op expects at data input `index`, if the registry and the
    node's attributes say."""
    op_def = ops.op_def(node.op)
    if op_def is None:
        return None
    defaults = {a.name: a.default_value for a in op_def.attr}

    def attr(name: str):
        return node.attr[name] if name in node.attr else defaults.get(name)

    start = 0
    for arg in op_def.input_arg:
        types = list(attr(arg.type_list_attr).list.type) if arg.type_list_attr and attr(
            arg.type_list_attr) is not None else None
        count = (len(types) if types is not None else
                 attr(arg.number_attr).i if arg.number_attr and attr(arg.number_attr) else 1)
        if index < start + count:
            if types is not None:
                return types[index - start]
            if arg.type_attr:
                value = attr(arg.type_attr)
                return value.type if value is not None and value.type else None
            return arg.type or None
        start += count
    return None


def _declared_dtype(node) -> int | None:
    """The dtype a node's own attributes give its outputs (T, dtype, out_type), if one does."""
    for name in ("T", "dtype", "out_type", "Tout"):
        if name in node.attr and node.attr[name].type:
            return node.attr[name].type
    return None


def imported(graph_def, public: bool = False) -> list:
    """The graph's operations after TensorFlow's importer ran its shape functions: through
    `c_imported`, or, should TensorFlow's internals differ or `public` ask for it, through
    `tf.graph_util.import_graph_def` (same shapes, slower)."""
    import tensorflow as tf

    if not public:
        try:
            return c_imported(graph_def)
        except (AttributeError, ImportError) as err:  # not this TensorFlow's internals
            log.debug("shape inference through the public importer (%s)", err)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return graph.get_operations()


def c_imported(graph_def) -> list:
    """`import_graph_def` without the Python side it builds for every operation (colocation
    groups, control-flow contexts, name scopes: three quarters of its time on a 37k-node graph,
    3.4 s of 4.4, none of it needed to read shapes). The C++ import is called as the public one
    calls it, and each operation gets only its output tensors."""
    from tensorflow.python.framework import ops as tf_ops

    graph = tf_import.c_import(graph_def)
    operations = []
    for c_op in graph.new_operations():
        op = tf_ops.Operation(c_op, tf_ops.SymbolicTensor)
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
