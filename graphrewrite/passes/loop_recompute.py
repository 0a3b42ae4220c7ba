"""Loop recompute pass: a recurrent layer's gradient loop computes its step's values again.

Each forward `While` whose lists a gradient `While` pops (`loop_copy`), and each v1 forward frame
whose stacks a gradient frame pops (`loop_copy_v1`), is tried in turn; a try
is kept where the step as TensorFlow runs it (after Grappler, with the calls' loops:
`analysis.as_run`) needs less memory, by a larger share than the share of time it adds
(`planning.as_run`). It runs before `rerun`, whose second forward pass then
pushes only the values kept.

The gradient loop of a pair left as it is runs one iteration at a time (`parallel_iterations`
1). Its recurrence otherwise races ahead of the weight-gradient sums it carries, and every
term computed and not yet added is held: up to 32 iterations' worth (TensorFlow's default),
or none, as the executor's threads happen to take turns (`loops._lagging_sums` bounds it). A
bidirectional LSTM held 32 terms in each direction, 21 MiB of a 32.7 MiB step modelled at
20.3; a Keras bidirectional GRU step measured 30.9 MiB, 27.0 one iteration at a time, at 0.91x
the step time; a nested SimpleRNN 29.8 and 20.7, at 1.03x. The rewritten ones wait already
(`loop_copy`'s `gradient_ready`). Nothing but the order changes: bitwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..analysis.step import Analysis
from ..core.graph import Graph
from . import loop_copy, loop_copy_v1
from .base import EXAMPLES, PassOptions, PassResult
from ..planning.as_run import as_run

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
    serial_gradient_loops: list[str] = field(default_factory=list)  # one iteration at a time


def run(graph: Graph, analysis: Analysis, options: LoopRecomputeOptions, model=None):
    """Recompute in each gradient loop the values whose recomputation lowers the step's peak
    as run."""
    graph_def = graph.to_graph_def()
    pairs = (loop_copy.pairs(graph_def) if graph_def.library.function else []) \
        + loop_copy_v1.pairs(graph_def)
    if not pairs or model is None:
        return LoopRecomputeResult(graph, False)
    best = as_run(model, graph, analysis)
    kept, freed, copied, refused = [], 0, 0, []
    for pair in pairs:
        trial = (loop_copy_v1 if pair.v1 else loop_copy).recompute(graph_def, pair)
        if isinstance(trial, str):
            log.info("loop %s left alone: %s", pair.name(), trial)
            refused.append(f"{pair.name()}: {trial}")
            continue
        cost = as_run(model, Graph.from_graph_def(trial[0]), analysis)
        log.info("loop %s: %d lists recomputed (%d nodes copied): as run %s -> %s",
                 pair.name(), *trial[1], best, cost)
        if best is not None and best.better(cost):
            graph_def, best = trial[0], cost
            kept.append(pair.name())
            freed, copied = freed + trial[1][0], copied + trial[1][1]
    serial = [pair.name() for pair in pairs if pair.name() not in kept
              and loop_copy.one_iteration_at_a_time(graph_def, pair, pair.gradient)]
    note = ""
    if not kept:
        why = "; ".join(refused[:EXAMPLES]) if len(refused) == len(pairs) else \
            "computing them again does not lower the step's peak as run by more than the " \
            "share of time it adds"
        note = f"no gradient loop computes its step's values again ({why})"
    if not (kept or serial):
        return LoopRecomputeResult(graph, False, note=note)
    return LoopRecomputeResult(Graph.from_graph_def(graph_def), True, note=note,
                               recomputed_loops=kept, loop_lists_freed=freed,
                               loop_nodes_copied=copied, serial_gradient_loops=serial)

