"""Chunked loss (lossy): the final projection and its softmax cross entropy computed a block of
rows at a time, so the logits and their gradient never exist whole.

A language model's or a tagger's last layer makes logits of [rows, vocabulary]: at batch 16,
128 tokens and 8,000 classes, 62.5 MiB, and the cross entropy's gradient as much again (it
takes the logits' buffer). They are the largest tensors of the step and live at its peak, a
floor no recomputation plan can lower: the weight's gradient needs all of them. Liger's fused
linear cross entropy and Apple's Cut Cross-Entropy compute them a block of rows at a time; so
does this pass, on the graph. Where the loss is `SparseSoftmaxCrossEntropyWithLogits` (or the
dense one) of `MatMul(x, w)` (a bias and row-keeping reshapes between allowed: a `BiasAdd`,
or an `AddV2` of a vector of the classes, `tf.matmul(x, w) + b`, as a TF1 language model
writes it), and the gradient takes the usual way back (the cross entropy's backprop times the
loss's upstream gradient, through the bias's gradient, a `BiasAddGrad` or a `Sum` over the rows
and its `Reshape`, and the MatMul's two gradient MatMuls), it writes:

- forward: for each block of rows, its logits and its losses, one block after the other; the
  losses concatenated are the loss vector;
- backward: for each block again (its logits computed once more: one extra projection of
  the rows), its backprop times its rows of the upstream gradient, that block's rows of the
  input's gradient, and the weight's and bias's gradient added to a running sum; one block
  after the other, after the forward's last.

The input's gradient and the losses are the same computation per row. The weight's and bias's
gradients are sums over the rows added in another order: equal to rounding, not bitwise, so
the pass is lossy and runs only when asked (`--lossy`, or `--passes chunk_loss`); check with
`verify --steps N`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from tensorflow.core.framework import attr_value_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

from ..analysis.loops import constant_value
from ..analysis.step import Analysis
from ..core import dtypes
from ..core.graph import Graph
from ..core.ops import XENT_OPS
from ..core.tensor_ref import CONTROL, TensorRef
from .base import PassOptions, PassResult, counted

__all__ = ["XENT_OPS", "ADD_OPS", "ROW_KEEPING_OPS", "ChunkLossOptions", "ChunkLossResult", "Match",
           "find", "run"]

log = logging.getLogger(__name__)

ADD_OPS = frozenset({"Add", "AddV2"})  # `logits + b`: a bias when b is a vector of the classes
ROW_KEEPING_OPS = frozenset({"Reshape", "Identity"})  # kept only when the last dim is unchanged


@dataclass(frozen=True)
class ChunkLossOptions(PassOptions):
    chunks: int = 0           # blocks of rows; 0: enough that one block's logits <= max_bytes
    # A block's logits at most this (chunks=0). The weight's gradient (two running sums) and
    # the dequantized weight of a diet step are whole whatever the block; the blocks' logits
    # are what shrinks: the zoo's TF2 transformer (1,024 rows x 8,000 classes) with a 16-bit
    # first moment modelled 92.6, 89.3 and 82.9 MiB at 30% with blocks of 8, 4 and 2 MiB.
    max_bytes: int = 2 << 20
    min_bytes: int = 4 << 20  # logits smaller than this are left whole


@dataclass
class ChunkLossResult(PassResult):
    chunked: list[str] = field(default_factory=list)  # cross entropies computed in blocks
    chunks: int = 0                                   # blocks, summed over them
    not_chunked: dict[str, list[str]] = field(default_factory=dict)  # reason -> cross entropies

    def section(self) -> dict:
        found = super().section()
        found["not_chunked"] = counted(found["not_chunked"])
        return found


@dataclass
class Match:
    """One cross entropy of a projection, and the gradient nodes that read its backprop."""

    xent: str
    matmul: str                  # logits = MatMul(x, w)
    x: TensorRef
    w: TensorRef
    bias: TensorRef | None       # the bias added between the MatMul and the cross entropy
    bias_node: str | None        # its BiasAdd or AddV2
    labels: TensorRef
    upstream: TensorRef          # the loss vector's gradient, [rows] or [rows, 1]
    scale: str                   # Mul(upstream, backprop)
    grad_x: str                  # MatMul giving x's gradient [rows, depth]
    grad_w: str                  # MatMul giving w's gradient
    grad_b: str | None           # BiasAddGrad (or a row Sum's Reshape) giving its gradient
    rows: int
    classes: int
    forward: list[str]           # the cross entropy and what makes its logits: replaced
    backward: list[str]          # what reads its gradient up to the projection's: replaced


def chunkable(graph: Graph, analysis: Analysis, options: ChunkLossOptions
              ) -> tuple[list[Match], dict[str, list[str]], dict[str, int]]:
    """The cross entropies `run` computes in blocks (logits of at least min_bytes), why the
    others are not, and each match's logits bytes."""
    matches, skipped = find(graph, analysis)
    size = {m.xent: analysis.shapes.nbytes(TensorRef(m.xent, 1)) or 0 for m in matches}
    big = []
    for match in matches:
        if size[match.xent] < options.min_bytes:
            skipped.setdefault("logits smaller than min_bytes", []).append(match.xent)
        else:
            big.append(match)
    return big, skipped, size


