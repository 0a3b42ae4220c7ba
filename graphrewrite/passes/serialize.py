"""Serialize pass: the convolution gradients run one at a time.

A convolution's gradients, the weights' (`Conv2DBackpropFilter`) and the input's
(`Conv2DBackpropInput`), read the same incoming gradient: they become ready together and the
executor runs them at once on two threads, each holding its scratch (on the CPU a column buffer of
up to 30 MiB, on a GPU cuDNN's workspace); so do the gradients of two branches (a U-Net's skips,
two micro-batches, two views of a contrastive step). Measured on the CPU here (TensorFlow 2.15,
oneDNN off as `measure` runs it, the allocator's own peak): a Keras CNN recipe cell
(`km_cnn_adam_bn`) 59.6 -> 35.2 MiB with this pass alone, bitwise; the demo's MobileNetV2-style
TF2 step 204.0 -> 177.3 MiB, 1.12x step time. The memory model counts the scratches of kernels
that can run at once (`scratch.alongside`), so it sees the gain. Mode memory runs it last. On a
GPU not measured.

Control edges chain the gradient flow's convolution gradients in the order the memory model
schedules them, each waiting for the one before: they change no number, and a schedule order is
topological, so they make no cycle. An edge already there is not added again. A
`Conv2DBackpropFilter`'s `BiasAddGrad` (reading the same gradient) waits as it does: oneDNN's
layout pass (TensorFlow's default on x86 CPUs) merges the two only when their control inputs are
the same, and merged they sum the bias gradient in another order (a gradient-accumulation CNN
built outside the repo lost bitwise equality there).

A functional loop holding the step's backward pass (micro-batches whose gradients it sums, as a
`tf.range` loop in a `tf.function` writes it; training steps, as `steps_per_execution` does)
runs one iteration at a time (`parallel_iterations` 1): the iterations are independent but for
the sums they carry, which add in iteration order either way, and up to ten of them ran at once,
each holding its forward and backward pass (an MLP step of four micro-batches: 71.9 -> 53.1 MiB
measured, bitwise, the same step time; a CNN one built outside the repo 0.94x). The memory model
runs a loop's iterations one at a time already: it saw that step at 55.9 MiB either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
from tensorflow.core.framework import attr_value_pb2

from ..analysis import scratch
from ..analysis import split as split_mod
from ..analysis.step import Analysis
from ..core.graph import Graph
from .base import PassOptions, PassResult
from .pads import bias_gradients, keep_apart

__all__ = ["SerializeOptions", "SerializeResult", "run"]

V1_CONTROL_FLOW = {"Enter", "RefEnter", "Switch", "RefSwitch"}


@dataclass(frozen=True)
class SerializeOptions(PassOptions):
    pass


@dataclass
class SerializeResult(PassResult):
    serialized: list[tuple[str, str]] = field(default_factory=list)  # (first, then)
    serial_loops: list[str] = field(default_factory=list)  # now one iteration at a time


def run(graph: Graph, analysis: Analysis, options: SerializeOptions, model=None):
    """Make each convolution gradient in the gradient flow wait for the one the memory model
    schedules before it, and each loop holding a backward pass run one iteration at a time."""
    # the whole backward pass in a loop (no seed outside it): not an RNN's gradient loop
    loops = [] if analysis.split.seeds else _training_loops(graph)
    if loops:
        graph = graph.copy()
        for name in loops:
            graph.set_attr(name, "parallel_iterations", attr_value_pb2.AttrValue(i=1))
    result = _convolutions(graph, analysis)
    result.serial_loops = loops
    result.modified |= bool(loops)
    return result


def _training_loops(graph: Graph) -> list[str]:
    """Functional loops whose body holds gradient ops and may run iterations at once (with no
    gradient seed outside them: the step's backward pass)."""
    backward = split_mod.backward_functions(graph.shell.library)
    return sorted(n for n in graph.nodes() if graph.op(n) in ("While", "StatelessWhile")
                  and graph.node_def(n).attr["body"].func.name in backward
                  and graph.node_def(n).attr["parallel_iterations"].i != 1)


def _convolutions(graph: Graph, analysis: Analysis) -> SerializeResult:
    """The convolution gradients' part of `run`."""
    flow = analysis.split.gradient_flow
    ops = graph.ops(analysis.memory.order)
    kernels = [name for name in analysis.memory.order
               if ops[name] in scratch.CONV_GRADIENTS and name in flow]
    if any(op in V1_CONTROL_FLOW for op in ops.values()):
        # a control edge into or out of a loop frame is invalid, out of a cond branch it makes
        # a node wait for a branch that may not run
        inside = split_mod.loop_frame_nodes(graph) | split_mod.cond_branch_nodes(graph)
        kernels = [name for name in kernels if name not in inside]
    # not already waiting for it: an edge along a path Grappler drops, and a weight gradient
    # waiting through a recomputed input its bias gradient does not read would then wait
    # otherwise than that bias gradient, and oneDNN would not merge the two as in the original
    pairs = [(first, then) for first, then in zip(kernels, kernels[1:])
             if not nx.has_path(graph.nx, first, then)]
    if not pairs:  # said only where there are two
        return SerializeResult(graph, False, note="no two convolution gradients can run at once"
                               if len(kernels) > 1 else "")
    graph = graph.copy()
    done = [(first, then) for first, then in pairs if graph.add_control(first, then)]
    for first, then in done:  # a weight gradient's bias gradient waits as it does
        siblings = bias_gradients(graph, graph.data_inputs(then)[2]) \
            if graph.op(then) == "Conv2DBackpropFilter" else []
        for sibling in siblings:
            if not nx.has_path(graph.nx, sibling, first):  # never a cycle
                graph.add_control(first, sibling)
    keep_apart(graph)
    return SerializeResult(graph, bool(done), serialized=done)
