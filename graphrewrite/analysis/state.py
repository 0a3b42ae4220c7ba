"""Bytes per trainable parameter: what a step's weights and their optimizer state cost.

A weight is a variable an optimizer update writes (`ResourceApplyAdam` and its kin, or a Keras
optimizer's decomposed update in a TF2 step: see `optimizers`) or one the diet pass rewrote
(marked `_graphrewrite_diet`); its optimizer state is the slots that update keeps or that the
diet pass marked as serving it. Values are counted at their stored dtype: a dieted weight costs
2 bytes, its factored accumulators a row and a column. Shared scalars (Adam's beta powers) are
left out: they do not grow with the model.

Updates of other forms (RMSProp, Adagrad, Nesterov momentum, momentum written by hand with
`assign`) are read from the graph's structure instead: a variable the step writes with a value
computed from the gradient is a weight where the loss is computed from it, else optimizer state
(a fused apply's other variable inputs are its slots); such state counts for all weights, and
for the matrices when its own shape is a matrix's.
"""

from __future__ import annotations

import networkx as nx

from ..core.graph import Graph
from ..core.names import DIET_ATTR, SLOT_OF_ATTR
from . import optimizers, parameters
from . import split as split_mod

# Ops that write their first input, a variable: fused optimizer applies and assignments.
WRITES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply", "Assign")

__all__ = ["WRITES", "parameter_facts"]


def _weights_and_slots(graph: Graph) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    updates = optimizers.updates(graph)
    slots_of_updates = optimizers.slots_of(updates)
    for update in updates:
        if update.var not in slots_of_updates:  # not a Keras slot's own write
            found.setdefault(update.var, set()).update(update.slots.values())
    for name in graph.nodes():
        node = graph.node_def(name)
        if DIET_ATTR in node.attr:
            found.setdefault(name, set())
        if SLOT_OF_ATTR in node.attr:
            found.setdefault(node.attr[SLOT_OF_ATTR].s.decode(), set()).add(name)
    return {w: {s for s in slots if s in graph} for w, slots in found.items() if w in graph}


def _by_structure(graph: Graph, split, known: set[str]) -> tuple[set[str], set[str]]:
    """(weights, optimizer state) of the updates `optimizers` does not read, from the graph:
    variables not in `known` that the step writes from the gradient flow."""
    weights, state = set(), set()
    loss_inputs = set().union(*(nx.ancestors(graph.nx, d) for d in split.differentiated))
    for name in graph.nodes():
        data = graph.data_inputs(name)
        if not data or not graph.op(name).startswith(WRITES) or \
                not any(r.node in split.gradient_flow for r in data[1:]):
            continue
        var = data[0].node
        if var in known or not parameters.is_variable(graph, var):
            continue
        if graph.op(name).startswith("Assign"):  # a weight if the loss is computed from it
            (weights if var in loss_inputs else state).add(var)
        else:  # a fused apply: the weight, then its slots
            weights.add(var)
            state.update(r.node for r in data[1:] if parameters.is_variable(graph, r.node))
    return weights, state - weights - known


def parameter_facts(graph: Graph, shapes, split=None) -> dict:
    """`trainable_parameters`, `bytes_per_parameter` (values plus optimizer state, over all
    weights) and `bytes_per_parameter_2d` (matrices only); None where no weight is found.
    `split` (found when not given) tells weights from state where no known update does."""
    totals = {"all": [0, 0], "2d": [0, 0]}  # [elements, bytes]
    known = _weights_and_slots(graph)
    held = set(known) | {s for slots in known.values() for s in slots}
    weights, state = _by_structure(graph, split or split_mod.split(graph), held)
    for weight, slots in {**known, **{w: set() for w in weights}}.items():
        info = parameters.value_info(graph, shapes, weight)
        if info is None or info.shape is None or None in info.shape or \
                (weight in weights and not info.shape):  # a step counter, a beta power
            continue
        count = 1
        for d in info.shape:
            count *= d
        size = info.nbytes or 0
        for slot in slots:
            slot_info = parameters.value_info(graph, shapes, slot)
            size += (slot_info.nbytes or 0) if slot_info is not None else 0
        for key in ("all", "2d") if len(info.shape) == 2 else ("all",):
            totals[key][0] += count
            totals[key][1] += size
    for slot in state:
        info = parameters.value_info(graph, shapes, slot)
        if info is not None and info.shape and info.nbytes:
            for key in ("all", "2d") if len(info.shape) == 2 else ("all",):
                totals[key][1] += info.nbytes
    return {
        "trainable_parameters": totals["all"][0],
        "bytes_per_parameter": totals["all"][1] / totals["all"][0] if totals["all"][0] else None,
        "bytes_per_parameter_2d": totals["2d"][1] / totals["2d"][0] if totals["2d"][0] else None,
    }
