"""Rerun pass: a recurrent layer's forward pass run again right before its backward pass.

A Keras RNN's forward call or loop keeps every step's values for its backward pass (`rerun_copy`),
so the first layers' are held through every later layer's forward and backward passes. The pass
tries each forward pass whose results a backward pass reads, in forward order, and keeps a
second run where the step as TensorFlow runs it (after Grappler, with the calls'
loops: `analysis.as_run`) needs less memory, and by a larger share than the share of time the
second run adds (`planning.as_run`): the last layer's values are read as soon as they are
made, so running it again saves nothing and costs a forward pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..analysis.split import backward_functions
from ..analysis.step import Analysis
from ..core.graph import Graph
from ..core.names import COPY_SUFFIX
from ..planning.as_run import as_run, keep_better
from . import rerun_copy as rerun
from .base import PassOptions, PassResult

__all__ = ["RerunOptions", "RerunResult", "run"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class RerunOptions(PassOptions):
    pass


@dataclass
class RerunResult(PassResult):
    rerun: list[str] = field(default_factory=list)  # forward calls and loops run again


def run(graph: Graph, analysis: Analysis, options: RerunOptions, model=None):
    """Run again the forward passes whose second run lowers the step's peak as run for less
    time than it saves."""
    library = graph.shell.library
    pairs = rerun.candidates(graph, backward_functions(library), analysis.fetches) \
        if library.function else []
    if not pairs or model is None:
        return RerunResult(graph, False)

    def attempt(graph_def, pair):
        forward, backward = pair
        if any(n.name == forward + COPY_SUFFIX for n in graph_def.node):
            return None  # read by two backward passes: the first one's run stays alone
        trial = rerun.rerun(graph_def, forward, backward)
        cost = as_run(model, Graph.from_graph_def(trial), analysis)
        log.info("rerun %s before %s: as run %s", forward, backward, cost)
        return trial, cost

    best = as_run(model, graph, analysis)
    log.info("rerun: the step as run %s", best)
    graph_def, kept = keep_better(pairs, graph.to_graph_def(), best, attempt)
    if not kept:
        return RerunResult(graph, False, note="no recurrent layer's forward pass, run again "
                           "before its backward pass, lowers the step's peak as run by more "
                           "than the share of time it adds")
    return RerunResult(Graph.from_graph_def(graph_def), True, rerun=[f for f, _ in kept])
