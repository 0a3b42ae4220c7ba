"""Loop recompute pass: a recurrent layer's gradient loop computes its step's values again.

Each forward `While` whose lists a gradient `While` pops (`loop_copy`), and each v1 forward frame
whose stacks a gradient frame pops (`loop_copy_v1`), is tried in turn; a try
is kept where the step as TensorFlow runs it (after Grappler, with the calls' loops:
`analysis.as_run`) needs less memory. It runs before `rerun`, whose second forward pass then
pushes only the values kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..analysis.step import Analysis
from ..core.graph import Graph
from . import loop_copy, loop_copy_v1
from .base import EXAMPLES, PassOptions, PassResult
from .rerun import GAIN, peak_as_run

__all__ = ["LoopRecomputeOptions", "LoopRecomputeResult", "run"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopRecomputeOptions(PassOptions):
    pass


@dataclass
class LoopRecomputeResult(PassResult):
    recomputed_loops: list[str] = field(default_factory=list)  # forward loops, fewer pushes
    loop_lists_freed: int = 0   # per-iteration lists their forward bodies no longer push
    loop_nodes_copied: int = 0  # forward nodes copied into gradient bodies


def run(graph: Graph, analysis: Analysis, options: LoopRecomputeOptions, model=None):
    """Recompute in each gradient loop the values whose recomputation lowers the step's peak
    as run."""
    graph_def = graph.to_graph_def()
    pairs = (loop_copy.pairs(graph_def) if graph_def.library.function else []) \
        + loop_copy_v1.pairs(graph_def)
    if not pairs or model is None:
        return LoopRecomputeResult(graph, False)
    best = peak_as_run(model, graph, analysis)
    kept, freed, copied, refused = [], 0, 0, []
    for pair in pairs:
        trial = (loop_copy_v1 if pair.v1 else loop_copy).recompute(graph_def, pair)
        if isinstance(trial, str):
            log.info("loop %s left alone: %s", pair.name(), trial)
            refused.append(f"{pair.name()}: {trial}")
            continue
        peak = peak_as_run(model, Graph.from_graph_def(trial[0]), analysis)
        log.info("loop %s: %d lists recomputed (%d nodes copied): modelled peak as run "
                 "%s -> %s", pair.name(), *trial[1], best, peak)
        if best and peak is not None and peak < best * (1 - GAIN):
            graph_def, best = trial[0], peak
            kept.append(pair.name())
            freed, copied = freed + trial[1][0], copied + trial[1][1]
    if not kept:
        why = "; ".join(refused[:EXAMPLES]) if len(refused) == len(pairs) else \
            "computing them again does not lower the step's peak as run"
        return LoopRecomputeResult(graph, False, note="no gradient loop computes its step's "
                                   f"values again ({why})")
    return LoopRecomputeResult(Graph.from_graph_def(graph_def), True, recomputed_loops=kept,
                               loop_lists_freed=freed, loop_nodes_copied=copied)
