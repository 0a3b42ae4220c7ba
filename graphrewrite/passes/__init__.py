"""Rewrite passes, one per module. Each is `run(graph, analysis, options, model) -> PassResult`
and registered here by name with the frozen dataclass of its options."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..graph import Graph
from . import accumulate, recompute, relax_assign, swap


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) graph, whether it changed, and what it did."""

    graph: Graph
    modified: bool
    stats: dict = field(default_factory=dict)
    shapes: object = None  # the new graph's Shapes, when the pass knows them (saves inference)


PASSES = {
    "recompute": (recompute.RecomputeOptions, recompute.run),
    "swap": (swap.SwapOptions, swap.run),
    "accumulate": (accumulate.AccumulateOptions, accumulate.run),
    "relax_assign": (relax_assign.RelaxAssignOptions, relax_assign.run),
}
