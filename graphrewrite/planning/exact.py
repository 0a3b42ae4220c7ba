"""The optimal single-level recompute plan over the bottleneck chain, under the plan estimate
(`estimate.py`): `--planner exact`, and the reference the tests hold the default planner to
(issue 15). For graphs of a few hundred nodes; NODE_LIMIT refuses larger ones.

A plan keeps some of the chain's bottlenecks (`checkpoints.bottlenecks`). Between two kept ones
that follow each other (or the input and the first, or the last and the loss) a segment
recomputes what the gradient flow reads there, with its ancestors up to the two. The model is the
estimate split by segment: the memory at schedule step t is the original's plus each chosen
segment's change at t, each segment priced by the estimator alone, and the extra FLOPs are the
segments' sum. That split is exact while no recomputed node or buffer serves two segments (a
bottleneck dominates the loss, so only values that do not depend on the input, such as a mask
built from labels, could be shared). `check_additive` compares it with the estimate of whole
plans: equal at every step, for every subset of the chain, on every fixture and generated graph
`tests/test_exact.py` tries; `plan` prices its answer on the whole plan again. Two-level plans
(checkpoints recomputed ahead) are not in the model.

The MILP: a binary y_ab for every segment (a before b on the chain, with a virtual start and
end), one unit of flow from start to end through the kept bottlenecks, and for every step t
original(t) + sum_ab y_ab * delta_ab(t) <= P (steps the segments change alike share one row).
It minimises the recomputed FLOPs under a given P (a budget), or P first and then the FLOPs at
that P. Segments are quadratic in the chain's length, rows linear in the schedule's.

Solver: HiGHS through `highspy`: MIT licence, a 5 MB wheel needing only numpy, maintained by the
HiGHS team (SciPy's MILP solver is HiGHS too), and exact at a relative gap of 0. It is an
optional extra (`pip install 'graphrewrite[exact]'`): only this planner needs it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np

from ..core.errors import GraphRewriteError
from . import checkpoints as policies
from . import plan_nodes, search
from .context import Context
from .estimate import PlanEstimator

__all__ = ["NODE_LIMIT", "TIME_LIMIT", "KIB", "ChainModel", "Solution", "build", "whole",
           "check_additive", "solve", "plan"]

log = logging.getLogger(__name__)

# Segments grow with the chain's length squared and the MILP faster: generated residual MLPs
# (BENCHMARKS.md) take 10 s at 297 nodes (33 bottlenecks), 40 s at 460, 9 min at 918.
NODE_LIMIT = 1000
TIME_LIMIT = 600.0  # seconds HiGHS may take; an answer not proved optimal is refused
KIB = 1024  # bytes are given to the solver in KiB: rows near 1e5, far above its tolerances


@dataclass
class ChainModel:
    """The plan estimate split by segment. Vertex 0 is the start, vertex i the chain's i-th
    bottleneck (from 1), vertex len(chain) + 1 the end; `arcs` are the segments (i, j), i < j."""

    chain: list[str]
    arcs: list[tuple[int, int]]
    nodes: list[frozenset]    # per arc: what it recomputes
    flops: np.ndarray         # per arc: its recomputed FLOPs
    base: np.ndarray          # per step: the original's estimated bytes
    steps: list[np.ndarray]   # per arc: the steps where it changes the bytes
    deltas: list[np.ndarray]  # per arc: the change at those steps

    def path(self, kept) -> list[int]:
        """The arcs of the plan that keeps the bottlenecks `kept` (others are ignored)."""
        vertices = [0] + [i + 1 for i, n in enumerate(self.chain) if n in kept] + [
            len(self.chain) + 1]
        index = {arc: k for k, arc in enumerate(self.arcs)}
        return [index[arc] for arc in zip(vertices, vertices[1:])]

    def curve(self, kept) -> np.ndarray:
        """The bytes per step the split model gives the plan keeping `kept`."""
        out = self.base.copy()
        for k in self.path(kept):
            out[self.steps[k]] += self.deltas[k]
        return out

    def kept(self, arcs) -> set[str]:
        """The bottlenecks a path of arcs keeps."""
        return {self.chain[j - 1] for _, j in (self.arcs[k] for k in arcs)
                if j <= len(self.chain)}


@dataclass
class Solution:
    checkpoints: set[str]
    peak: int    # the split model's, which `plan` checks on the whole plan
    flops: int


def build(ctx: Context, estimator: PlanEstimator | None = None) -> ChainModel:
    """Price every segment of the chain alone: what it recomputes, its FLOPs and its change to
    the estimated bytes per step."""
    estimator = estimator or PlanEstimator(ctx.graph, ctx.analysis)
    chain = policies.bottlenecks(ctx)
    position = {n: i for i, n in enumerate(ctx.order())}
    at = [-1] + [position[n] for n in chain] + [len(position)]
    base = estimator.estimate([]).curve
    arcs, nodes, flops, steps, deltas = [], [], [], [], []
    for i in range(len(at)):
        for j in range(i + 1, len(at)):
            kept = {chain[k - 1] for k in (i, j) if 0 < k <= len(chain)}
            between = _segment(ctx, kept, at[i], at[j], position)
            change = estimator.estimate(plan_nodes.segments(ctx, between)).curve - base
            moved = np.flatnonzero(change)
            arcs.append((i, j))
            nodes.append(frozenset(between))
            flops.append(ctx.flops(between))
            steps.append(moved)
            deltas.append(change[moved])
    return ChainModel(chain, arcs, nodes, np.array(flops, dtype=np.int64), base, steps, deltas)


def _segment(ctx: Context, kept: set[str], low: int, high: int, position) -> set[str]:
    """What keeping `kept` recomputes strictly between positions `low` and `high`, with its
    recomputed ancestors (those before `low` do not depend on the input: none pass a kept
    bottleneck)."""
    recomputed, _ = plan_nodes.recomputed_nodes(ctx, kept, {})
    return plan_nodes.with_ancestors(
        ctx, [n for n in recomputed if low < position[n] < high], recomputed.__contains__)


def whole(ctx: Context, estimator: PlanEstimator, kept) -> tuple[np.ndarray, int, set[str]]:
    """The estimate planner's price of the plan keeping `kept` (`search.estimate`): bytes
    per step, recomputed FLOPs and the recomputed nodes."""
    found = search.estimate(estimator, ctx, set(kept))
    curve = estimator.estimate(plan_nodes.segments(ctx, set(found.recomputed))).curve
    return curve, found.extra_flops, set(found.recomputed)


def check_additive(ctx: Context, estimator: PlanEstimator, model: ChainModel, kept) -> list[str]:
    """How the split model deviates from the whole plan's estimate, in words (empty: it
    does not)."""
    problems = []
    path = model.path(kept)
    parts = [model.nodes[k] for k in path]
    actual, flops, recomputed = whole(ctx, estimator, kept)
    union = frozenset().union(*parts)
    if union != recomputed:
        problems.append(f"segments recompute {len(union ^ recomputed)} nodes the plan does not "
                        "or the other way round")
    if sum(len(p) for p in parts) != len(union):
        problems.append("segments share recomputed nodes")
    split = model.curve(kept)
    if not np.array_equal(actual, split):
        steps = np.flatnonzero(actual != split)
        problems.append(f"bytes differ at {len(steps)} steps (most {int(abs(actual - split).max())}"
                        f"; peaks {int(actual.max())} whole, {int(split.max())} split)")
    if flops != int(model.flops[path].sum()):
        problems.append(f"FLOPs differ: {flops} whole, {int(model.flops[path].sum())} split")
    return problems


def solve(model: ChainModel, limit: int | None = None) -> Solution | None:
    """The least recomputed FLOPs whose split-model peak is at most `limit` bytes (None when
    no plan is), or without a limit the lowest peak and then the least FLOPs at it."""
    if limit is None:
        lowest = _solve(model, None)
        return _solve(model, lowest.peak) if lowest else None
    return _solve(model, limit)


def _solve(model: ChainModel, limit: int | None) -> Solution | None:
    highspy = _highspy()
    arcs, last = model.arcs, len(model.chain) + 1
    n = len(arcs)
    columns = [[] for _ in range(n + 1)]  # per arc, then the peak P: (row, coefficient)
    rows_low, rows_high = [], []
    for v in range(last + 1):  # flow: out - in = 1 at the start, -1 at the end, else 0
        row = len(rows_low)
        for k, (i, j) in enumerate(arcs):
            if i == v:
                columns[k].append((row, 1.0))
            elif j == v:
                columns[k].append((row, -1.0))
        need = 1.0 if v == 0 else -1.0 if v == last else 0.0
        rows_low.append(need)
        rows_high.append(need)
    touched = np.unique(np.concatenate(model.steps)) if n else np.array([], dtype=np.int64)
    untouched = np.setdiff1d(np.arange(len(model.base)), touched)
    floor = int(model.base[untouched].max()) if len(untouched) else 0  # no plan changes those
    if limit is not None and floor > limit:
        return None
    # Steps the segments change alike need one row, at the most bytes the original has there.
    pattern: dict[int, list] = {int(t): [] for t in touched}
    for k in range(n):
        for t, d in zip(model.steps[k], model.deltas[k]):
            pattern[int(t)].append((k, int(d)))
    highest: dict[tuple, int] = {}
    for t, terms in pattern.items():
        key = tuple(terms)
        highest[key] = max(highest.get(key, -1), int(model.base[t]))
    for terms, original in highest.items():
        row = len(rows_low)
        rows_low.append(-np.inf)
        if limit is None:  # sum y delta - P <= -original(t)
            columns[n].append((row, -1.0))
            rows_high.append(-original / KIB)
        else:  # half a byte of room: the byte counts are whole, the solver's are not
            rows_high.append((limit - original + 0.5) / KIB)
        for k, d in terms:
            columns[k].append((row, d / KIB))
    scale = max(int(model.flops.max()) if n else 0, 1)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n + 1, len(rows_low)
    if limit is None:
        lp.col_cost_ = np.array([0.0] * n + [1.0])
        lp.col_lower_ = np.array([0.0] * n + [floor / KIB])
        lp.col_upper_ = np.array([1.0] * n + [np.inf])
    else:  # FLOPs scaled to at most 1 a segment; P fixed at 0, unused
        lp.col_cost_ = np.append(model.flops / scale, 0.0)
        lp.col_lower_ = np.zeros(n + 1)
        lp.col_upper_ = np.append(np.ones(n), 0.0)
    lp.row_lower_, lp.row_upper_ = np.array(rows_low), np.array(rows_high)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    starts, index, value = [0], [], []
    for column in columns:
        index += [r for r, _ in column]
        value += [c for _, c in column]
        starts.append(len(index))
    lp.a_matrix_.start_, lp.a_matrix_.index_ = np.array(starts), np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n + [highspy.HighsVarType.kContinuous]
    with _quiet_stdout():  # HiGHS prints its banner on making its first solver
        solver = highspy.Highs()
        for option, setting in (("output_flag", False), ("mip_rel_gap", 0.0),
                                ("mip_abs_gap", 0.0), ("time_limit", TIME_LIMIT),
                                ("random_seed", 0)):
            solver.setOptionValue(option, setting)
        solver.passModel(lp)
        solver.run()
    status = solver.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None
    if status != highspy.HighsModelStatus.kOptimal:
        raise GraphRewriteError(f"planner exact: HiGHS stopped without an optimal plan "
                                f"({solver.modelStatusToString(status)}); use ${{planner}} "
                                "estimate")
    chosen = [k for k, y in enumerate(solver.getSolution().col_value[:n]) if y > 0.5]
    kept = model.kept(chosen)
    if sorted(chosen) != sorted(model.path(kept)):
        raise GraphRewriteError("planner exact: HiGHS returned no path through the chain")
    peak = int(model.curve(kept).max())
    if limit is not None and peak > limit:  # rounding the solver's answer broke its rows
        raise GraphRewriteError(f"planner exact: HiGHS's plan models {peak} bytes, over "
                                f"{limit}")
    return Solution(kept, peak, int(model.flops[chosen].sum()))


@contextlib.contextmanager
def _quiet_stdout():
    """File descriptor 1 sent to /dev/null: HiGHS writes its banner from C++, before any option
    can silence it, onto the stdout that `--json` keeps for the report alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _highspy():
    try:
        import highspy
    except ImportError:
        raise GraphRewriteError("planner exact needs the HiGHS solver: pip install "
                                "'graphrewrite[exact]'") from None
    return highspy


