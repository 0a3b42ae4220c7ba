"""Kernel scratch: memory a kernel takes from the allocator for the time it runs, besides its
outputs. The memory model adds it to the node's step (`memory.simulate`).

On the CPU (TensorFlow 2.15, oneDNN off as `measure` runs it), the convolution gradients
`Conv2DBackpropInput` and `Conv2DBackpropFilter` unroll image patches into a column buffer sized
to fill a 30 MiB cache: `shard` images of `out_rows * out_cols * filter_total` elements, where a
shard is as many images as fit 30 MiB of the per-image working set (patches, output gradient,
filter) (conv_grad_filter_ops.cc, conv_grad_input_ops.h). The input's gradient takes one image's
buffer instead when the batch is one image or each of the intra-op threads gets at least an L2
cache (256 KiB) of the per-image working set (`use_parallel_contraction`): measured, a 64x64x16
-> 32 3x3 convolution at batch 8 took 28 MiB for its weights' gradient, none to speak of for its
input's. That is 20-40 MiB per kernel as the allocator hands it out, measured on MobileNetV2 and
ResNet-50 training steps here (`peak_bytes` of the node minus its outputs); no other kernel of
those steps takes more than 1 MiB. The 3-D gradients size theirs to the machine's whole L3
cache instead (`cpu_conv3d_bytes`): hundreds of MiB on a server's processor.

On a GPU the convolutions take cuDNN workspace from the same allocator: TensorFlow's
`DnnScratchAllocator` (tensorflow/core/kernels/conv_ops_gpu.h) serves cuDNN's request with
`OpKernelContext::allocate_temp`, held until the kernel finishes, for the forward convolution
(conv_ops_impl.h), `Conv2DBackpropInput` (conv_grad_input_ops.h) and `Conv2DBackpropFilter`
(conv_grad_filter_ops.cc) alike. Its size is the workspace of the algorithm the autotuner picks
(the fastest one whose workspace fits), up to `GetDnnWorkspaceLimit("TF_CUDNN_WORKSPACE_LIMIT_IN_MB",
1LL << 32)` (gpu_utils.cc: the variable in MiB, 4 GiB without it). What that algorithm needs is
known only at run time: GEMM-based algorithms need little, FFT and Winograd ones a transformed
copy of their operands. ESTIMATE, NOT MEASURED (no GPU here): the largest of the convolution's
input, filter and output, capped by the limit (`GPU_WORKSPACE`).

The CPU's fused batch norm (tensorflow/core/kernels/fused_batch_norm_op.cc; Keras's layer
normalization runs on it, in NCHW) works in NHWC: given NCHW, the forward kernel copies its input
and output into NHWC temporaries, the gradient its two inputs and the input's gradient; a
gradient of 16-bit values sums in a float32 copy. Measured here: a layer norm over [512, 64]
took 0.25 MiB forward and 0.48 MiB backward beside its 128 KiB input (the rule: 0.25, 0.38).

`Einsum` (tensorflow/core/kernels/linalg/einsum_op_impl.h, on every device) copies each operand
whose labels are not in the order [batch, free, contract] (or [batch, contract, free], which the
matrix product reads transposed) into a transposed temporary, and, when the output's labels are
not in the order [batch, free of the first operand, free of the second], computes the product
into a temporary and transposes that into the output. Measured here (a transformer's attention at
batch 8, 128 positions, 8 heads of 64): `aecd,abcd->acbe` takes 8.0 MiB beside its 4 MiB
output, as the rule says; the products' own blocking buffers (0.3-1.3 MiB) are left out.

`KERNEL_SCRATCH` is the table by device kind; `device_kind` reads the default from placement.

Two kernels can hold their scratch at once (`alongside`): a convolution's two gradients read the
same incoming gradient and become ready together, and the executor runs them on two threads; so
do the gradients of two branches. Measured here, the allocator's peak of a Keras CNN training step
(`km_cnn_adam_bn`) was 59.6 MiB with them at once and 35.2 MiB with each input gradient made to
wait for its weights' gradient (the `serialize` pass); the model says 60.2 and 35.7. On a GPU
both take workspace as they start, on two threads alike (ESTIMATE, not measured).
"""

from __future__ import annotations

import functools
import glob
import math
import os
from pathlib import Path

from ..core.graph import Graph
from ..core.tensor_ref import TensorRef
from .shapes import Shapes

