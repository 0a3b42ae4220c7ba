"""Bytes per trainable parameter: what a step's weights and their optimizer state cost.

A weight is a variable an optimizer update writes (`ResourceApplyAdam` and its kin, or a Keras
optimizer's decomposed update in a TF2 step: see `optimizers`) or one the diet pass rewrote
(marked `_graphrewrite_diet`); its optimizer state is the slots that update keeps or that the
diet pass marked as serving it. Values are counted at their stored dtype: a dieted weight costs
2 bytes, its factored accumulators a row and a column. Shared scalars (Adam's beta powers) are
left out: they do not grow with the model. Updates of other forms (a sparse update of an
embedding) are not counted.
"""

from __future__ import annotations

from ..core.graph import Graph
from ..core.names import DIET_ATTR, SLOT_OF_ATTR
from . import optimizers, parameters

__all__ = ["parameter_facts"]


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


def parameter_facts(graph: Graph, shapes) -> dict:
    """`trainable_parameters`, `bytes_per_parameter` (values plus optimizer state, over all
    weights) and `bytes_per_parameter_2d` (matrices only); None where no weight is found."""
    totals = {"all": [0, 0], "2d": [0, 0]}  # [elements, bytes]
    for weight, slots in _weights_and_slots(graph).items():
        info = parameters.value_info(graph, shapes, weight)
        if info is None or info.shape is None or None in info.shape:
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
    return {
        "trainable_parameters": totals["all"][0],
        "bytes_per_parameter": totals["all"][1] / totals["all"][0] if totals["all"][0] else None,
        "bytes_per_parameter_2d": totals["2d"][1] / totals["2d"][0] if totals["2d"][0] else None,
    }
