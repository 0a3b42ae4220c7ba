"""Ungate pass: the updates stop waiting for the whole backward pass.

`tf.compat.v1.train.Optimizer.compute_gradients(..., gate_gradients=GATE_GRAPH)` passes every
gradient through `tf.tuple`: each reaches its update through an Identity that waits for a NoOp
grouping all the gradients. No update can then run before the last gradient exists, so every
weight's gradient is held to the end of the backward pass (a TF1 ResNet-50 built outside the
repo: 80 of the 103 MiB live at its peak, after recomputation; 0.89x measured where the gate
taken out gave 0.73x). The gate exists for ref variables, whose read (an Identity of the
variable's buffer) an update overwrites in place: only where every update behind the gate
writes a resource variable, whose reads are snapshots (an update while one is held copies the
variable), does the pass take the gate's control edges out. The values are the same (bitwise);
a read no update needs is ordered before the updates by `reads_first`, which runs after any
pass that changed the graph.

A NoOp is taken for such a gate when it waits for two or more gradient-flow nodes and each
Identity waiting for it passes a parameter's whole gradient on to that parameter's update alone
(`apply_early.update_of`; on the way, no forward value but a variable's is read): `GATE_OP`'s
per-op tuples, whose input gradient goes on through the backward pass, and a tuple ahead of a
global-norm clip, which every update reads, stay. A per-op tuple whose entries are all whole
gradients goes too (the zoo's TF1 transformer sums its token and position embeddings: their
two updates waited for each other; bitwise, and measured the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import bind, parameters
from ..analysis.step import Analysis
from ..core.graph import Graph
from ..core.tensor_ref import TensorRef
from .apply_early import MANY, update_of, variable_writes
from .base import PassOptions, PassResult

__all__ = ["UngateOptions", "UngateResult", "run", "gates"]

RESOURCE_WRITES = ("ResourceApply", "ResourceSparseApply", "AssignVariableOp",
                   "AssignAddVariableOp", "AssignSubVariableOp", "ResourceScatter")


@dataclass(frozen=True)
class UngateOptions(PassOptions):
    pass


@dataclass
class UngateResult(PassResult):
    ungated: list[str] = field(default_factory=list)  # the gates' NoOps taken out


def gates(graph: Graph, analysis: Analysis) -> dict[str, list[str]]:
    """Each gate the updates wait behind (see the module's docstring): its NoOp and the
    Identities waiting for it."""
    flow = analysis.split.gradient_flow
    candidates = {}
    for name in graph.nodes():
        if graph.op(name) != "NoOp" or sum(c in flow for c in graph.control_inputs(name)) < 2:
            continue
        waiting = [u for u, slot in graph.consumers(name) if slot == -1]
        if len(waiting) >= 2 and all(graph.op(u) == "Identity" for u in waiting):
            candidates[name] = waiting
    if not candidates:  # the usual case: the owners below walk the whole graph
        return {}
    writes = variable_writes(graph, flow)
    owner = update_of(graph, analysis.split, writes)
    found = {}
    for name, waiting in candidates.items():
        if any(owner.get(u) in (None, MANY) for u in waiting):
            continue
        if not all(_whole_gradient(graph, analysis.split, u, owner) for u in waiting):
            continue
        params = {owner[u] for u in waiting}
        behind = [w for w, var in writes.items() if var in params]
        if all(graph.op(w).startswith(RESOURCE_WRITES) for w in behind) and all(
                graph.op(v) == "VarHandleOp" or bind.is_resource_placeholder(graph.node_def(v))
                for v in params):
            found[name] = sorted(waiting)
    return found


def _whole_gradient(graph: Graph, split, start: str, owner: dict[str, str]) -> bool:
    """Whether `start`'s value reaches its parameter's update without meeting a forward value
    other than a variable's: the parameter's whole gradient, not one the backward pass goes on
    from (an op's input gradient, which a per-op tuple gates beside its weight's)."""
    param, seen, todo = owner[start], {start}, [start]
    while todo:
        for user in graph.successors(todo.pop()):
            if user in seen or owner.get(user) != param:
                continue
            if any(r.node not in seen and r.node in split.forward
                   and r.node not in split.constant and graph.op(r.node) != "ReadVariableOp"
                   and not parameters.is_variable(graph, r.node)
                   for r in graph.data_inputs(user)):
                return False
            seen.add(user)
            todo.append(user)
    return True


def run(graph: Graph, analysis: Analysis, options: UngateOptions, model=None):
    """Take the control edges of every gate (`gates`) out, on a copy of `graph`."""
    found = gates(graph, analysis)
    if not found:
        return UngateResult(graph, False)
    flow = analysis.split.gradient_flow
    graph = graph.copy()
    for gate, waiting in found.items():
        # what the gate waits for outside the backward pass (the batch norms' updates, when
        # `minimize` ran under `control_dependencies` on them) is still waited for
        kept = [c for c in graph.control_inputs(gate) if c not in flow]
        for name in waiting:
            node = graph.node_def(name)
            controls = [c for c in graph.control_inputs(name) if c != gate]
            inputs = graph.data_inputs(name) + [TensorRef(c, -1) for c in
                                                 dict.fromkeys(controls + kept)]
            graph.redefine(name, node.op, inputs, dict(node.attr))
    return UngateResult(graph, True, ungated=sorted(found))
