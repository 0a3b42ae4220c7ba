"""Seeded sparse tensors for the placeholders `tf.compat.v1.sparse_placeholder` makes.

A sparse placeholder is three: indices (int64, `[?, rank]`), values (`[?]`) and a dense shape
(int64, `[rank]`; a `PlaceholderWithDefault` holding -1 where the declared shape was unknown;
declared with no shape at all, `[?, ?]` indices and a `[?]` dense shape, told from the values
by the sparse op that reads it as one, rank RANK).
How many entries they hold is data, and they must agree: as many values as index rows, indices
ordered row-major and inside the dense shape (`SparseSegmentMean` refuses unordered segment
ids, `SparseReshape` a -1). Nothing in the graph ties the three together but the ops that read
them, so each values placeholder goes with the indices placeholder it meets soonest downstream,
and a dense shape with the one it meets soonest. Every row gets COLUMNS entries (at most its
width): embedding lookups then see no empty row, and the batch is as the dense inputs'.
"""

from __future__ import annotations

import logging

import numpy as np

from ..core.tensor_ref import TensorRef

__all__ = ["sparse_feeds", "sparse_members", "COLUMNS", "RANK", "DENSE_SHAPE_SLOTS"]

log = logging.getLogger(__name__)

COLUMNS = 2  # entries per row where the dense shape leaves the width unknown
RANK = 2  # a sparse tensor's rank where nothing records it: a batch of id lists
# Where the sparse ops take a dense shape: a `sparse_placeholder` declared without a shape has
# one of unknown length, which only its readers tell from a sparse tensor's values.
DENSE_SHAPE_SLOTS = {"SparseReshape": 1, "SparseToDense": 1, "SparseFillEmptyRows": 2,
                     "SparseTensorDenseMatMul": 2, "SparseReorder": 2, "SparseTensorDenseAdd": 2,
                     "SparseReduceSum": 2, "SparseReduceMax": 2, "SparseSlice": 2,
                     "SerializeSparse": 2, "SparseSoftmax": 2, "SparseDenseCwiseMul": 2,
                     "SparseDenseCwiseAdd": 2, "SparseDenseCwiseDiv": 2}
REACH = 8  # how many ops downstream two placeholders may meet


def sparse_feeds(graph, shapes, rng: np.random.RandomState, int_high: int,
                 skip: set[str], batch: int) -> dict[str, np.ndarray]:
    """Arrays for every sparse placeholder triple whose indices are not in `skip`, keyed by
    placeholder name: indices, values, and the dense shape where it is a placeholder. `batch`:
    the rows of a dense shape that does not say (the dense inputs')."""
    import tensorflow as tf

    from ..analysis import bind

    def info(name):
        found = shapes[TensorRef(name)]
        return (None, None) if found is None or found.shape is None else \
            (tf.dtypes.as_dtype(found.dtype), found.shape)

    indices, values, dense_shapes = _roles(graph, shapes, skip)
    if not indices:
        return {}
    reach = {name: _downstream(graph, name) for name in indices + values + dense_shapes}
    value_of = _pair(indices, values, reach)
    shape_of = _pair(indices, dense_shapes, reach)
    feeds = {}
    for name in indices:
        if name not in value_of:
            continue  # no values read with it: not a sparse tensor this can make
        rank = info(name)[1][1] or _length(info, shape_of.get(name)) or RANK
        declared = _default(graph, shapes, shape_of.get(name))
        if declared is None or len(declared) != rank:
            declared = [-1] * rank
        if declared[0] < 0:
            declared[0] = batch
        dense = [COLUMNS if d < 0 else d for d in declared]
        widths = dense[:-1] + [min(dense[-1], COLUMNS)]
        grid = np.stack(np.meshgrid(*[np.arange(w) for w in widths], indexing="ij"), -1)
        feeds[name] = grid.reshape(-1, rank).astype(np.int64)
        if name in shape_of:
            feeds[shape_of[name]] = np.array(dense, np.int64)
        value = value_of[name]
        dtype = info(value)[0].as_numpy_dtype
        count = len(feeds[name])
        if np.issubdtype(dtype, np.floating):
            feeds[value] = rng.standard_normal(count).astype(dtype)
        else:
            high = min(int_high, bind.index_limit(graph, shapes, value) or int_high)
            feeds[value] = rng.randint(0, high, count).astype(dtype)
        log.info("sparse placeholder %s: %d entries in a dense shape %s", name, count, dense)
    return feeds


def sparse_members(graph, shapes, skip: set[str] = frozenset()) -> set[str]:
    """The placeholders that look like part of a sparse tensor (indices, values, dense
    shapes): their lengths are entry counts and ranks, no batch."""
    indices, values, dense_shapes = _roles(graph, shapes, skip)
    return set(indices + values + dense_shapes) if indices else set()


def _roles(graph, shapes, skip: set[str]) -> tuple[list[str], list[str], list[str]]:
    """The placeholders not in `skip` that may be a sparse tensor's indices (int64,
    `[?, rank]`, the rank unknown too where the placeholder was declared without a shape),
    values (`[?]`) and dense shapes (int64, `[rank]`, or `[?]` where a sparse op reads it
    as one)."""
    import tensorflow as tf

    indices, values, dense_shapes = [], [], []
    for name in sorted(graph.nodes()):
        if graph.op(name) not in ("Placeholder", "PlaceholderV2", "PlaceholderWithDefault") \
                or name in skip:
            continue
        found = shapes[TensorRef(name)]
        if found is None or found.shape is None:
            continue
        dtype, shape = tf.dtypes.as_dtype(found.dtype), found.shape
        with_default = graph.op(name) == "PlaceholderWithDefault"
        if not with_default and dtype == tf.int64 and len(shape) == 2 and shape[0] is None:
            indices.append(name)
        elif dtype == tf.int64 and len(shape) == 1 and (shape[0] is not None
                                                       or graph.read_as(name, DENSE_SHAPE_SLOTS)):
            dense_shapes.append(name)
        elif not with_default and len(shape) == 1 and shape[0] is None:
            values.append(name)
    return indices, values, dense_shapes


def _length(info, name: str | None) -> int | None:
    """The known length of a dense shape placeholder (its rank), if any."""
    if name is None:
        return None
    shape = info(name)[1]
    return shape[0] if shape else None


def _downstream(graph, name: str) -> dict[str, int]:
    """The nodes up to REACH data edges below `name`, with their distance."""
    seen, frontier = {name: 0}, [name]
    for depth in range(1, REACH + 1):
        frontier = [user for node in frontier for user, slot in graph.consumers(TensorRef(node))
                    if slot is not None and slot >= 0 and user not in seen]
        for user in frontier:
            seen.setdefault(user, depth)
    return seen


def _pair(indices: list[str], others: list[str], reach: dict) -> dict[str, str]:
    """Each of `others` with the indices placeholder it meets soonest (fewest edges from both
    to a common reader), keyed by the indices placeholder; the first such when two tie."""
    paired = {}
    for other in others:
        costs = [(min(reach[other][n] + reach[i][n] for n in common), i)
                 for i in indices if (common := reach[other].keys() & reach[i].keys())]
        if costs:
            paired.setdefault(min(costs)[1], other)
    return paired


def _default(graph, shapes, name: str | None) -> list[int] | None:
    """A dense shape placeholder's default value (-1 where unknown), when it has one."""
    if name is None or graph.op(name) != "PlaceholderWithDefault":
        return None
    from ..analysis import loops

    value = loops.constant_value(graph, shapes, graph.data_inputs(name)[0])
    return None if value is None else [int(d) for d in np.ravel(value)]
