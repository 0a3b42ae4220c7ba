"""The trade-off curve: modelled peak against extra step time over memory budgets, so a budget
is chosen from data (`optimize --tradeoff FILE`).

Mode memory runs once without a budget (the lowest peak it finds) and then at budgets spread
evenly between the original's peak and that lowest one; each point is the rewrite's modelled
peak (as written: what the passes plan on), its recomputed FLOPs and their time on a device
profile (`planning.devices`, FP32), and its plan (`pipeline.plan`: `optimize --plan` replays it
to the same peak). With the exact planner available and the graph small enough
(`planning.exact.NODE_LIMIT`), its points at the same budgets are there too: how far the
default planner is from the least recomputation at each peak.

With the lossy levers allowed (`optimize --tradeoff FILE --lossy`) a third list follows every
lever `optimize --budget B --lossy` may take (`pipeline.levers.fit`: recomputation, the chunked
loss, diet; swapping on a named device with a host): the step as TensorFlow runs it, at budgets
from the original's peak down to the lowest any set of levers reaches, each point with the
levers chosen, the modelled step time on the profile (every node of the rewritten step, so
dequantization and the loss's blocks count) and its plan, which `--plan` replays.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

from ..analysis.step import AnalysisOptions
from ..core.errors import GraphRewriteError
from ..core.io import Model
from ..planning import devices
from . import plan as plan_mod
from .run import optimize

__all__ = ["POINTS", "curve", "lever_points"]

log = logging.getLogger(__name__)

POINTS = 6  # budgets between the original's peak and the lowest found


def curve(model: Model, points: int = POINTS, profile: str = "default",
          progress: Callable[[str], None] | None = None,
          analysis: AnalysisOptions | None = None, lossy: bool = False,
          device_profile: str | None = None, as_run: bool = True) -> dict:
    """The curve's plain data: the original's modelled peak (as written) and, per planner,
    points of {budget, peak_bytes, modelled ("as written"), budget_met (null without a
    budget: the lowest point; an exact point may miss its budget where no plan meets it),
    extra_flops, extra_seconds, plan}, highest peak first; the step analysed as `analysis`
    says. `lossy`: also `lever_points` under "levers", on the device
    `device_profile` names (as `levers.fit` takes it)."""
    stage = progress or (lambda text: None)
    rate = devices.profile(profile).fp32_flops

    original = 0

    def point(planner: str, budget: int | None) -> dict | None:
        nonlocal original
        stage(f"planner {planner}, budget {'none' if budget is None else budget}")
        try:
            result = optimize(model, "memory", analysis, as_run=False, planner=planner,
                              budget=None if budget is None else str(budget))
        except GraphRewriteError as err:  # the exact planner's own limits
            log.info("tradeoff: planner %s at budget %s: %s", planner, budget, err)
            return None
        original = result.peak_before
        flops = sum(getattr(r, "extra_flops", 0) for r in result.results.values())
        return {"budget": budget, "peak_bytes": result.peak_after, "modelled": "as written",
                "budget_met": None if budget is None else result.peak_after <= budget,
                "extra_flops": flops, "extra_seconds": flops / rate, "modified": result.changed,
                "plan": plan_mod.plan_of(result, model.graph)}

    lowest = point("estimate", None)
    budgets = _between(original, lowest["peak_bytes"], points)
    found = {"original_peak_bytes": original, "profile": profile,
             "estimate": [p for b in budgets if (p := point("estimate", b))] + [lowest]}
    from ..planning import exact

    if importlib.util.find_spec("highspy") and len(model.graph) <= exact.NODE_LIMIT:
        found["exact"] = [p for b in budgets if (p := point("exact", b))]
    else:
        log.info("tradeoff: no exact planner's points (highspy missing or graph over %d nodes)",
                 exact.NODE_LIMIT)
    if lossy:
        found["levers"] = lever_points(model, points, device_profile, stage, analysis, as_run)
    return found


def lever_points(model: Model, points: int, profile: str | None,
                 progress: Callable[[str], None], analysis: AnalysisOptions | None = None,
                 as_run: bool = True) -> list[dict]:
    """Points of {budget, peak_bytes, modelled (as run, unless `as_run` is false), budget_met,
    levers, step_time, extra_seconds, plan}: `levers.fit` with every lever allowed, first
    under a budget of one byte (the lowest peak any set reaches, the least lossy near it), then
    at `points` budgets evenly between the original's peak and that one; highest budget first,
    the lowest last (budget None). Budgets and peaks are of the step as run; a plan's pipeline
    holds the budget recomputation planned to, which is of the step as written."""
    from .levers import fit, label, original_seconds

    device = devices.profile(profile or "default")
    original = {}

    def point(budget: int | None) -> dict:
        progress(f"all levers, budget {'as low as any reaches' if budget is None else budget}")
        result = fit(model, "memory", analysis, "1" if budget is None else str(budget),
                     profile, as_run=as_run, lossy=True)
        if not original:
            original.update(peak=result.predicted_peaks[0],
                            seconds=original_seconds(model, result.analyses[0], device))
        row = next(row for row in result.levers if row["chosen"])
        return {"budget": budget, "peak_bytes": result.predicted_peaks[1],
                "modelled": "as run" if as_run else "as written",
                "budget_met": None if budget is None else row["budget_met"], "levers": label(row),
                "step_time": row["step_time"],
                "extra_seconds": round(row["step_seconds"] - original["seconds"], 6),
                "modified": result.changed, "plan": plan_mod.plan_of(result, model.graph)}

    lowest = point(None)
    budgets = _between(original["peak"], lowest["peak_bytes"], points)
    return [point(budget) for budget in budgets] + [lowest]


def _between(high: int, low: int, points: int) -> list[int]:
    """`points` budgets spread evenly between `high` and `low` (neither), highest first."""
    return sorted({int(high - (high - low) * k / (points + 1)) for k in range(1, points + 1)},
                  reverse=True)
