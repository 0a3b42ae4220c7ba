"""One byte budget over every lever a user allows (`optimize --budget B [--lossy]`).

Recomputation keeps the numbers; the chunked loss changes them to rounding, diet (16-bit
variables and a lean optimizer state) by more. Under a budget the recompute pass already buys
the least recomputation that reaches it; here the lossy levers join only when the lossless
rewrite cannot reach it, and then every combination is planned under the same budget and the
one of least modelled step time that meets it wins (the time: every node of the rewritten
step's schedule on the device profile, `devices.node_times`; recomputation, dequantization and
the loss's blocks are nodes there). Where none meets it, the lowest peak wins and the result
says so.

The budget is for the step as TensorFlow runs it (what `verify` measures: the predicted peak,
as run where modelled; a share is of the original's), while the passes plan on the step as
written. Where a rewrite reached the budget as written but not as run, it is planned once
more under the budget scaled by how far the two were apart (a transformer's as-run peak was
13% over its as-written one); where it did not reach it even as written, once more without a
budget (the plan of lowest peak as written ran 23% higher than the default plan on that
transformer). The lower of the two as run is kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..analysis.step import AnalysisOptions
from ..core.io import Model
from ..planning import devices
from ..planning.budget import parse_budget
from .grammar import LOSSY_LEVERS
from .run import OptimizeResult, optimize

__all__ = ["LEVER_SETS", "step_seconds", "fit"]

log = logging.getLogger(__name__)

# The lossy levers' combinations, tried after the lossless rewrite (the empty set).
LEVER_SETS = ((), *((lever,) for lever in LOSSY_LEVERS), LOSSY_LEVERS)


def step_seconds(graph, analysis, profile: devices.DeviceProfile) -> float:
    """A step's modelled time on `profile`: its schedule's nodes one after another."""
    return sum(devices.node_times(graph, analysis.shapes, analysis.memory.order,
                                  profile).values())


def fit(model: Model, mode: str, analysis: AnalysisOptions | None, budget: str,
        profile: str = "default", as_run: bool = True,
        progress: Callable[[str], None] | None = None, lossy: bool = False,
        **options) -> OptimizeResult:
    """Mode `mode` under `budget`: with `lossy`, the lever set of least modelled step time
    whose rewrite meets the budget (the lossless one if it does), else the lowest peak;
    without, the lossless rewrite alone. `options` are `compose`'s. The result's `levers`
    lists each set tried."""
    start = time.perf_counter()
    device = devices.profile(profile)
    stage = progress or (lambda text: None)
    rows, best, target, original = [], None, None, None
    for levers in LEVER_SETS if lossy else LEVER_SETS[:1]:
        stage(f"planning under the budget with {' + '.join(('recompute', *levers))}")
        result = optimize(model, mode, analysis, as_run=as_run, budget=budget,
                          lossy=levers or False, **options)
        if target is None:  # the budget for the step as run, of the original's peak
            target = parse_budget(budget, result.predicted_peaks[0])
            original = step_seconds(model.graph, result.analyses[0], device)
        predicted = result.predicted_peaks[1]
        if predicted > target:
            # within it as written, not as run: again under the budget scaled; out of reach
            # as written: the plan of lowest peak for little more compute (no budget), which
            # can run lower than the one of lowest peak as written
            inner = (str(max(1, int(result.peak_after * target / predicted)))
                     if result.budget_met else None)
            stage(f"planning again under {inner or 'no budget'}")
            again = optimize(model, mode, analysis, as_run=as_run, budget=inner,
                             lossy=levers or False, **options)
            result = min((result, again), key=lambda r: r.predicted_peaks[1])
        seconds = step_seconds(result.graph, result.analyses[1], device)
        row = {"levers": list(levers), "peak_bytes": result.predicted_peaks[1],
               "budget_met": result.predicted_peaks[1] <= target,
               "step_seconds": round(seconds, 6),
               "step_time": round(seconds / original, 3) if original else None}
        rows.append(row)
        if best is None or _rank(row) < _rank(best[0]):
            best = (row, result)  # only the best result is held: each holds a whole graph
        if not levers and row["budget_met"]:
            break  # the lossless rewrite reaches it: nothing lossy is used
    log.info("levers: %s", ", ".join(f"{'+'.join(row['levers']) or 'lossless'} "
                                      f"{row['peak_bytes']} bytes {row['step_seconds']} s"
                                      for row in rows))
    for row in rows:
        row["chosen"] = row is best[0]
    final = best[1]
    final.levers, final.budget, final.budget_of = rows, target, "predicted"
    final.seconds = time.perf_counter() - start  # every set planned, not the chosen one's
    return final


def _rank(row: dict) -> tuple:
    """Sets that meet the budget first, the fastest of them; else the lowest peak."""
    if row["budget_met"]:
        return (0, row["step_seconds"], row["peak_bytes"])
    return (1, row["peak_bytes"], row["step_seconds"])