def plan(ctx: Context, budget: int = 0) -> tuple[set[str], str]:
    """The checkpoints `--planner exact` keeps: with a budget the least recomputation whose
    estimated peak is within it (else the lowest peak, and a note), without one the lowest
    peak and the least recomputation at it. Returns them and a note."""
    nodes = len(ctx.graph)
    if nodes > NODE_LIMIT:
        raise GraphRewriteError(f"planner exact: {nodes} nodes is over its limit of "
                                f"{NODE_LIMIT}; use ${{planner}} estimate")
    _highspy()
    estimator = PlanEstimator(ctx.graph, ctx.analysis)
    model = build(ctx, estimator)
    note = ""
    found = solve(model, budget) if budget else None
    if budget and found is None:
        found = solve(model)
        note = (f"budget of {budget / 2**20:.1f} MiB not reached: the lowest estimated peak "
                f"is {found.peak / 2**20:.1f} MiB")
    elif not budget:
        found = solve(model)
    actual, _, _ = whole(ctx, estimator, found.checkpoints)
    if int(actual.max()) != found.peak:
        log.warning("recompute: the exact plan's estimate is %d bytes, its split model's %d: "
                    "segments interact (exact.check_additive says how)", int(actual.max()),
                    found.peak)
    log.info("recompute: exact plan keeps %d of %d bottlenecks: estimated peak %d bytes, %d "
             "extra FLOPs", len(found.checkpoints), len(model.chain), found.peak, found.flops)
    # An input or a constant kept or not is the same plan: the report lists what was chosen.
    return {n for n in found.checkpoints if ctx.blocker(n) is None}, note
