"""Serialize pass: a convolution's two gradients run one after the other.

A convolution's gradients, the weights' (`Conv2DBackpropFilter`) and the input's
(`Conv2DBackpropInput`), read the same incoming gradient: they become ready together and the
executor runs them at once on two threads. Measured on the CPU here (TensorFlow 2.15, oneDNN off
as `measure` runs it), the step's allocator peak then holds a large temporary that the two run
one after the other do not show: a Keras CNN recipe cell (`km_cnn_adam_bn`) measured 27.6-35.2
MiB over processes, 3.3 MiB with this pass alone, bitwise, 1.04x step time; a 128x128 U-Net
TF2 step 245 -> 220 MiB alone, and after mode memory's rewrite 0.56x -> 0.50x of its original,
1.30x step; the zoo's resnet_adam_meta after mode memory 0.77x -> 0.24x (46.7 -> 14.7 MiB). Which temporary it is was not traced; the memory model runs one node at a time and
so does not see the gain. On a GPU the two also hold cuDNN workspace at once (not measured).

A control edge makes the input's gradient wait for the weights': it changes no number. An
edge is added only where neither already reaches the other (no cycle, no edge repeated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from ..analysis.step import Analysis
from ..core.graph import Graph
from .base import PassOptions, PassResult

__all__ = ["SerializeOptions", "SerializeResult", "run"]

FILTER_GRADIENT, INPUT_GRADIENT = "Conv2DBackpropFilter", "Conv2DBackpropInput"
GRADIENT_INPUT = 2  # both read the incoming gradient as their third input


@dataclass(frozen=True)
class SerializeOptions(PassOptions):
    pass


@dataclass
class SerializeResult(PassResult):
    serialized: list[tuple[str, str]] = field(default_factory=list)  # (first, then)


def run(graph: Graph, analysis: Analysis, options: SerializeOptions, model=None):
    """Make each `Conv2DBackpropInput` in the gradient flow wait for the
    `Conv2DBackpropFilter` that reads the same incoming gradient."""
    flow = analysis.split.gradient_flow
    readers: dict = {}  # incoming gradient -> {op: [its readers of that op]}
    for name in graph.nodes():
        op, inputs = graph.op(name), graph.data_inputs(name)
        if op in (FILTER_GRADIENT, INPUT_GRADIENT) and name in flow and \
                len(inputs) > GRADIENT_INPUT:
            readers.setdefault(inputs[GRADIENT_INPUT], {}).setdefault(op, []).append(name)
    pairs = [(first, then) for ops in readers.values()
             for first in ops.get(FILTER_GRADIENT, []) for then in ops.get(INPUT_GRADIENT, [])]
    if not pairs:
        return SerializeResult(graph, False, note="no convolution's two gradients run together")
    graph = graph.copy()
    done = []
    for first, then in pairs:
        if not nx.has_path(graph.nx, then, first) and graph.add_control(first, then):
            done.append((first, then))
    return SerializeResult(graph, bool(done), serialized=done)
