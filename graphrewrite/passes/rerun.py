"""Rerun pass: a recurrent layer's forward pass run again right before its backward pass.

A Keras RNN's forward call or loop keeps every step's values for its backward pass (`rerun_copy`),
so the first layers' are held through every later layer's forward and backward passes. The pass
tries each forward pass whose results a backward pass reads, in forward order, and keeps a
second run where the step as TensorFlow runs it (after Grappler, with the calls'
loops: `analysis.as_run`) needs less memory: the last layer's values are read as soon as they
are made, so running it again saves nothing and costs a forward pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..analysis import step as analysis_mod
from ..analysis.split import backward_functions
from ..analysis.step import Analysis
from ..core.graph import Graph
from . import rerun_copy as rerun
from .base import PassOptions, PassResult

__all__ = ["GAIN", "RerunOptions", "RerunResult", "peak_as_run", "run"]

log = logging.getLogger(__name__)

GAIN = 0.02  # a second run must lower the modelled peak by this fraction to be kept


@dataclass(frozen=True)
class RerunOptions(PassOptions):
    pass


@dataclass
class RerunResult(PassResult):
    rerun: list[str] = field(default_factory=list)  # forward calls and loops run again


def run(graph: Graph, analysis: Analysis, options: RerunOptions, model=None):
    """Run again the forward passes whose second run lowers the step's peak as run."""
    library = graph.shell.library
    pairs = rerun.candidates(graph, backward_functions(library), analysis.fetches) \
        if library.function else []
    if not pairs or model is None:
        return RerunResult(graph, False)
    graph_def = graph.to_graph_def()
    best = peak_as_run(model, graph, analysis)
    kept = []
    for forward, backward in pairs:
        if forward in kept:  # read by two backward passes: the first one's run stays alone
            continue
        trial = rerun.rerun(graph_def, forward, backward)
        peak = peak_as_run(model, Graph.from_graph_def(trial), analysis)
        log.info("rerun %s before %s: modelled peak as run %s -> %s", forward, backward,
                 best, peak)
        if best and peak is not None and peak < best * (1 - GAIN):
            graph_def, best = trial, peak
            kept.append(forward)
    if not kept:
        return RerunResult(graph, False, note="no recurrent layer's forward pass, run again "
                           "before its backward pass, lowers the step's peak as run")
    return RerunResult(Graph.from_graph_def(graph_def), True, rerun=kept)


def peak_as_run(model, graph: Graph, found: Analysis) -> int | None:
    """The allocator's peak of `graph`'s step as run; None where Grappler cannot run it."""
    report = analysis_mod.as_run(model, graph, found)
    return None if report is None else report.allocated_peak()
