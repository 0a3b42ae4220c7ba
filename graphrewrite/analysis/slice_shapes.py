"""Slices whose bounds move with a loop counter, sized by the distance between the bounds.

Gradient accumulation in a `tf.range` loop takes each micro-batch as `x[i * mb:(i + 1) * mb]`:
TensorFlow's shape inference, not knowing `i`, leaves the slice's batch dimension unknown, and
with it every tensor of the forward and backward pass inside the loop (a CNN step of four
micro-batches built outside the repo modelled 13 MiB for 81 measured: none of its loop body
counted). The two bounds differ by `mb` whatever `i` is. A `StridedSlice` whose bounds on an axis
are the same affine function of unknown values up to a constant (built by `Mul`, `Add`, `Sub`,
`ExpandDims`, `Pack` and `Identity` from constants), with unit strides and no masks, is that
constant long on the axis; shapes are then inferred again with each such slice a placeholder of
its shape.
"""

from __future__ import annotations

from tensorflow.python.framework import tensor_util

from . import loop_shapes

__all__ = ["refine_shapes"]

Affine = tuple  # ((symbol, coefficient), ...) sorted, constant: a sum of terms and a constant
MAX_DEPTH = 12  # ops walked up from a bound


def refine_shapes(graph_def, inferred: dict, infer) -> None:
    """Fill in the dimensions of such slices and what is computed from them (`inferred`: node
    -> [(dtype, shape)] per output, updated in place); `infer` is `shapes.tensorflow_shapes`."""
    nodes = {n.name: n for n in graph_def.node}
    sized = {}
    for node in graph_def.node:
        if node.op == "StridedSlice":
            shape = _sliced(nodes, inferred, node)
            if shape is not None:
                sized[node.name] = (inferred[node.name][0][0], shape)
    if sized:
        loop_shapes.reinfer(graph_def, inferred, sized, infer)


def _sliced(nodes, inferred, node) -> tuple | None:
    """The slice's shape with the axes its moving bounds size filled in; None if none is."""
    outputs = inferred.get(node.name)
    if not outputs or outputs[0][1] is None or None not in outputs[0][1]:
        return None
    attrs = node.attr
    if any(attrs[mask].i for mask in ("ellipsis_mask", "new_axis_mask", "shrink_axis_mask")):
        return None
    data = [i for i in node.input if not i.startswith("^")]
    source = inferred.get(_name(data[0]), [])
    begin, end, strides = (_vector(nodes, text) for text in data[1:4])
    if begin is None or end is None or strides is None or any(
            s != ((), 1) for s in strides) or len(begin) != len(end):
        return None
    shape = list(outputs[0][1])
    whole = source[_port(data[0])][1] if _port(data[0]) < len(source) else None
    for axis, (low, high) in enumerate(zip(begin, end)):
        masked = (attrs["begin_mask"].i | attrs["end_mask"].i) >> axis & 1
        if axis >= len(shape) or shape[axis] is not None or masked or low[0] != high[0]:
            continue
        length = high[1] - low[1]
        limit = whole[axis] if whole is not None and whole[axis] is not None else None
        if length >= 0 and (limit is None or length <= limit):
            shape[axis] = length
    return tuple(shape) if shape != list(outputs[0][1]) else None


def _visit(nodes, text: str, depth: int):
    """(node, its data inputs, its value if a constant) of `text`; None past MAX_DEPTH."""
    node = nodes.get(_name(text))
    if node is None or depth > MAX_DEPTH:
        return None
    data = [i for i in node.input if not i.startswith("^")]
    value = tensor_util.MakeNdarray(node.attr["value"].tensor) if node.op == "Const" else None
    return node, data, value


def _vector(nodes, text: str, depth: int = 0) -> list[Affine] | None:
    """The 1-D integer tensor `text` as one affine value per element, or None."""
    visited = _visit(nodes, text, depth)
    if visited is None:
        return None
    node, data, value = visited
    if value is not None:
        return [((), int(v)) for v in value.reshape(-1)] if value.ndim == 1 else None
    if node.op == "ExpandDims":
        value = _scalar(nodes, data[0], depth + 1)
        return None if value is None else [value]
    if node.op == "Pack":
        values = [_scalar(nodes, i, depth + 1) for i in data]
        return None if any(v is None for v in values) else values
    if node.op == "Identity":
        return _vector(nodes, data[0], depth + 1)
    return None


def _scalar(nodes, text: str, depth: int) -> Affine | None:
    """The integer scalar `text` as an affine value of the unknown scalars it is built from."""
    visited = _visit(nodes, text, depth)
    if visited is None:
        return None
    node, data, value = visited
    if value is not None:
        return ((), int(value)) if value.ndim == 0 and value.dtype.kind in "iu" else None
    if node.op == "Identity":
        return _scalar(nodes, data[0], depth + 1)
    if node.op in ("Add", "AddV2", "Sub", "Mul"):
        left, right = (_scalar(nodes, i, depth + 1) for i in data[:2])
        if left is None or right is None:
            return None
        if node.op == "Mul":
            factor, other = (left[1], right) if not left[0] else (right[1], left) \
                if not right[0] else (None, None)
            if factor is None:
                return None
            return tuple((s, c * factor) for s, c in other[0]), other[1] * factor
        sign = -1 if node.op == "Sub" else 1
        terms = dict(left[0])
        for symbol, coefficient in right[0]:
            terms[symbol] = terms.get(symbol, 0) + sign * coefficient
        return tuple(sorted((s, c) for s, c in terms.items() if c)), left[1] + sign * right[1]
    return ((text, 1),), 0  # unknown: a symbol of its own


def _name(text: str) -> str:
    return text.lstrip("^").split(":")[0]


def _port(text: str) -> int:
    _, _, port = text.partition(":")
    return int(port) if port.isdigit() else 0
