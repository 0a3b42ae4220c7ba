"""Kernels Grappler chooses differently for a rewritten step, where that changes the numbers.

Grappler's remapper fuses a MatMul and the BiasAdd after it into one `_FusedMatMul` only when
neither has a control edge and the MatMul has no other reader. A rewrite moves such edges (a
trigger gating a copy, a gradient reading a recomputed value, a constant that constant folding
then anchors on another node), so a node the original's step computed apart can be fused in
the rewrite's, or a copy left apart whose original was fused. Measured on this CPU (Eigen): the
two agree bitwise for convolutions and for matrix products of two columns or more, but not for
a matrix-vector product (one column: unfused, Eigen takes its GEMV path; [32, 8192] x [8192, 1]
differs by 1.4e-5), which is what a GAN's discriminator logit is. Only those count here. The
step as run is only placed (and so fused) on a machine without a GPU (`grappler.py`): with one,
this finds nothing, and bitwise equality is checked by `verify` alone. With oneDNN (TensorFlow's
default on x86) convolutions and batch norms round otherwise fused too: the recompute pass keeps
its gated copies fusable as their originals (`passes/triggers.keep_fusable`), so this check is
the net behind it.
"""

from __future__ import annotations

from ..core.graph import Graph
from ..core.names import COPY_SUFFIX
from ..core.tensor_ref import TensorRef

__all__ = ["FUSED_MATMUL", "refused"]

FUSED_MATMUL = "_FusedMatMul"


def refused(before: Graph, after: Graph, shapes) -> list[str]:
    """The original's nodes whose value the rewrite's step (`after`, as Grappler returns it)
    computes with another kernel than the original's (`before`), in a way that rounds
    differently: a one-column matrix product fused in one and not the other, at the node itself
    or at a copy of it (a recomputed copy is named after its original). `shapes`: `before`'s
    (a product of unknown shape counts)."""
    changed = set()
    for name in after.nodes():
        source = name.split(COPY_SUFFIX)[0]
        if source not in before or (before.op(source) == FUSED_MATMUL) == \
                (after.op(name) == FUSED_MATMUL):
            continue
        info = shapes[TensorRef(source)]
        if info is None or info.shape is None or len(info.shape) != 2 or info.shape[1] == 1:
            changed.add(source)  # a vector product, or one of unknown shape
    return sorted(changed)
