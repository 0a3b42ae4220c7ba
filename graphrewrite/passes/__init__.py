"""Rewrite passes, one per module. Each is `run(graph, analysis, options, model) -> PassResult`
and registered here by name with the frozen dataclass of its options (see `base`)."""

from __future__ import annotations

from . import accumulate, defer, diet, inline, recompute, relax_assign, rerun, swap
from .base import PassResult  # noqa: F401  (the type every pass returns)

PASSES = {
    "recompute": (recompute.RecomputeOptions, recompute.run),
    "swap": (swap.SwapOptions, swap.run),
    "accumulate": (accumulate.AccumulateOptions, accumulate.run),
    "relax_assign": (relax_assign.RelaxAssignOptions, relax_assign.run),
    "defer": (defer.DeferOptions, defer.run),
    "inline": (inline.InlineOptions, inline.run),
    "rerun": (rerun.RerunOptions, rerun.run),
    "diet": (diet.DietOptions, diet.run),
}
