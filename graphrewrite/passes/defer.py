"""Defer pass: compute a large value of the parameters alone when the gradient it meets is ready.

An optimizer's update often multiplies a slot by a constant before it meets the gradient (Keras
SGD with momentum: `m * momentum - lr * g`). That product depends on no fed data, so the executor
computes it as soon as the step starts and holds it, one copy of every slot, until the gradient
arrives near the end of back-propagation. Each such value (a parameter, see `parameters`, of at
least `min_bytes`) whose readers are all in the gradient flow is made to wait, by control
inputs, for the gradient-flow values its readers read: it is computed when it is needed and dies
at once. Nothing is copied and no value changes: the same kernel reads the same inputs, later.

Only values computed from resource-variable reads are deferred: a ref variable's `Identity`
aliases a buffer that an in-place update may change, so reading it later could read another
value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import memory, parameters
from ..analysis.split import reachable
from ..analysis.step import Analysis
from ..core.graph import Graph
from .base import PassOptions, PassResult

__all__ = ["REF_VARIABLE_OPS", "DeferOptions", "DeferResult", "run"]

REF_VARIABLE_OPS = frozenset({"VariableV2", "Variable"})


@dataclass(frozen=True)
class DeferOptions(PassOptions):
    min_bytes: int = 64 * 1024  # smaller values are not worth a control edge


@dataclass
class DeferResult(PassResult):
    deferred: list[str] = field(default_factory=list)  # values made to wait for a gradient


def run(graph: Graph, analysis: Analysis, options: DeferOptions, model=None):
    """Give each large parameter-only value read only by the gradient flow the gradient-flow
    inputs of its readers as control inputs (see the module's docstring)."""
    flow = analysis.split.gradient_flow
    params = analysis.parameters(graph)
    deferrable = [n for n in graph.nodes()
                  if _deferrable(graph, analysis, params, flow, n, options.min_bytes)]
    if not deferrable:  # the usual case outside training steps: no note, modes run it always
        return DeferResult(graph, False)
    graph, deferred = graph.copy(), []
    for name in deferrable:
        # Checked on the graph as it grows: an earlier deferral may have made a wait depend
        # on this value.
        downstream = reachable(graph.nx, [name])
        waits = sorted({r.node for v in graph.successors(name) for r in graph.data_inputs(v)
                        if r.node in flow and r.node not in downstream})
        for wait in waits:
            graph.add_control(wait, name)
        if waits:
            deferred.append(name)
    return DeferResult(graph, bool(deferred), shapes=analysis.shapes, deferred=sorted(deferred))


def _deferrable(graph: Graph, analysis: Analysis, params, flow, name: str,
                min_bytes: int) -> bool:
    op = graph.op(name)
    if (name not in params or parameters.is_variable(graph, name) or op in memory.ALIAS_OPS
            or op in parameters.READ_OPS):
        return False
    readers = graph.successors(name)
    if not readers or not all(v in flow for v in readers):
        return False
    size = max((analysis.shapes.nbytes(r) or 0 for r in analysis.shapes.outputs(name)),
               default=0)
    if size < min_bytes:
        return False
    upstream = reachable(graph.nx, [name], upstream=True)
    if upstream & flow:  # it already waits for the gradient (a slot read after its update)
        return False
    return not any(graph.op(s) in REF_VARIABLE_OPS for s in upstream & params)