def run(graph: Graph, analysis: Analysis, options: ChunkLossOptions, model=None):
    """Compute each matched cross entropy and its projection's gradients in blocks of rows."""
    big, skipped, size = chunkable(graph, analysis, options)
    if not big:
        note = "" if not skipped else "no cross entropy computed in blocks: " + "; ".join(
            f"{reason} ({', '.join(names[:3])})" for reason, names in sorted(skipped.items()))
        return ChunkLossResult(graph, False, note=note, not_chunked=skipped)
    graph = graph.copy()
    total = 0
    for match in big:
        count = options.chunks or -(-size[match.xent] // options.max_bytes)
        count = max(2, min(count, match.rows))
        _rewrite(graph, analysis.shapes, match, count)
        total += count
        log.info("chunk_loss: %s in %d blocks of rows", match.xent, count)
    return ChunkLossResult(graph, True, chunked=[m.xent for m in big], chunks=total,
                           not_chunked=skipped)


def find(graph: Graph, analysis: Analysis) -> tuple[list[Match], dict[str, list[str]]]:
    """The cross entropies this pass can compute in blocks, and why the others cannot."""
    found, skipped = [], {}
    for name in graph.nodes():
        if graph.op(name) not in XENT_OPS:
            continue
        match = _match(graph, analysis.shapes, name)
        if isinstance(match, str):
            skipped.setdefault(match, []).append(name)
        else:
            found.append(match)
    return found, skipped


def _match(graph: Graph, shapes, xent: str) -> Match | str:
    """The Match of `xent`, or why there is none."""
    logits, labels = graph.data_inputs(xent)[:2]
    info = shapes[logits]
    if info is None or info.shape is None or len(info.shape) != 2 or None in info.shape:
        return "logits of unknown or not two-dimensional shape"
    rows, classes = info.shape
    if shapes[labels] is None or not shapes[labels].shape or shapes[labels].shape[0] != rows:
        return "labels not one row per logits row"
    forward, bias, bias_node = [xent], None, None
    ref = logits
    while graph.op(ref.node) != "MatMul":  # up from the cross entropy to the projection
        op = graph.op(ref.node)
        if len(_data_readers(graph, ref.node)) != 1:
            return "logits read by more than the loss"
        added = _added_bias(graph, shapes, ref.node, classes) if bias is None else None
        if op == "BiasAdd" and bias is None and _attr_s(graph, ref.node, "data_format") \
                in (b"", b"NHWC"):
            bias, bias_node = graph.data_inputs(ref.node)[1], ref.node
        elif added is not None:
            bias, bias_node = added, ref.node
            forward.append(ref.node)
            ref = next(r for r in graph.data_inputs(ref.node) if r != added)
            continue
        elif not (op in ROW_KEEPING_OPS and _keeps_rows(shapes, graph, ref.node, classes)):
            return f"logits made by {op}, not by a MatMul"
        forward.append(ref.node)
        ref = graph.data_inputs(ref.node)[0]
    matmul = ref.node
    if ref.port != 0 or _attr_b(graph, matmul, "transpose_a") or \
            len(_data_readers(graph, matmul)) != 1:
        return "logits read by more than the loss"
    forward.append(matmul)
    x, w = graph.data_inputs(matmul)[:2]
    backprop = sorted({v for v, _ in graph.consumers(TensorRef(xent, 1))})
    if not backprop:
        return "no backward pass reads the cross entropy's gradient"
    scales = [v for v in backprop if graph.op(v) == "Mul"]
    dead = [v for v in backprop if v not in scales and not graph.successors(v)]
    if len(scales) != 1 or len(scales) + len(dead) != len(backprop) \
            or graph.control_inputs(scales[0]):
        return "its gradient read other than by one Mul"
    scale = scales[0]
    upstream = [r for r in graph.data_inputs(scale) if r != TensorRef(xent, 1)]
    info = shapes[upstream[0]] if len(upstream) == 1 else None
    if info is None or not info.shape or info.shape[0] != rows:
        return "its gradient scaled by other than one value per row"
    backward, grads, frontier = dead + [scale], {}, [scale]
    while frontier:  # down from the scaled gradient, through row-keeping ops
        node = frontier.pop()
        for reader in graph.successors(node):
            op = graph.op(reader)
            if reader in backward or TensorRef(node, 0) not in graph.data_inputs(reader):
                continue  # a control edge (a gradient tuple's group): moved to the blocks
            if op in ROW_KEEPING_OPS and _keeps_rows(shapes, graph, reader, classes):
                backward.append(reader)
                frontier.append(reader)
            elif op == "BiasAddGrad" and bias is not None and "b" not in grads:
                grads["b"] = reader
            elif op == "Sum" and graph.op(bias_node) in ADD_OPS and "b" not in grads and \
                    _sums_rows(graph, shapes, reader, classes):
                backward.append(reader)
                grads["b"] = _data_readers(graph, reader).pop()
            elif op == "MatMul":
                kind = _gradient_kind(graph, reader, TensorRef(node, 0), matmul, x, w)
                if kind is None or kind in grads:
                    return f"its gradient read by another MatMul ({reader})"
                grads[kind] = reader
            else:
                return f"its gradient read by {op} ({reader})"
    if "x" not in grads or "w" not in grads or (bias is not None) != ("b" in grads):
        return "not every gradient of the projection found"
    return Match(xent, matmul, x, w, bias, bias_node, labels, upstream[0], scale, grads["x"],
                 grads["w"], grads.get("b"), rows, classes, forward, backward)


def _gradient_kind(graph: Graph, node: str, grad: TensorRef, matmul: str, x: TensorRef,
                   w: TensorRef) -> str | None:
    """"x" or "w" when `node` is that gradient of MatMul(x, w) from the logits' gradient
    `grad`, as TensorFlow's MatMul gradient writes it; else None."""
    a, b = graph.data_inputs(node)[:2]
    ta, tb = _attr_b(graph, node, "transpose_a"), _attr_b(graph, node, "transpose_b")
    forward_tb = _attr_b(graph, matmul, "transpose_b")
    if a == grad and b == w and not ta and tb != forward_tb:
        return "x"  # dY @ w^T (or dY @ w when w is stored transposed)
    if not forward_tb and a == x and b == grad and ta and not tb:
        return "w"  # x^T @ dY
    if forward_tb and a == grad and b == x and ta and not tb:
        return "w"  # dY^T @ x
    return None


def _data_readers(graph: Graph, node: str) -> set[str]:
    """The nodes reading an output of `node` (waiting on it by a control edge is no read: such
    waits move to the blocks)."""
    return {v for v, slot in graph.consumers(node) if slot >= 0}


def _added_bias(graph: Graph, shapes, node: str, classes: int) -> TensorRef | None:
    """The vector of the classes `node` adds to the logits, where it is an Add of one."""
    if graph.op(node) not in ADD_OPS:
        return None
    vectors = [r for r in graph.data_inputs(node)[:2]
               if shapes[r] is not None and shapes[r].shape == (classes,)]
    return vectors[0] if len(vectors) == 1 else None


def _sums_rows(graph: Graph, shapes, node: str, classes: int) -> bool:
    """A `Sum` of the logits' gradient over its rows, read only by a `Reshape` to the classes:
    an added bias's gradient as TensorFlow's Add gradient writes it."""
    inputs = graph.data_inputs(node)
    axes = constant_value(graph, shapes, inputs[1]) if len(inputs) > 1 else None
    readers = _data_readers(graph, node)
    if axes is None or np.asarray(axes).ravel().tolist() != [0] or len(readers) != 1:
        return False
    (reader,) = readers
    out = shapes[TensorRef(reader, 0)]
    return graph.op(reader) == "Reshape" and out is not None and out.shape == (classes,)


def _keeps_rows(shapes, graph: Graph, node: str, classes: int) -> bool:
    """A reshape or identity whose input and output both end in the classes: rows stay rows."""
    src, out = shapes[graph.data_inputs(node)[0]], shapes[TensorRef(node, 0)]
    return all(i is not None and i.shape and i.shape[-1] == classes for i in (src, out))


def _rewrite(graph: Graph, shapes, m: Match, count: int) -> None:
    """Replace the match's nodes by `count` blocks (see the module's docstring)."""
    prefix = graph.unique_name(f"{m.xent}/graphrewrite_chunk")
    sizes = [m.rows // count + (1 if i < m.rows % count else 0) for i in range(count)]
    size_const = _const(graph, f"{prefix}/sizes", sizes)
    axis = _const(graph, f"{prefix}/axis", 0)

    def split(ref: TensorRef, what: str) -> list[TensorRef]:
        node = graph.add_node(f"{prefix}/split_{what}", "SplitV", [ref, size_const, axis], {
            "T": _dtype(shapes, ref), "Tlen": attr_value_pb2.AttrValue(type=types_pb2.DT_INT32),
            "num_split": attr_value_pb2.AttrValue(i=count)})
        return [TensorRef(node, i) for i in range(count)]

    xs, labels, upstream = split(m.x, "x"), split(m.labels, "labels"), split(m.upstream, "grad")

    def logits(i: int, stage: str, after: list[str]) -> TensorRef:
        node = graph.copy_node(m.matmul, f"{prefix}/{stage}_{i}/logits")
        graph.redefine(node, "MatMul", [xs[i], m.w, *(TensorRef(a, CONTROL) for a in after)],
                       _attrs(graph, m.matmul))
        ref = TensorRef(node, 0)
        if m.bias is not None:
            biased = graph.add_node(f"{prefix}/{stage}_{i}/bias", "BiasAdd", [ref, m.bias],
                                    _bias_attrs(graph, shapes, m.bias_node, "BiasAdd"))
            ref = TensorRef(biased, 0)
        xent = graph.add_node(f"{prefix}/{stage}_{i}/xent", graph.op(m.xent),
                              [ref, labels[i]], _attrs(graph, m.xent))
        return TensorRef(xent, 0)

    # The first block waits on what the replaced forward nodes waited on (an inlined call's
    # result Identity waits on its body's side effects).
    losses, after = [], sorted({c for n in m.forward for c in graph.control_inputs(n)})
    for i in range(count):
        loss = logits(i, "forward", after)
        losses.append(loss)
        after = [loss.node]
    grads_x, sum_w, sum_b = [], None, None
    for i in range(count):
        xent = logits(i, "backward", after).node
        scale_inputs = [upstream[i] if r == m.upstream else TensorRef(xent, 1)
                        for r in graph.data_inputs(m.scale)]
        scaled = TensorRef(graph.add_node(f"{prefix}/backward_{i}/scaled", "Mul",
                                          scale_inputs, _attrs(graph, m.scale)), 0)
        gx = _like(graph, m, m.grad_x, f"{prefix}/backward_{i}/grad_x", scaled, xs[i])
        gw = _like(graph, m, m.grad_w, f"{prefix}/backward_{i}/grad_w", scaled, xs[i])
        grads_x.append(gx)
        sum_w = gw if sum_w is None else _add(graph, shapes, f"{prefix}/backward_{i}/sum_w",
                                              sum_w, gw, m.grad_w)
        after = [gx.node, sum_w.node]
        if m.grad_b is not None:
            gb = TensorRef(graph.add_node(f"{prefix}/backward_{i}/grad_b", "BiasAddGrad",
                                          [scaled], _bias_attrs(graph, shapes, m.grad_b,
                                                                "BiasAddGrad")), 0)
            sum_b = gb if sum_b is None else _add(graph, shapes, f"{prefix}/backward_{i}/sum_b",
                                                  sum_b, gb, m.grad_b)
            after.append(sum_b.node)
    loss = _concat(graph, shapes, f"{prefix}/losses", losses, TensorRef(m.xent, 0))
    graph.replace_uses(TensorRef(m.xent, 0), loss)
    grad_x = _concat(graph, shapes, f"{prefix}/grad_x", grads_x, TensorRef(m.grad_x, 0))
    # The gradients keep their nodes (what reads, waits on or is colocated with them stays).
    for node, value in ((m.grad_x, grad_x), (m.grad_w, sum_w), (m.grad_b, sum_b)):
        if node is not None:
            graph.redefine(node, "Identity", [value, *(r for r in graph.inputs(node)
                                                      if r.is_control)],
                           {"T": _dtype(shapes, TensorRef(node, 0))})
    # What waited on a replaced node waits on the blocks that replace it: the forward's last
    # for the forward's nodes (a later wait could close a circle), the backward's last else.
    last_forward, removed = losses[-1].node, set(m.forward) | set(m.backward)
    for node in sorted(removed):
        for reader in graph.successors(node):
            if reader not in removed:
                _move_control(graph, node, last_forward if node in m.forward else after[-1],
                              reader)
    for node in reversed([n for n in graph.topological_order() if n in removed]):
        graph.remove_node(node)
    _uncolocate(graph, removed)


def _uncolocate(graph: Graph, removed: set[str]) -> None:
    """Colocations with removed nodes dropped: a TF1 gradient's constants are colocated with
    the cross entropy they differentiate, and TensorFlow refuses a graph naming an unknown
    node there (a word-level LSTM language model built outside the repo)."""
    gone = {f"loc:@{n}".encode() for n in removed}
    for node in graph.nodes():
        attr = graph.node_def(node).attr
        if "_class" in attr and gone & set(attr["_class"].list.s):
            graph.set_attr(node, "_class", attr_value_pb2.AttrValue(
                list=attr_value_pb2.AttrValue.ListValue(
                    s=[v for v in attr["_class"].list.s if v not in gone])))


def _bias_attrs(graph: Graph, shapes, node: str, op: str) -> dict:
    """Attributes of a block's `op` (BiasAdd, BiasAddGrad) standing for `node`: its own
    where it is one, else its type (an Add's, a Reshape's)."""
    if graph.op(node) == op:
        return _attrs(graph, node)
    return {"T": _dtype(shapes, TensorRef(node, 0))}


def _like(graph: Graph, m: Match, original: str, name: str, scaled: TensorRef,
          rows: TensorRef) -> TensorRef:
    """A copy of gradient MatMul `original` reading a block's scaled gradient and its rows."""
    inputs = [rows if r == m.x else r if r == m.w else scaled for r in graph.data_inputs(original)]
    return TensorRef(graph.add_node(name, "MatMul", inputs, _attrs(graph, original)), 0)


def _add(graph: Graph, shapes, name: str, a: TensorRef, b: TensorRef, like: str) -> TensorRef:
    return TensorRef(graph.add_node(name, "AddV2", [a, b],
                                    {"T": _dtype(shapes, TensorRef(like, 0))}), 0)


def _concat(graph: Graph, shapes, name: str, parts: list[TensorRef], like: TensorRef
            ) -> TensorRef:
    axis = _const(graph, f"{name}/axis", 0)
    return TensorRef(graph.add_node(name, "ConcatV2", [*parts, axis], {
        "T": _dtype(shapes, like), "N": attr_value_pb2.AttrValue(i=len(parts)),
        "Tidx": attr_value_pb2.AttrValue(type=types_pb2.DT_INT32)}), 0)


def _const(graph: Graph, name: str, value) -> TensorRef:
    values = value if isinstance(value, list) else [value]
    proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_INT32, int_val=values)
    if isinstance(value, list):
        proto.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=len(values))]))
    return TensorRef(graph.add_node(name, "Const", [], {
        "dtype": attr_value_pb2.AttrValue(type=types_pb2.DT_INT32),
        "value": attr_value_pb2.AttrValue(tensor=proto)}), 0)