__all__ = ["CPU_WORKING_SET", "CPU_L2", "CPU_THREADS", "CPU_CONV_GRADIENTS", "cpu_bytes",
           "l3_cache_bytes", "MAX_TEMP_OVERHEAD", "CPU_CONV3D_GRADIENTS", "cpu_conv3d_bytes",
           "GPU_CONVOLUTIONS", "WORKSPACE_LIMIT", "workspace_limit", "gpu_bytes", "KERNEL_SCRATCH",
           "CPU_BATCH_NORMS", "cpu_batch_norm_bytes", "einsum_bytes", "DEVICE_KINDS",
           "device_kind", "kernel_bytes", "CONV_GRADIENTS", "alongside"]

CPU_WORKING_SET = 30 << 20
CPU_L2 = 256 << 10
CPU_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
    os.cpu_count() or 1  # TensorFlow's intra-op threads by default
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
    one_image = image * filter_total * item
    if op == "Conv2DBackpropInput" and (gradient.shape[0] == 1 or
                                        per_image // CPU_THREADS >= CPU_L2 // item):
        return one_image  # a parallel contraction per image
    return -(-(CPU_WORKING_SET // item) // per_image) * one_image


@functools.lru_cache(maxsize=1)
def l3_cache_bytes() -> int:
    """This machine's L3 cache, which Eigen's `CacheSizes` reads from the processor (Linux
    shows the same in sysfs); CPU_WORKING_SET where it cannot be read."""
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            level = Path(index, "level").read_text().strip()
            size = Path(index, "size").read_text().strip().upper()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if level == "3" and size[:-1].isdigit() and size[-1] in units:
            return int(size[:-1]) * units[size[-1]]
    return CPU_WORKING_SET


# Above this many column-buffer elements per element of the kernel's tensors, the 3-D kernels
# fall back on Eigen's, which takes none (kMaxTempAllocationOverhead, conv_grad_ops.h).
MAX_TEMP_OVERHEAD = 25
# op -> (input holding the filter or its shape, input holding the output gradient)
CPU_CONV3D_GRADIENTS = {"Conv3DBackpropInputV2": (1, 2), "Conv3DBackpropFilterV2": (1, 2)}


def cpu_conv3d_bytes(graph: Graph, shapes: Shapes, name: str) -> int:
    """The column buffer of a 3-D convolution's gradient on the CPU (conv_grad_ops_3d.cc):
    `shard` volumes of `output positions * filter_total` elements, a shard as many volumes as
    fit the machine's whole L3 cache (not the 30 MiB of the 2-D kernels: 260 MiB on this
    session's Xeon, so one 8x32x32x32 layer's weights' gradient took 270 MiB here, measured, as
    the rule says), one volume for the input's gradient of a batch of one; none where that
    buffer would exceed MAX_TEMP_OVERHEAD times the kernel's tensors (Eigen's kernel then)."""
    node = graph.node_def(name)
    inputs = graph.data_inputs(name)
    if node.attr["data_format"].s == b"NCDHW" or len(inputs) < 3:
        return 0
    filter_at, gradient_at = CPU_CONV3D_GRADIENTS[node.op]
    input_filter = node.op == "Conv3DBackpropInputV2"
    gradient = shapes[inputs[gradient_at]]
    kernel = shapes[inputs[filter_at]] if input_filter else shapes[TensorRef(name)]
    image = shapes[TensorRef(name)] if input_filter else shapes[inputs[0]]
    infos = (gradient, kernel, image)
    if any(i is None or i.nbytes is None or i.shape is None or len(i.shape) != 5
           or None in i.shape for i in infos):
        return 0
    item = gradient.nbytes // max(1, math.prod(gradient.shape))
    positions, out_depth = math.prod(gradient.shape[1:4]), gradient.shape[4]
    filter_total = math.prod(kernel.shape[:4])
    work = positions * out_depth + filter_total * out_depth + positions * filter_total
    shard = 1 if input_filter and gradient.shape[0] == 1 else \
        -(-(l3_cache_bytes() // item) // work)
    column = shard * positions * filter_total
    tensors = sum(math.prod(i.shape) for i in infos)
    return 0 if column // tensors > MAX_TEMP_OVERHEAD else column * item


# GPU convolutions: op -> (input, filter, output gradient) input indices; None: the output is it.
GPU_CONVOLUTIONS = {
    "Conv2D": (0, 1, None), "_FusedConv2D": (0, 1, None), "Conv3D": (0, 1, None),
    "Conv2DBackpropInput": (None, 1, 2), "Conv3DBackpropInputV2": (None, 1, 2),
    "Conv2DBackpropFilter": (0, None, 2), "Conv3DBackpropFilterV2": (0, None, 2),
}
WORKSPACE_LIMIT = 1 << 32  # TensorFlow's default cuDNN workspace limit, 4 GiB


def workspace_limit() -> int:
    """The cuDNN workspace limit TensorFlow would use in this environment."""
    text = os.environ.get("TF_CUDNN_WORKSPACE_LIMIT_IN_MB", "")
    return int(text) << 20 if text.strip().isdigit() else WORKSPACE_LIMIT


def gpu_bytes(graph: Graph, shapes: Shapes, name: str) -> int:
    """ESTIMATE, not measured: the cuDNN workspace of a GPU convolution, as the largest of its
    operands capped by the workspace limit; 0 when not a convolution or a size is unknown."""
    indices = GPU_CONVOLUTIONS.get(graph.op(name))
    if indices is None:
        return 0
    inputs = graph.data_inputs(name)
    sizes = [shapes.nbytes(inputs[i]) if i < len(inputs) else None
             for i in indices if i is not None] + [shapes.nbytes(TensorRef(name))]
    if any(size is None for size in sizes):
        return 0
    return min(max(sizes), workspace_limit())


# op -> NHWC temporaries the CPU kernel makes of an NCHW input (forward: x and y; gradient: the
# output gradient, x and x's gradient)
CPU_BATCH_NORMS = {**dict.fromkeys(("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"), 2),
                   **dict.fromkeys(("FusedBatchNormGrad", "FusedBatchNormGradV2",
                                    "FusedBatchNormGradV3"), 3)}


def cpu_batch_norm_bytes(graph: Graph, shapes: Shapes, name: str) -> int:
    """The NHWC copies a CPU fused batch norm makes of an NCHW input, and a 16-bit gradient's
    float32 sums; 0 when the input's size is unknown."""
    node = graph.node_def(name)
    inputs = graph.data_inputs(name)
    x = shapes[inputs[1 if "Grad" in node.op else 0]] if len(inputs) > 1 else None
    if x is None or x.nbytes is None or None in x.shape:
        return 0
    copies = CPU_BATCH_NORMS[node.op] if node.attr["data_format"].s == b"NCHW" else 0
    item = x.nbytes // max(1, math.prod(x.shape))
    widened = math.prod(x.shape) * 4 if "Grad" in node.op and item < 4 else 0
    return copies * x.nbytes + widened


BATCH, FREE, CONTRACT, REDUCE = range(4)  # einsum's label kinds, in its transposed order


def einsum_bytes(graph: Graph, shapes: Shapes, name: str) -> int:
    """Bytes of an `Einsum`'s transposed operands and unpermuted product, at their most at once;
    0 for an equation with an ellipsis or a repeated label (not modelled) or unknown shapes."""
    equation = graph.node_def(name).attr["equation"].s.decode()
    operands_text, _, output = equation.partition("->")
    operands = operands_text.split(",")
    refs = graph.data_inputs(name)
    infos = [shapes[r] for r in refs]
    if "." in equation or not 0 < len(operands) == len(refs) <= 2 or \
            any(len(set(s)) != len(s) for s in operands + [output]) or \
            any(i is None or i.nbytes is None or len(i.shape) != len(s) or None in i.shape
                for i, s in zip(infos, operands)):
        return 0
    first = {}  # label -> the order TensorFlow numbers it in
    for label in "".join(operands) + output:
        first.setdefault(label, len(first))
    size = {label: dim for s, i in zip(operands, infos) for label, dim in zip(s, i.shape)}

    def kind(label: str) -> int:
        shared = len(operands) == 2 and all(label in s for s in operands)
        return (BATCH if shared else FREE) if label in output else \
            (CONTRACT if shared else REDUCE)

    item = infos[0].nbytes // max(1, math.prod(infos[0].shape))
    held = peak = 0  # the operands' temporaries kept for the product; their most at once
    free_labels: list[str] = []
    for labels, info in zip(operands, infos):
        swapped = [(BATCH, CONTRACT, FREE, REDUCE).index(kind(c)) for c in labels]
        order = list(labels) if swapped == sorted(swapped) and \
            all(first[a] < first[b] for a, b in zip(labels, labels[1:])
                if kind(a) == kind(b)) else sorted(labels, key=lambda c: (kind(c), first[c]))
        transposed = info.nbytes if order != list(labels) and len(labels) > 1 else 0
        reduced = math.prod(size[c] for c in labels if kind(c) != REDUCE) * item
        reducing = reduced != info.nbytes  # summed over labels only this operand has
        kept = reduced if reducing else transposed
        peak = max(peak, held + transposed + (reduced if reducing else 0))
        held += kept
        free_labels += [c for c in order if kind(c) == FREE]
    product = [c for c in sorted(first, key=first.get) if kind(c) == BATCH] + free_labels
    product_bytes = math.prod(size[c] for c in product) * item if len(operands) == 2 else 0
    if product != list(output):  # the product is a temporary, transposed into the output
        return max(peak, held + product_bytes)
    # the product is the output; of one operand, that operand's reduced or transposed copy
    return max(peak, held) if len(operands) == 2 else peak - held


# Device kind -> op -> bytes of scratch a node of that op takes while it runs.
KERNEL_SCRATCH = {
    "cpu": {**{op: cpu_bytes for op in CPU_CONV_GRADIENTS}, "Einsum": einsum_bytes,
            **{op: cpu_conv3d_bytes for op in CPU_CONV3D_GRADIENTS},
            **{op: cpu_batch_norm_bytes for op in CPU_BATCH_NORMS}},
    "gpu": {**{op: gpu_bytes for op in GPU_CONVOLUTIONS}, "Einsum": einsum_bytes},
}
DEVICE_KINDS = tuple(KERNEL_SCRATCH)


def device_kind(graph: Graph) -> str:
    """The kind of device the step runs on, by placement: a node on a GPU means "gpu"."""
    return "gpu" if any("GPU" in device.upper() for device in graph.devices()) \
        else "cpu"


def kernel_bytes(kind: str, graph: Graph, shapes: Shapes, name: str) -> int:
    """Scratch node `name` takes on a device of `kind` while it runs."""
    measure = KERNEL_SCRATCH.get(kind, {}).get(graph.op(name))
    return measure(graph, shapes, name) if measure else 0


# The convolution gradients: on the CPU the kernels with a column buffer.
CONV_GRADIENTS = frozenset({"Conv2DBackpropInput", "Conv2DBackpropFilter",
                            "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2"})


def alongside(graph: Graph, order: list[str], own: dict[str, int],
              times: dict[str, tuple[float, float]] | None = None) -> dict[str, tuple[int, ...]]:
    """node -> the scratch allocations of other kernels running while it runs, each its own
    allocation. `times` (the CPU executor's modelled start and end, `schedule`): those still
    running when it starts. A convolution's weight gradient runs 2-3 times as long as its
    input's here, so it is still running when the next layer's gradients start: measured on a
    Keras CNN built outside the repo, one layer's weights' gradient ran beside its input's
    gradient and then beside the layer before's two, and the step's peak was 24% over the
    model that paired each gradient only with its twin. Without `times` (a GPU's one
    stream): a kernel with scratch that is ready (everything it waits for ran) before the
    first kernel with scratch scheduled after that starts, but scheduled later itself, runs at
    once with it: a convolution's two gradients, which read the same incoming gradient; two
    branches' gradients (a U-Net's skips, two micro-batches, two views); two at a time, as two
    inter-op threads run them (more overstated a step of two micro-batches by 85%).
    `own`: each scheduled node's own scratch bytes."""
    kernels = [name for name in order if own.get(name)]
    held: dict[str, tuple[int, ...]] = {}
    if times is not None:
        for k, name in enumerate(kernels):
            start = times[name][0]
            running = tuple(own[other] for other in kernels[:k] if times[other][1] > start)
            if running:
                held[name] = running
        return held
    step_of = {name: step for step, name in enumerate(order)}
    for k, later in enumerate(kernels[1:], 1):
        ready = max((step_of.get(p, -1) for p in graph.pred[later]), default=-1)
        first = next((n for n in kernels[:k] if step_of[n] > ready and n not in held), None)
        if first is not None:
            held[first] = (own[later],)
    return held
