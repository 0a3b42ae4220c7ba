"""Relax-assign pass: mark Assign nodes whose result never leaves their device.

TensorFlow allocates an Assign's output under the allocator constraints its consumers might
need (host-accessible memory for a consumer on another device, say). When everything downstream
of an Assign runs on the Assign's own device and nothing is sent elsewhere, the attribute
`_grappler_relax_allocator_constraints` lets the kernel skip them and reuse the assigned buffer.
Grappler's memory optimizer sets it at session start; this pass writes the same mark into the
file, by the same rule, so other runtimes and readers of the graph see it too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorflow.core.framework import attr_value_pb2

from ..analysis.split import reachable
from ..analysis.step import Analysis
from ..core.graph import Graph
from .base import PassOptions, PassResult

__all__ = ["RELAX_ATTR", "ASSIGN_OPS", "SEND_OPS", "RelaxAssignOptions", "RelaxAssignResult", "run"]

RELAX_ATTR = "_grappler_relax_allocator_constraints"
ASSIGN_OPS = ("Assign",)
SEND_OPS = ("_Send", "_HostSend")


@dataclass(frozen=True)
class RelaxAssignOptions(PassOptions):
    pass


@dataclass
class RelaxAssignResult(PassResult):
    relaxed_assigns: list[str] = field(default_factory=list)


def run(graph: Graph, analysis: Analysis, options: RelaxAssignOptions, model=None):
    """Set RELAX_ATTR on each Assign whose transitive readers all share its device."""
    names = graph.nodes()
    if any(graph.op(n) in SEND_OPS for n in names):
        return RelaxAssignResult(graph, False, note="the graph sends tensors between devices: "
                                                    "nothing relaxed")
    relaxed = []
    for name in names:
        if graph.op(name) not in ASSIGN_OPS or RELAX_ATTR in graph.node_def(name).attr:
            continue
        device = graph.node_def(name).device
        if all(graph.node_def(n).device == device for n in reachable(graph.nx, [name])):
            relaxed.append(name)
    if not relaxed:
        return RelaxAssignResult(graph, False, note="no Assign keeps its result on its device")
    graph = graph.copy()
    for name in relaxed:
        graph.set_attr(name, RELAX_ATTR, attr_value_pb2.AttrValue(b=True))
    return RelaxAssignResult(graph, True, relaxed_assigns=relaxed)
