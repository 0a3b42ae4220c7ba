"""One byte budget over every lever a user allows (`optimize --budget B --lossy`).

Recomputation keeps the numbers; the chunked loss changes them to rounding, diet (16-bit
variables and a lean optimizer state) by more. Under a budget the recompute pass already buys
the least recomputation that reaches it; here the lossy levers join only when the lossless
rewrite cannot reach it, and then every combination is planned under the same budget and the
one of least modelled step time that meets it wins (the time: every node of the rewritten
step's schedule on the device profile, `devices.node_times`; recomputation, dequantization and
the loss's blocks are nodes there). Where none meets it, the lowest peak wins and the result
says so. Each combination is a whole pipeline planned on the step as written; the chosen one
is run once more as the caller asked (the as-run model, the fusion check), so its report and
plan file are those of a plain `optimize`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..analysis.step import AnalysisOptions
from ..core.io import Model
from ..planning import devices
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
        progress: Callable[[str], None] | None = None, **options) -> OptimizeResult:
    """Mode `mode` under `budget` with the lossy levers allowed: the lever set of least
    modelled step time whose rewrite meets the budget (the lossless one if it does), else the
    lowest peak; `options` are `compose`'s. The result's `levers` lists each set tried."""
    device = devices.profile(profile)
    stage = progress or (lambda text: None)
    tried = []
    for levers in LEVER_SETS:
        stage(f"planning under the budget with {' + '.join(('recompute', *levers))}")
        result = optimize(model, mode, analysis, as_run=False, budget=budget,
                          lossy=levers or False, **options)
        tried.append((levers, result))
        if not levers and result.budget_met:
            break  # the lossless rewrite reaches it: nothing lossy is used
    seconds = {levers: step_seconds(result.graph, result.analyses[1], device) for levers, result in tried}
    met = [levers for levers, result in tried if result.budget_met]
    peaks = {levers: result.peak_after for levers, result in tried}
    chosen = (min(met, key=lambda levers: (seconds[levers], peaks[levers])) if met
              else min(peaks, key=lambda levers: (peaks[levers], seconds[levers])))
    log.info("levers: %s", ", ".join(f"{'+'.join(levers) or 'lossless'} {peaks[levers]} "
                                      f"bytes {seconds[levers]:.4f} s" for levers, _ in tried))
    final = optimize(model, mode, analysis, as_run=as_run, progress=progress, budget=budget,
                     lossy=chosen or False, **options)
    original = step_seconds(model.graph, final.analyses[0], device)
    final.levers = [{"levers": list(levers), "peak_bytes": peaks[levers],
                     "budget_met": bool(result.budget_met),
                     "step_seconds": round(seconds[levers], 6),
                     "step_time": round(seconds[levers] / original, 3) if original else None,
                     "chosen": levers == chosen}
                    for levers, result in tried]
    return final
