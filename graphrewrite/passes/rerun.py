"""Rerun pass: a recurrent layer's forward pass run again right before its backward pass.

A Keras RNN's forward call or loop keeps every step's values for its backward pass (`rerun_copy`),
so the first layers' are held through every later layer's forward and backward passes. The pass
tries each forward pass whose results a backward pass reads, in forward order, and keeps a
second run where the step as TensorFlow runs it (after Grappler, with the calls'
loops: `analysis.as_run`) needs less memory, and by a larger share than the share of time the
second run adds (`AsRun.better`): the last layer's values are read as soon as they are made,
so running it again saves nothing and costs a forward pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..analysis import loops
from ..analysis import step as analysis_mod
from ..analysis.split import backward_functions
from ..analysis.step import Analysis
from ..core.graph import Graph
from ..planning import devices
from . import rerun_copy as rerun
from .base import PassOptions, PassResult

__all__ = ["GAIN", "AsRun", "RerunOptions", "RerunResult", "as_run", "run"]

log = logging.getLogger(__name__)

GAIN = 0.02  # a second run must lower the modelled peak by this fraction to be kept


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
    graph_def = graph.to_graph_def()
    best = as_run(model, graph, analysis)
    kept = []
    for forward, backward in pairs:
        if forward in kept:  # read by two backward passes: the first one's run stays alone
            continue
        trial = rerun.rerun(graph_def, forward, backward)
        cost = as_run(model, Graph.from_graph_def(trial), analysis)
        log.info("rerun %s before %s: as run %s -> %s", forward, backward, best, cost)
        if best is not None and best.better(cost):
            graph_def, best = trial, cost
            kept.append(forward)
    if not kept:
        return RerunResult(graph, False, note="no recurrent layer's forward pass, run again "
                           "before its backward pass, lowers the step's peak as run by more "
                           "than the share of time it adds")
    return RerunResult(Graph.from_graph_def(graph_def), True, rerun=kept)


@dataclass(frozen=True)
class AsRun:
    """A step as TensorFlow runs it: its allocator's peak, and its kernels' modelled time
    one after another (a loop's body as many times as it runs)."""

    peak: int
    seconds: float

    def better(self, trial: AsRun | None) -> bool:
        """`trial` lowers the peak by GAIN at least, and by a larger share than the share of
        time it adds. A second forward pass of a step that is one loop costs that loop again
        for what little of it is held: a hand-written GRU built outside the repo modelled 11%
        lower and 38% slower (measured 0.53x of the original's peak at 1.61x its time, 0.61x
        at 1.28x without it); stacked Keras GRUs measured 0.78x at 1.17x."""
        if trial is None or not self.peak:
            return False
        saved = 1 - trial.peak / self.peak
        slower = trial.seconds / self.seconds - 1 if self.seconds else 0.0
        return saved > GAIN and slower <= saved

    def __str__(self) -> str:
        return f"{self.peak} bytes, {self.seconds * 1000:.3f} ms"


def as_run(model, graph: Graph, found: Analysis) -> AsRun | None:
    """`graph`'s step as run (on the CPU's or the default device profile, as `found` models
    it); None where Grappler cannot run it."""
    step = analysis_mod.as_run_step(model, graph, found)
    if step is None:
        return None
    optimized, shapes, report = step
    profile = devices.profile("default" if report.accelerator else "cpu")
    times = devices.node_times(optimized, shapes, report.order, profile)
    runs = loops.runs_per_step(optimized, shapes)
    return AsRun(report.allocated_peak(),
                 sum(seconds * runs.get(name, 1) for name, seconds in times.items()))
