"""Slices TensorFlow hands out as views of their input's rows, not copies.

`StridedSlice` and `Slice` of whole first-axis rows (`w[e]` of stacked experts, `x[a:b]` of a
batch), and `Unpack`, `Split` and `SplitV` along the first axis, return a tensor sharing their
input's buffer when each row starts on an `EIGEN_MAX_ALIGN_BYTES` boundary
(`IsInnerDimsSizeAligned`, `IsDim0SliceAligned` in TensorFlow's kernels); a slice that keeps
everything forwards its input. The input's buffer then lives as long as any such view: a
whole dequantized weight read by slices lived into the backward pass (a TF1 mixture of
experts, dieted: modelled 0.84x of its peak, measured 1.18x), where the model counted each
slice a buffer of its own. A one-dimensional input's rows are single elements: TensorFlow
shares those only at aligned offsets, which this does not follow (it copies, as modelled).
"""

from __future__ import annotations

from ..core.graph import Graph
from ..core.tensor_ref import TensorRef
from . import loops

__all__ = ["ALIGN_BYTES", "ROW_VIEW_OPS", "viewed_input"]

ALIGN_BYTES = 64  # EIGEN_MAX_ALIGN_BYTES of the pip build: 64-byte rows shared, 32 copied
ROW_VIEW_OPS = frozenset({"StridedSlice", "Slice", "Unpack", "Split", "SplitV"})
_VALUE_INPUT = {"Split": 1}  # the sliced input's index; 0 for the others
_AXIS_INPUT = {"Split": 0, "SplitV": 2}


def viewed_input(graph: Graph, shapes, name: str) -> int | None:
    """The index of the input whose buffer node `name`'s outputs share, or None (a copy)."""
    op = graph.op(name)
    if op not in ROW_VIEW_OPS:
        return None
    index = _VALUE_INPUT.get(op, 0)
    inputs = graph.data_inputs(name)
    if len(inputs) <= index:
        return None
    source, out = shapes[inputs[index]], shapes[TensorRef(name)]
    if source is None or out is None or not _known(source.shape) or not _known(out.shape):
        return None
    whole, part = source.shape, out.shape
    if op in ("StridedSlice", "Slice") and part == whole and _unit_strides(graph, shapes, name):
        return index  # the whole input: forwarded
    if len(whole) < 2 or not whole[0] or not _rows_aligned(source):
        return None
    if op in ("Unpack", "Split", "SplitV"):
        return index if _first_axis(graph, shapes, name, len(whole)) else None
    if not _unit_strides(graph, shapes, name):
        return None
    attr = graph.node_def(name).attr
    if op == "StridedSlice" and (attr["ellipsis_mask"].i or attr["new_axis_mask"].i
                                 or attr["shrink_axis_mask"].i & ~1):
        return None
    shrunk = op == "StridedSlice" and attr["shrink_axis_mask"].i & 1
    rest = part if shrunk else part[1:]
    return index if tuple(rest) == tuple(whole[1:]) else None


def _known(shape) -> bool:
    return shape is not None and all(d is not None for d in shape)


def _rows_aligned(info) -> bool:
    """Each first-axis row a multiple of the alignment in bytes (`IsInnerDimsSizeAligned`)."""
    rows = info.shape[0]
    return bool(info.nbytes) and (info.nbytes // rows) % ALIGN_BYTES == 0


def _unit_strides(graph: Graph, shapes, name: str) -> bool:
    if graph.op(name) == "Slice":
        return True
    strides = loops.constant_value(graph, shapes, graph.data_inputs(name)[3])
    return strides is not None and all(int(s) == 1 for s in strides.ravel())


def _first_axis(graph: Graph, shapes, name: str, rank: int) -> bool:
    op = graph.op(name)
    if op == "Unpack":
        axis = graph.node_def(name).attr["axis"].i
    else:
        value = loops.constant_value(graph, shapes, graph.data_inputs(name)[_AXIS_INPUT[op]])
        if value is None or value.size != 1:
            return False
        axis = int(value.ravel()[0])
    return axis % rank == 0

