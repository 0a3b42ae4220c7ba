"""A rewrite tried on the step as TensorFlow runs it: kept where it lowers the peak by more
than the share of time it adds.

The loop passes and `tails_first` change what the planner cannot see as written (a loop's
values, the order Grappler and the executor give the step), so each try is priced on the step
as run (`analysis.as_run`: after Grappler, with the calls' loops): the allocator's peak, and
the kernels' modelled time one after another on the CPU's or the default device profile, a
loop's body as many times as it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..analysis import loops
from ..analysis import step as analysis_mod
from ..analysis.step import Analysis
from ..core.graph import Graph
from . import devices

_State = TypeVar("_State")
_Try = TypeVar("_Try")

__all__ = ["GAIN", "AsRun", "as_run", "keep_better"]

GAIN = 0.02  # a try must lower the modelled peak by this fraction to be kept


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


def keep_better(tries: Sequence[_Try], state: _State, best: AsRun | None,
                attempt: Callable[[_State, _Try], tuple[_State, AsRun | None] | None]
                ) -> tuple[_State, list[_Try]]:
    """Make each try on `state` in turn and keep it where `best.better` its step; then the
    refused again, while a sweep keeps one: two tries may pay only together (a bidirectional
    layer's two directions, each alone saving less than its time). `attempt` gives the tried
    state and its step as run, or None where the try cannot be made on this state."""
    kept: list[_Try] = []
    while tries and best is not None:
        refused = []
        for one in tries:
            trial = attempt(state, one)
            if trial is not None and best.better(trial[1]):
                state, best = trial[0], trial[1]
                kept.append(one)
            elif trial is not None:
                refused.append(one)
        tries = refused if len(refused) < len(tries) else []
    return state, kept
