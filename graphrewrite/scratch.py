"""Kernel scratch: memory a kernel takes from the allocator for the time it runs, besides its
outputs. The memory model adds it to the node's step (`memory.simulate`).

On the CPU (TensorFlow 2.15, oneDNN off as `measure` runs it), the convolution gradients
`Conv2DBackpropInput` and `Conv2DBackpropFilter` unroll image patches into a column buffer sized
to fill a 30 MiB cache: `shard` images of `out_rows * out_cols * filter_total` elements, where a
shard is as many images as fit 30 MiB of the per-image working set (patches, output gradient,
filter). That is 20-40 MiB per kernel as the allocator hands it out, measured on MobileNetV2 and
ResNet-50 training steps here (`peak_bytes` of the node minus its outputs); no other kernel of
those steps takes more than 1 MiB.

On a GPU the convolutions take cuDNN workspace, whose size depends on the algorithm cuDNN picks
at run time; it is not modelled (an unmeasured estimate would be a guess).
"""

from __future__ import annotations

import math

from .graph import Graph
from .shapes import Shapes
from .tensor_ref import TensorRef

CPU_WORKING_SET = 30 << 20
# op -> (input holding the filter's shape or the filter, input holding the output gradient)
CPU_CONV_GRADIENTS = {"Conv2DBackpropInput": (1, 2), "Conv2DBackpropFilter": (None, 2)}


def cpu_bytes(graph: Graph, shapes: Shapes, name: str) -> int:
    """Scratch bytes node `name` takes while it runs on the CPU; 0 when none or unknown."""
    op = graph.op(name)
    if op not in CPU_CONV_GRADIENTS or graph.node_def(name).attr["data_format"].s == b"NCHW":
        return 0
    inputs = graph.data_inputs(name)
    filter_at, gradient_at = CPU_CONV_GRADIENTS[op]
    gradient = shapes[inputs[gradient_at]] if len(inputs) > gradient_at else None
    kernel = shapes[inputs[filter_at]] if filter_at is not None else shapes[TensorRef(name)]
    if gradient is None or kernel is None or gradient.nbytes is None or kernel.nbytes is None \
            or len(gradient.shape) != 4 or len(kernel.shape) != 4:
        return 0
    item = gradient.nbytes // max(1, math.prod(gradient.shape))
    rows, cols, in_depth, out_depth = kernel.shape
    image = gradient.shape[1] * gradient.shape[2]
    filter_total = rows * cols * in_depth
    per_image = image * filter_total + image * out_depth + filter_total * out_depth
    if not per_image:
        return 0
    shard = -(-(CPU_WORKING_SET // item) // per_image)
    return shard * image * filter_total * item