def _attrs(graph: Graph, node: str) -> dict:
    """`node`'s attributes for a block's node: not its recorded shapes (a block's differ) nor
    its colocation."""
    return {k: v for k, v in graph.node_def(node).attr.items()
            if k not in ("_output_shapes", "_class")}


def _dtype(shapes, ref: TensorRef) -> attr_value_pb2.AttrValue:
    """The dtype of tensor `ref` of the original graph, as a node's attribute."""
    return attr_value_pb2.AttrValue(type=dtypes.base(shapes[ref].dtype))


def _attr_b(graph: Graph, node: str, key: str) -> bool:
    attr = graph.node_def(node).attr
    return key in attr and attr[key].b


def _attr_s(graph: Graph, node: str, key: str) -> bytes:
    attr = graph.node_def(node).attr
    return attr[key].s if key in attr else b""


def _move_control(graph: Graph, old: str, new: str, reader: str) -> None:
    """`reader` waits on `new` instead of `old` (a control input)."""
    inputs = [r for r in graph.inputs(reader) if r != TensorRef(old, CONTROL)]
    if TensorRef(new, CONTROL) not in inputs:
        inputs.append(TensorRef(new, CONTROL))
    graph.redefine(reader, graph.op(reader), inputs, dict(graph.node_def(reader).attr))
