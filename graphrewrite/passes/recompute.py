"""Recompute pass: keep checkpoints, recompute the rest of what the backward pass reads.

For each forward node the gradient flow reads that is not a checkpoint, the pass copies it and
everything between it and the checkpoints above it (each node once), and rewires only the
gradient-flow consumers to the copies; forward consumers, and backward nodes that run during the
forward pass (shape computations), keep the originals, which are then freed early. A node the flow
reads only tiny side outputs of (a batch norm's batch statistics) is not copied: those are read
from the original. Copies are grouped into connected segments; each segment's root copies wait on a
trigger NoOp whose control inputs are the gradient-flow nodes feeding the segment's consumers, so
the recomputation runs when back-propagation reaches the segment. A backward shape reader
(`ShapeN` of a convolution's input) with control inputs reads the copy too: it needs no value,
but it holds the original's buffer until it runs, and a TF1 optimizer's `minimize` under
`control_dependencies(model.updates)` makes it wait for every batch-norm update, the end of the
forward pass. Without control inputs it runs as soon as the original exists and keeps it: read
from the copy, it would hold the input gradient back until the recomputation. What each trigger
waits on, and how that is found without walking the graph once per segment: `triggers.py`.

A copy reading a parameter computed from resource reads (the diet pass's dequantized weight)
reads a copy of it, which waits for the copies of what the original waits for
(`_mirror_waits`): the weight is dequantized again when its layer is recomputed, instead of
its float32 form being held from the forward pass.

In memory mode the first few checkpoints may be recomputed ahead (`_recompute_ahead`): copied
too, and computed when back-propagation reaches the first segment reading them, rather than held
from the forward pass; tried for the first of the chosen checkpoints and for the two-level
spreads of `checkpoints.two_level`. A two-level plan that lowers the peak enough but costs too
much is tried once more with `reuse`: the segment back-propagation reaches first among those
the ahead pass covers reads the ahead pass's values instead of computing them a third time
(`_reuse_ahead`).

Originals that lost backward readers, and copies that got only some of their original's
readers, are given fan-out pads (see `pads.py`), so Grappler rewrites them as it would the
originals and every output stays bitwise equal.

Copies are named `<original>-graphrewrite_recompute` (`<original>-graphrewrite_recompute_ahead`
when computed ahead: a suffix, so Grappler orders a copy's operands by name as it ordered the
original's), triggers
`graphrewrite/recompute_trigger/<first root>`, pads `graphrewrite/pad/<node>`. Original
nodes are never removed or renamed.
"""

from __future__ import annotations

import gc
import logging
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import networkx as nx

from .. import checkpoints as policies
from .. import memory
from ..analysis import Analysis
from ..context import Context
from ..estimate import PlanEstimator
from ..budget import parse_budget
from ..errors import GraphRewriteError
from ..graph import Graph
from ..names import AHEAD_SUFFIX, COPY_SUFFIX
from ..peak import why_so_little
from ..selectors import select
from ..shapes import Shapes
from ..split import reachable
from ..tensor_ref import TensorRef
from .base import PassOptions, RecomputeResult
from .pads import pad_readers
from .triggers import add_triggers

log = logging.getLogger(__name__)

MIN_GAIN = 0.01    # a rewrite that models less than 1% lower peak is not worth its compute
SMALL_GAIN = 0.05  # under this, the report says what holds the peak
PEAK_SLACK = 0.02  # peaks this close count as equal; then less recomputation wins
REFINE_ROUNDS, REFINE_TRIES = 3, 4  # bounded local search after the candidate sweep
# Recomputing checkpoints ahead costs a forward pass over the early layers: only for 5% less
# peak, and for at most 15% of the step's FLOPs more than single-level recomputation (measured
# with steps timed in turns: deep MLP +13% FLOPs, step 1.35x; DenseNet-121 +13%, 1.19x-1.28x).
AHEAD_GAIN, AHEAD_FLOPS = 0.05, 0.15
REUSE_TRIES = 2  # two-level plans low enough but too dear, tried again with `_reuse_ahead`
SIDE_OUTPUT_RATIO = 16  # outputs this many times smaller than their node's largest are held
PLANNERS = ("estimate", "search", "exact")  # exact: `exact.py`, an optional extra
# Planner estimate: plans applied and simulated from the first stage, and from each later one.
FINALISTS, STAGE_FINALISTS = 4, 2
# Once the estimate has matched the simulated peak this closely on this many plans of a graph,
# later stages take it as the simulation (see `Pricer`). One is not enough: a MetaGraphDef's
# first finalist can match while later plans are a few percent off (a small ResNet with Adam
# then kept 2 MiB more, its plan checked correct at the end).
TRUST_ERROR, TRUST_AFTER = 0.001, 2  # the best two of the first stage's finalists
FREE_ROUNDS, FREE_TRIES, FREE_NODES = 3, 24, 2000  # `_add_free`: rounds, tries, graph size


@dataclass(frozen=True)
class RecomputeOptions(PassOptions):
    policy: str = "memory"          # memory | speed | collection | manual
    checkpoints: str | None = None  # selectors, for policy=collection
    ahead: str | None = None        # policy collection: checkpoints recomputed ahead (a plan's)
    budget: str | None = None       # policy memory: the least recomputation under this peak
    planner: str = "estimate"       # policy memory: estimate | search (see `run`)
    reuse: bool = False             # with ahead: the ahead pass serves a segment (`_reuse_ahead`)

    def __post_init__(self):
        if self.planner not in PLANNERS:
            raise GraphRewriteError(f"recompute: unknown planner '{self.planner}' (planners: "
                                    f"{', '.join(PLANNERS)})")
        if self.policy not in policies.POLICIES:
            raise GraphRewriteError(f"recompute: unknown policy '{self.policy}' (policies: "
                                    f"{', '.join(policies.POLICIES)})")
        if self.budget and self.policy != "memory":
            raise GraphRewriteError(f"recompute: a budget needs policy memory, not "
                                    f"'{self.policy}'")
        parse_budget(self.budget, 0)  # a malformed budget fails now, not when it is first used
        if self.ahead and self.policy != "collection":
            raise GraphRewriteError(f"recompute: 'ahead' needs policy collection, not "
                                    f"'{self.policy}'")
        if self.reuse and not self.ahead:
            raise GraphRewriteError("recompute: 'reuse' needs 'ahead'")

    def takes_budget(self) -> bool:
        return self.policy == "memory"


@dataclass
class Rewrite:
    """One applied choice of checkpoints and what it did."""

    graph: Graph
    checkpoints: set[str]
    recomputed: dict[str, str]       # original -> copy
    triggers: dict[str, list[str]]   # trigger -> its control inputs
    ungated: int                     # segments no safe trigger was found for
    blocked: dict[str, set[str]]     # reason -> nodes kept because they cannot be recomputed
    shapes: Shapes
    pads: int = 0                    # IdentityN readers restoring data-reader counts (see run)
    ahead: dict[str, str] = field(default_factory=dict)  # checkpoint (and its segment) -> copy
    ahead_checkpoints: frozenset = frozenset()  # the checkpoints `apply` was asked to recompute
    peak: int = 0
    extra_flops: int = 0
    live_at_peak: set = field(default_factory=set)
    reuse: bool = False  # the ahead pass's values serve the first segment (`_reuse_ahead`)
    report: memory.MemoryReport | None = None  # the final graph's simulated step (`_finished`)


def run(graph: Graph, analysis: Analysis, options: RecomputeOptions, model=None):
    """Keep the policy's checkpoints and recompute the rest the backward pass reads.

    Every candidate checkpoint set is priced; the lowest peak wins (the cheapest recomputation
    among near-equal peaks). Planner `search` applies each candidate and simulates the rewritten
    step (a hundred rewrites and simulations of the whole graph); planner `estimate` (the
    default) prices them on the original's schedule (`estimate.py`, linear in what a plan
    recomputes) and applies and simulates only the best few of each stage (`Pricer`): the
    spreads, their fine-tuning, each round of dropping checkpoints, the two-level trials.
    Decisions between stages are taken on the simulated peaks, as `search` takes them, or on
    the estimates once they have matched (`Pricer`; the final graph's simulation checks them).
    Automatic policies leave the graph alone unless the modelled peak drops by MIN_GAIN. With a
    budget, policy memory takes the least recomputation (extra FLOPs) among all it tried whose
    peak is within it, two-level spreads included whatever their cost.
    """
    if not analysis.split.seeds:
        return RecomputeResult(graph, False, note="no backward pass found: nothing to do")
    ctx = Context.build(graph, analysis)
    if options.policy == "collection":
        candidates = policies.collection_policy(ctx, options.checkpoints,
                                                model.meta_graph if model else None)
    else:
        candidates = policies.POLICIES[options.policy](ctx)
    if not candidates:
        return RecomputeResult(graph, False, note="no checkpoint candidates found")
    budget = parse_budget(options.budget, analysis.memory.peak())
    if budget >= analysis.memory.peak():
        return RecomputeResult(graph, False, note=(
            "the modelled peak is already within the budget: nothing recomputed"))
    ahead = frozenset(select(graph, options.ahead)) if options.ahead else frozenset()
    note, pricer = "", None
    if options.policy == "memory" and options.planner == "exact":
        from .. import exact  # its solver is an optional extra: imported only when asked for
        chosen, note = exact.plan(ctx, budget)
        best = _evaluate(ctx, chosen)
    elif options.policy == "memory":
        pricer = Pricer(ctx, options.planner, budget)
        best, note = _memory_plan(ctx, candidates, budget, pricer)
    else:
        best = _choose([_evaluate(ctx, checkpoints, ahead, options.reuse)
                        for checkpoints in candidates])
    automatic = options.policy in ("memory", "speed")  # hints and selectors are obeyed as given
    unchanged = RecomputeResult(graph, False, note=(
        f"no checkpoint choice lowers the modelled peak by {MIN_GAIN:.0%} or more: nothing "
        "recomputed; " + why_so_little(ctx, analysis.memory)))
    if automatic and best.peak > analysis.memory.peak() * (1 - MIN_GAIN):
        return unchanged
    final = _finished(ctx, best)
    if pricer is not None and pricer.took_estimates and \
            abs(best.peak / max(final.report.peak(), 1) - 1) > TRUST_ERROR:
        log.info("recompute: the plan's estimated peak (%d bytes) is not its simulated one (%d): "
                 "planned again, every finalist simulated", best.peak, final.report.peak())
        best, note = _memory_plan(ctx, candidates, budget,
                                  Pricer(ctx, options.planner, budget, trust=False))
        if best.peak > analysis.memory.peak() * (1 - MIN_GAIN):
            return unchanged
        final = _finished(ctx, best)
    if automatic and final.report.peak() > analysis.memory.peak() * (1 - SMALL_GAIN):
        note = " ".join(filter(None, (note, f"it saves under {SMALL_GAIN:.0%}: "
                                      + why_so_little(ctx, final.report))))
    return _result(final, note)


def _memory_plan(ctx: Context, candidates: list[set[str]], budget: int,
                 pricer: Pricer) -> tuple[Rewrite, str]:
    """Policy memory's search: the candidates and the spreads near the best of them, refined,
    then recomputation ahead and two-level plans; the best plan and a note."""
    attempts = pricer.keep([pricer.score(c) for c in candidates], FINALISTS)
    attempts += pricer.keep([pricer.score(c) for c in policies.memory_policy(
        ctx, near=_choose(attempts).checkpoints)], STAGE_FINALISTS)
    best = _refine(ctx, _choose(attempts), attempts, pricer)
    best = _add_free(ctx, best, attempts, pricer)
    bases = [best] if pricer.estimator is None else _runners_up(attempts, best)
    trials = [t for base in bases for t in _ahead_trials(ctx, base, pricer)]
    trials += _two_level_trials(ctx, pricer)
    best, note = _decide(attempts, trials, budget, ctx.analysis.flops, ctx)
    if budget and best.peak <= budget:
        best, note = _within_budget([best, *_kept_whole(ctx, best, budget)], budget)
    return best, note


def _finished(ctx: Context, best: Rewrite) -> Rewrite:
    """The chosen plan applied again with the waits only a concurrent executor needs (the model
    runs one node at a time, and ranks the candidates as well without them) and the fan-out
    pads (they never run), and its step simulated: the check of a plan chosen on estimates, and
    the pipeline's model of the rewritten step."""
    final = _with_executor_gates(ctx, best)
    final.pads = pad_readers(final.graph, ctx.graph, ctx.analysis,
                             {c: o for o, c in [*final.recomputed.items(), *final.ahead.items()]})
    final.report = memory.simulate(final.graph, final.shapes, ctx.analysis.fetches)
    return final


def _runners_up(attempts: list[Rewrite], best: Rewrite, count: int = 3) -> list[Rewrite]:
    """`best` and the next plans of lowest simulated peak with other checkpoints: the estimate
    planner tries recomputing ahead on each (a plan a little above the best single-level one
    can be the better base for two-level recomputation)."""
    bases, seen = [best], {frozenset(best.checkpoints)}
    for attempt in sorted(attempts, key=lambda a: (a.peak, a.extra_flops)):
        if len(bases) < count and frozenset(attempt.checkpoints) not in seen:
            seen.add(frozenset(attempt.checkpoints))
            bases.append(attempt)
    return bases


def _decide(attempts: list[Rewrite], trials: list[Rewrite], budget: int,
            step_flops: int, ctx: Context) -> tuple[Rewrite, str]:
    """The best single-level plan, unless a two-level one (`trials`) lowers the peak by
    AHEAD_GAIN for at most AHEAD_FLOPS of the step's FLOPs more; with a budget, the least
    recomputation within it. A two-level plan low enough but too dear is tried once more
    with the ahead pass serving the segment back-propagation reaches first (`_reuse_ahead`,
    applied and simulated: the values it holds a little longer can raise the peak)."""
    if budget:
        return _within_budget([*attempts, *trials], budget)
    best = _choose(attempts)
    affordable = best.extra_flops + AHEAD_FLOPS * step_flops
    low = sorted((t for t in trials if t.peak <= best.peak * (1 - AHEAD_GAIN)),
                 key=lambda t: (t.peak, t.extra_flops))
    better = [t for t in low if t.extra_flops <= affordable]
    if not better:
        for trial in low[:REUSE_TRIES]:
            reused = _evaluate(ctx, trial.checkpoints, trial.ahead_checkpoints, reuse=True)
            if reused.reuse and reused.peak <= best.peak * (1 - AHEAD_GAIN) \
                    and reused.extra_flops <= affordable:
                better.append(reused)
    return (_choose(better) if better else best), ""


class Pricer:
    """Prices plans for policy memory's search. Planner `search`: `score` applies and simulates
    each plan, `keep` keeps them all. Planner `estimate`: `score` estimates (`estimate.py`),
    `keep` applies and simulates the `count` best of a stage's estimates: those of lowest peak
    (the cheapest first among near-equal ones) and, with a budget, the cheapest within it; it
    returns the plans not simulated before (the others are among the attempts already). Once
    the estimate has been within TRUST_ERROR of the simulated peak on the first TRUST_AFTER
    plans simulated (deep chains of like blocks: the rewrite barely moves the schedule), `keep`
    returns the rest of the finalists as estimated, from within the first stage on: the same
    choices for a fraction of the applies and simulations (the residual MLPs of 9k, 37k and 99k
    nodes: 6, 4 and 4 -> 2 each, rewrites byte-identical; ResNet-50's estimates are 0.1-4.3%
    off and it is simulated throughout). The plan chosen so is checked by the simulation of the
    final graph (`run`): should that miss its estimate, the search runs again without trust."""

    def __init__(self, ctx: Context, planner: str, budget: int, trust: bool = True):
        self.ctx, self.budget, self.trust = ctx, budget, trust
        self.estimator = PlanEstimator(ctx.graph, ctx.analysis) if planner == "estimate" else None
        self.evaluated: dict[tuple, Rewrite] = {}
        self.errors: list[float] = []  # |estimated / simulated - 1| of each plan simulated
        self.took_estimates = False  # some finalist was kept as estimated, not simulated

    def trusted(self) -> bool:
        return self.trust and len(self.errors) >= TRUST_AFTER and max(self.errors) <= TRUST_ERROR

    def score(self, checkpoints: set[str], ahead: frozenset = frozenset()) -> Rewrite:
        if self.estimator is None:
            return _evaluate(self.ctx, checkpoints, ahead)
        return _estimate(self.estimator, self.ctx, checkpoints, ahead)

    def keep(self, scored: list[Rewrite], count: int) -> list[Rewrite]:
        if self.estimator is None or not scored:
            return scored
        lowest = min(a.peak for a in scored)
        ranked = sorted(scored, key=lambda a: (max(a.peak, lowest * (1 + PEAK_SLACK)),
                                               a.extra_flops, a.peak))[:count]
        if self.budget:
            ranked += sorted((a for a in scored if a.peak <= self.budget),
                             key=lambda a: (a.extra_flops, a.peak))[:count]
        kept = []
        for plan in ranked:
            key = (frozenset(plan.checkpoints), plan.ahead_checkpoints)
            if key not in self.evaluated:
                if self.trusted():
                    self.evaluated[key] = plan
                    self.took_estimates = True
                else:
                    self.evaluated[key] = _evaluate(self.ctx, plan.checkpoints,
                                                    plan.ahead_checkpoints)
                    self.errors.append(abs(plan.peak / max(self.evaluated[key].peak, 1) - 1))
                kept.append(self.evaluated[key])
        return kept


def _with_executor_gates(ctx: Context, best: Rewrite) -> Rewrite:
    final = apply(ctx, best.checkpoints, best.ahead_checkpoints, executor_gates=True,
                  reuse=best.reuse)
    final.peak, final.extra_flops = best.peak, best.extra_flops
    final.live_at_peak = best.live_at_peak
    return final


def _estimate(estimator: PlanEstimator, ctx: Context, checkpoints: set[str],
              ahead: frozenset = frozenset()) -> Rewrite:
    """Price a checkpoint choice on the original's schedule (`estimate.py`), without applying
    it: a Rewrite with no graph."""
    blocked: dict[str, set[str]] = {}  # left empty: the chosen plan is applied again
    unchecked = _unchecked(ctx)
    removed = _removed(ctx, checkpoints)
    recomputed = unchecked.everything - removed  # `_recomputed_nodes`'s set (`_removed`)
    early = _ahead_members(ctx, ahead, _recomputable(ctx, checkpoints, blocked))
    groups = [(chain & ahead, {v for a in chain & ahead for v in ctx.graph.successors(a)
                               if v in recomputed})
              for chain in _segments(ctx, early)]
    found = estimator.estimate_recomputed(unchecked.everything, removed, groups)
    attempt = Rewrite(None, set(checkpoints), dict.fromkeys(recomputed, ""), {}, 0, blocked,
                      None, ahead=dict.fromkeys(early, ""), ahead_checkpoints=frozenset(ahead),
                      peak=found.peak, live_at_peak=found.live_at_peak)
    # the FLOPs of `recomputed` as those of `everything` (summed once) less `removed`'s
    attempt.extra_flops = unchecked.flops - ctx.flops(removed) + ctx.flops(early)
    log.debug("recompute: %d checkpoints -> estimated peak %d bytes, %d extra FLOPs",
              len(checkpoints), attempt.peak, attempt.extra_flops)
    return attempt


def _evaluate(ctx: Context, checkpoints: set[str],
              ahead: frozenset = frozenset(), reuse: bool = False) -> Rewrite:
    """Apply a checkpoint choice and model the rewritten step's peak and extra FLOPs."""
    analysis = ctx.analysis
    with _collector_paused():
        attempt = apply(ctx, checkpoints, ahead, reuse=reuse)
        report = memory.simulate(attempt.graph, attempt.shapes, analysis.fetches)
    attempt.peak = report.peak()
    attempt.live_at_peak = {ref.node for ref, _ in report.live_at_peak.get(memory.DEVICE, [])}
    attempt.extra_flops = ctx.flops([*attempt.recomputed, *attempt.ahead])
    attempt.graph.drop_views()  # no cycle left: the copy goes as soon as it is dropped
    attempt.graph = attempt.shapes = None  # the chosen plan is applied again (with its gates)
    log.info("recompute: %d checkpoints -> modelled peak %d bytes, %d extra FLOPs",
             len(checkpoints), attempt.peak, attempt.extra_flops)
    return attempt


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused for one evaluation: it allocates hundreds of
    thousands of small dicts and lists (the graph copy, the simulated buffers) that stay alive
    at least until it ends, and every automatic collection meanwhile would also walk the rest
    of the heap (TensorFlow's modules, the original graph). Collection resumes after;
    nothing is lost."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _choose(attempts: list[Rewrite]) -> Rewrite:
    """Within PEAK_SLACK of the lowest modelled peak, the cheapest recomputation wins."""
    lowest = min(a.peak for a in attempts)
    return min((a for a in attempts if a.peak <= lowest * (1 + PEAK_SLACK)),
               key=lambda a: (a.extra_flops, a.peak))


def _kept_whole(ctx: Context, base: Rewrite, budget: int) -> list[Rewrite]:
    """With a budget: plans that recompute less than `base` by keeping some of its segments
    whole (every value of the segment the backward pass reads is held, none recomputed), those
    whose recomputation costs the most FLOPs per byte held first; as many as keep the peak
    within the budget, found by bisection on simulated peaks (the estimate is least sure of
    plans that recompute little). Every plan the checkpoint spreads make recomputes nearly the
    whole forward pass, however low or high its peak: without these a budget could not buy
    back compute. Returns the plans simulated."""
    recomputed, _ = _recomputed_nodes(ctx, base.checkpoints, {})
    reads, shapes = ctx.flow_reads(), ctx.analysis.shapes
    cost = {}
    for segment in _segments(ctx, recomputed):
        held = sum(shapes.nbytes(r) or 0 for n in segment for r in reads.get(n, ()))
        cost[min(segment)] = (ctx.flops(segment) / max(held, 1), segment)
    ranked = [cost[k][1] for k in sorted(cost, key=lambda k: (-cost[k][0], k))]
    tried: dict[int, Rewrite] = {}

    def peak(count: int) -> int:
        if count not in tried:
            kept = set(base.checkpoints).union(*ranked[:count])
            tried[count] = _evaluate(ctx, kept, base.ahead_checkpoints)
        return tried[count].peak

    low, high = 0, len(ranked)  # the plan keeping `low` segments whole is within the budget
    while low < high:
        middle = (low + high + 1) // 2
        if peak(middle) <= budget:
            low = middle
        else:
            high = middle - 1
    return list(tried.values())


def _within_budget(attempts: list[Rewrite], budget: int) -> tuple[Rewrite, str]:
    """The least recomputation whose modelled peak is within `budget`; if none is, the lowest
    peak, and a note saying so."""
    within = [a for a in attempts if a.peak <= budget]
    if within:
        return min(within, key=lambda a: (a.extra_flops, a.peak)), ""
    lowest = min(attempts, key=lambda a: (a.peak, a.extra_flops))
    return lowest, (f"budget of {budget / 2**20:.1f} MiB not reached: the lowest modelled peak "
                    f"found is {lowest.peak / 2**20:.1f} MiB")


def _refine(ctx: Context, best: Rewrite, attempts: list[Rewrite], pricer: Pricer) -> Rewrite:
    """Drop checkpoints whose buffers are live at the modelled peak, one at a time, while the
    peak goes down: big early checkpoints can cost more than recomputing their segment."""
    for _ in range(REFINE_ROUNDS):
        sizes = {n: sum(ctx.analysis.shapes.nbytes(r) or 0 for r in
                        ctx.analysis.shapes.outputs(n)) for n in best.checkpoints}
        live = sorted((n for n in best.checkpoints if _owner_live(ctx, n, best.live_at_peak)),
                      key=lambda n: (-sizes[n], n))[:REFINE_TRIES]
        trials = pricer.keep([pricer.score(best.checkpoints - {n}) for n in live],
                             STAGE_FINALISTS)
        attempts.extend(trials)
        better = [t for t in trials if t.peak < best.peak * (1 - MIN_GAIN / 2)]
        if not better:
            break
        best = min(better, key=lambda t: (t.peak, t.extra_flops))
    return _choose([a for a in attempts if a.peak <= best.peak * (1 + PEAK_SLACK)] or [best])


def _add_free(ctx: Context, best: Rewrite, attempts: list[Rewrite], pricer: Pricer) -> Rewrite:
    """Bottlenecks added to `best` one at a time, each time the one that saves the most
    recomputation without raising the estimated peak: the spreads place checkpoints and
    refining only drops them, so one that costs nothing at the peak (the last layer before the
    loss, whose segment would otherwise be recomputed) was never tried. The exact planner
    found such plans 9-39% cheaper on small graphs (`exact.py`). At most FREE_TRIES
    bottlenecks a round, spread along the chain; the result is simulated and kept if its peak
    is no higher. Planner estimate only (search stays the reference it was), on graphs of up to
    FREE_NODES nodes: on the zoo's larger ones it changes 4 plans of 11, measured (one run
    each) 1-2% lower on three and 4% higher on MobileNetV2's TF2 step (BENCHMARKS.md)."""
    if pricer.estimator is None or len(ctx.graph) > FREE_NODES:
        return best
    chain = policies.bottlenecks(ctx)
    kept, ahead = set(best.checkpoints), best.ahead_checkpoints
    current = pricer.score(kept, ahead)
    for _ in range(FREE_ROUNDS):
        free = [c for c in chain if c not in kept]
        free = free[::-(-len(free) // FREE_TRIES)] if free else []
        tried = [pricer.score(kept | {c}, ahead) for c in free]
        cheaper = [t for t in tried if t.peak <= current.peak
                   and t.extra_flops < current.extra_flops]
        if not cheaper:
            break
        current = min(cheaper, key=lambda t: (t.extra_flops, t.peak, sorted(t.checkpoints)))
        kept = set(current.checkpoints)
    if kept == set(best.checkpoints):
        return best
    found = _evaluate(ctx, kept, ahead)
    attempts.append(found)
    return found if found.peak <= best.peak else best


def _ahead_trials(ctx: Context, best: Rewrite, pricer: Pricer) -> list[Rewrite]:
    """The chosen checkpoints with the first j of them (from the input) recomputed ahead
    instead of held (two-level recomputation of the early layers), j = 1, 2, 3, 4, 6, 8, ..."""
    position = {n: i for i, n in enumerate(ctx.order())}
    kept = sorted(best.checkpoints, key=position.get)
    counts = sorted({round(1.4 ** e) for e in range(20) if round(1.4 ** e) < len(kept)})
    return pricer.keep([pricer.score(best.checkpoints, frozenset(kept[:j])) for j in counts],
                       STAGE_FINALISTS)


def _two_level_trials(ctx: Context, pricer: Pricer) -> list[Rewrite]:
    """Two-level checkpoints (`checkpoints.two_level`) on the coarse grid of cuts and budgets,
    then on the finer grid around the best of them."""
    tried: dict[tuple, Rewrite] = {}

    def trial(params) -> Rewrite | None:
        checkpoints, ahead = policies.two_level(ctx, *params)
        key = (frozenset(checkpoints), ahead)
        if checkpoints and key not in tried:
            tried[key] = pricer.score(checkpoints, ahead)
        return tried.get(key)

    coarse = {p: r for p in policies.TWO_LEVEL_GRID if (r := trial(p))}
    if coarse:
        split, budget = min(coarse, key=lambda p: (coarse[p].peak, coarse[p].extra_flops))
        step_split, step_budget = policies.TWO_LEVEL_STEP
        for i in (-1, 0, 1):
            for j in (-1, 0, 1):
                trial((split + i * step_split, budget + j * step_budget))
    return pricer.keep(list(tried.values()), STAGE_FINALISTS)


def _owner_live(ctx: Context, name: str, live_nodes: set[str]) -> bool:
    """Whether the checkpoint's buffer (possibly owned by the node it was written in place of)
    is among those live at the peak."""
    if name in live_nodes:
        return True
    return any(r.node in live_nodes for r in ctx.graph.data_inputs(name))


def apply(ctx: Context, checkpoints: set[str], ahead: frozenset = frozenset(),
          executor_gates: bool = False, reuse: bool = False) -> Rewrite:
    """Copy what the gradient flow reads between `checkpoints`, rewire it, add the triggers
    (with `executor_gates`, those for copies read late too: `triggers.py`).
    The checkpoints in `ahead` are not kept from the forward pass but recomputed too (see
    `_recompute_ahead`); with `reuse`, the ahead pass's values serve the segment
    back-propagation reaches first (`_reuse_ahead`)."""
    graph = ctx.graph.copy()
    split = ctx.analysis.split
    flow = split.gradient_flow
    blocked: dict[str, set[str]] = {}
    recomputed, recomputable = _recomputed_nodes(ctx, checkpoints, blocked)
    order = ctx.order()  # the copy's, as nothing was added yet
    reads = ctx.flow_reads()  # likewise
    copies = _copy(graph, recomputed, order, COPY_SUFFIX)
    segments = _segments(ctx, set(copies))
    _mirror_waits(graph, copies, segments)
    backward = split.backward
    for name, copy in copies.items():
        for ref in reads[name]:
            readers = [v for v, _ in graph.consumers(ref)
                       if v in flow or _gated_shape_reader(graph, v, backward)]
            graph.replace_uses(ref, TensorRef(copy, ref.port), readers)
    writers, after_writes = ctx.ref_writers()
    ref_reads = {n for n in copies if any(r.node in writers for r in graph.data_inputs(n))}
    triggers, gate_of, ungated = add_triggers(graph, ctx.graph, copies, segments,
                                              flow - after_writes if ref_reads else flow,
                                              order, executor_gates, ctx.loops_back())
    early = _recompute_ahead(graph, ctx, ahead, copies, gate_of, recomputable, order)
    for made in (copies, early):
        _before_ref_writes(graph, writers, made)
    reuse = reuse and _reuse_ahead(graph, ctx, copies, early,
                                   _first_reached(ctx, segments, set(early)))
    shapes = Shapes(dict(ctx.analysis.shapes.tensors))
    for name, copy_name in [*copies.items(), *early.items()]:
        for ref in ctx.analysis.shapes.outputs(name):
            shapes.tensors[TensorRef(copy_name, ref.port)] = shapes.tensors[ref]
    return Rewrite(graph, set(checkpoints), copies, triggers, ungated, blocked, shapes,
                   ahead=early, ahead_checkpoints=frozenset(ahead), reuse=reuse)


def _recomputed_nodes(ctx: Context, checkpoints: set[str], blocked: dict[str, set[str]]):
    """What keeping `checkpoints` recomputes: the outputs the gradient flow reads that are worth
    it and may be copied, with their ancestors up to the checkpoints and what may not be copied
    (recorded in `blocked` by reason), and the parameters the copies read that may be copied
    with them (`Context.copyable_parameters`; never a boundary: the flow reads a parameter
    where it is). Returns those nodes and the test `recomputable`."""
    recomputable = _recomputable(ctx, checkpoints, blocked)
    return _with_ancestors(ctx, _flow_starts(ctx, recomputable), recomputable), recomputable


def _flow_starts(ctx: Context, recomputable) -> list[str]:
    """The nodes whose outputs the gradient flow reads, worth recomputing and recomputable:
    where `_recomputed_nodes` starts its walk."""
    copyable = ctx.copyable_parameters()
    reads = ctx.flow_reads()
    worth = _worth_nodes(ctx, reads)
    return [n for n in reads if n in worth and n not in copyable and recomputable(n)]


def _recomputable(ctx: Context, checkpoints: set[str], blocked: dict[str, set[str]]):
    """The test whether a node may be recomputed with `checkpoints` kept; it records the
    reason of each node that may not in `blocked`."""
    reasons = ctx.forward_blockers()
    copyable = ctx.copyable_parameters()

    def recomputable(name: str) -> bool:
        if name in checkpoints or name not in reasons:
            return False
        if name in copyable:
            return True
        reason = reasons[name]
        if reason:
            blocked.setdefault(reason, set()).add(name)
        return reason is None

    return recomputable


def _removed(ctx: Context, checkpoints: set[str]) -> set[str]:
    """The nodes of `_unchecked`'s set that keeping `checkpoints` does not recompute: the
    checkpoints themselves and the nodes they cut off (not read by the gradient flow
    themselves, and read only by checkpoints and other such nodes), found by walking up from
    the checkpoints. `_unchecked(ctx).everything` less these is `_recomputed_nodes`'s set
    without walking the graph for every plan (a node is recomputed when the flow reads it or a
    recomputed node reads it): the planners price hundreds of plans."""
    everything, boundary, readers, _ = _unchecked(ctx)
    sources = ctx.sources()
    cut: set[str] = set()
    stack = [s for c in checkpoints if c in everything for s in sources[c]]
    while stack:
        name = stack.pop()
        if (name in cut or name not in everything or name in boundary
                or name in checkpoints):
            continue
        if all(r in checkpoints or r in cut for r in readers[name]):
            cut.add(name)
            stack.extend(sources[name])
    return (everything & checkpoints) | cut


# The last Context `_unchecked` answered for (weakly held) and its answer.
_unchecked_memo: list = [None, None]


class _Unchecked(NamedTuple):
    everything: frozenset  # what `_recomputed_nodes` recomputes without checkpoints
    boundary: frozenset    # the nodes of it the gradient flow reads (its starts)
    readers: dict          # each node's readers within it
    flops: int             # its FLOPs, summed once


def _unchecked(ctx: Context) -> _Unchecked:
    """What `_recomputed_nodes` recomputes without checkpoints, and what the planners ask of
    it for every plan, found once per context."""
    held, found = _unchecked_memo
    if held is None or held() is not ctx:
        recomputable = _recomputable(ctx, set(), {})
        boundary = frozenset(_flow_starts(ctx, recomputable))
        everything = _with_ancestors(ctx, boundary, recomputable)
        readers = {n: tuple(r for r in ctx.readers().get(n, ()) if r in everything)
                   for n in everything}
        found = _Unchecked(frozenset(everything), boundary, readers, ctx.flops(everything))
        _unchecked_memo[:] = [weakref.ref(ctx), found]
    return found


def _ahead_members(ctx: Context, ahead, recomputable) -> set[str]:
    """The checkpoints recomputed ahead with what lies between them and the kept ones below."""
    return _with_ancestors(ctx, ahead, lambda n: n in ahead or recomputable(n))


def _segments(ctx: Context, recomputed: set[str]) -> list[set[str]]:
    """The connected groups of recomputed nodes (one trigger each), by their data edges."""
    sources, readers = ctx.sources(), ctx.readers()
    segments, seen = [], set()
    for start in recomputed:
        if start not in seen:
            segment, stack = {start}, [start]
            while stack:
                name = stack.pop()
                for other in (*sources[name], *readers[name]):
                    if other in recomputed and other not in segment:
                        segment.add(other)
                        stack.append(other)
            seen |= segment
            segments.append(segment)
    return segments


# Ops that read only their input's shape.
SHAPE_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _gated_shape_reader(graph: Graph, name: str, backward) -> bool:
    """A backward node that reads only shapes and waits on control inputs (see the module's
    docstring)."""
    return (name in backward and graph.op(name) in SHAPE_READERS
            and bool(graph.control_inputs(name)))


# The last Context `_worth_nodes` answered for (weakly held) and its answer.
_worth_memo: list = [None, frozenset()]


def _worth_nodes(ctx: Context, reads: dict[str, list[TensorRef]]) -> frozenset:
    """The nodes of `reads` `_worth_recomputing` holds for; it depends on the context alone,
    so it is found once, not for every candidate `apply` tries."""
    held, nodes = _worth_memo
    if held is None or held() is not ctx:
        nodes = frozenset(n for n, refs in reads.items() if _worth_recomputing(ctx, n, refs))
        _worth_memo[:] = [weakref.ref(ctx), nodes]
    return nodes


def _worth_recomputing(ctx: Context, name: str, reads: list[TensorRef]) -> bool:
    """Whether the gradient flow reads an output of `name` that is worth recomputing. Outputs
    under 1/SIDE_OUTPUT_RATIO of the node's largest (a batch norm's batch statistics beside its
    normalized output) are not: holding them costs next to nothing, while recomputing them
    costs the large output too, if only for a moment. A node copied anyway (its large output
    feeds other copies) gives the flow all its outputs from the copy."""
    shapes = ctx.analysis.shapes
    largest = max((shapes.nbytes(r) or 0 for r in shapes.outputs(name)), default=0)
    return any((shapes.nbytes(r) or 0) * SIDE_OUTPUT_RATIO >= largest for r in reads)


def _with_ancestors(ctx: Context, starts, include) -> set[str]:
    """`starts` and their data ancestors for which `include` holds, through those only."""
    sources = ctx.sources()
    found, stack = set(), list(starts)
    while stack:
        name = stack.pop()
        if name not in found:
            found.add(name)
            stack.extend(s for s in sources[name] if s not in found and include(s))
    return found


def _copy(graph: Graph, names: set[str], order: list[str], suffix: str) -> dict[str, str]:
    """Copy `names` as `<name><suffix>`, in `order`, each copy reading the copies of its inputs
    (the suffix keeps each copy where its original sorts by name, see `names.py`)."""
    copies = {}
    for name in (n for n in order if n in names):
        copies[name] = graph.copy_node(name, graph.unique_name(name + suffix))
        for ref in graph.data_inputs(copies[name]):
            if ref.node in copies:
                graph.replace_uses(ref, TensorRef(copies[ref.node], ref.port), [copies[name]])
    return copies


def _mirror_waits(graph: Graph, copies: dict[str, str], segments: list[set[str]]) -> None:
    """Each copy waits for the copies of what its original waits for by a control edge within
    its segment. A diet pass's dequantization of a weight waits for the activation its reader
    multiplies, so only a few weights are float32 at a time; its copy, waiting on the
    segment's trigger alone, would dequantize every weight of the segment when the
    recomputation starts (a dieted ResNet-50: the last stage's 21 MiB of kernels at once, at
    the peak). Within one segment the copies mirror the original's acyclic edges; across
    segments a wait could close a cycle through the triggers."""
    for segment in segments:
        for name in segment:
            for before in graph.control_inputs(name):
                if before in segment:
                    graph.add_control(copies[before], copies[name])


def _before_ref_writes(graph: Graph, writers: dict, copies: dict[str, str]) -> None:
    """A copied read of a ref variable (a dieted weight's `Cast`, `Context.copyable_parameters`)
    reads the variable when it runs, so it must run before the step writes the variable: each
    of the variable's `writers` waits for it (its trigger waits on no node after a write)."""
    for name, copy in copies.items():
        for ref in graph.data_inputs(name):
            for writer in writers.get(ref.node, ()):
                graph.add_control(copy, writer)


def _recompute_ahead(graph: Graph, ctx, ahead, copies, gate_of, recomputable, order) -> dict:
    """Checkpoints recomputed ahead of their segments: instead of holding them from the forward
    pass, copy them (with what lies between them and the kept checkpoint below) and run the
    copies when back-propagation reaches the first segment reading any of them; the copies and
    the gradient flow read the recomputed values, the forward pass the originals, which die
    early. Two-level recomputation: at the price of one more forward pass over that part, the
    early layers' checkpoints are not held while the backward pass works through the later
    ones. Returns original -> copy."""
    if not ahead:
        return {}
    flow = ctx.analysis.split.gradient_flow
    early = _copy(graph, _ahead_members(ctx, ahead, recomputable), order, AHEAD_SUFFIX)
    _mirror_waits(graph, early, _segments(ctx, set(early)))
    copy_names = set(copies.values())
    for name in ahead:
        for ref in ctx.analysis.shapes.outputs(name):
            readers = [v for v, _ in graph.consumers(ref) if v in flow or v in copy_names]
            graph.replace_uses(ref, TensorRef(early[name], ref.port), readers)
    chains = nx.Graph()
    chains.add_nodes_from(early.values())
    chains.add_edges_from((r.node, c) for c in early.values() for r in graph.data_inputs(c)
                          if r.node in chains)
    position = {n: i for i, n in enumerate(graph.topological_order())}
    for chain in nx.connected_components(chains):
        downstream = reachable(graph.nx, chain)
        gates = {gate_of[v] for c in chain for v in graph.successors(c) if v in gate_of}
        gates = sorted((g for g in gates if g not in downstream), key=position.get)
        if gates:  # the segment back-propagation reaches first; it cannot depend on the chain
            for root in chain:
                if not any(r.node in chain for r in graph.data_inputs(root)):
                    graph.add_control(gates[0], root)
    return early


def _first_reached(ctx, segments: list[set[str]], early: set[str]) -> set[str]:
    """The nodes that both the ahead pass and a recomputed segment compute, in the segment
    back-propagation reaches first among those the ahead pass covers (the highest in the
    forward order), for each group of ahead copies. The ahead pass computes that segment's
    nodes just before back-propagation needs them (only the layers between the highest
    checkpoint recomputed ahead and the held one above it run in between): recomputing them
    once more then is a third forward pass over that part (a 3-layer transformer: a fifth
    of the step's FLOPs for no byte saved)."""
    if not early:
        return set()
    position = {n: i for i, n in enumerate(ctx.order())}
    reused = set()
    for chain in _segments(ctx, early):
        covering = [s for s in segments if not s.isdisjoint(chain)]
        if covering:
            top = max(covering, key=lambda s: max(position[n] for n in s))
            reused |= top & chain
    return reused


def _reuse_ahead(graph: Graph, ctx, copies: dict[str, str], early: dict[str, str],
                 reused: set[str]) -> bool:
    """The readers of the copies of `reused` (`_first_reached`) read the ahead copies instead,
    and those copies are removed (and leave `copies`); False (nothing changed) when there are
    none, or when a reader lies upstream of what the ahead pass waits for (the rewired graph
    would have a cycle). The ahead copies are then held from the ahead pass until that
    segment's back-propagation, a little longer than its own copies would be: whether the
    peak allows it is for the planner to simulate (`_decide`)."""
    removed = {copies[n] for n in reused}
    readers = {v for n in reused for v in graph.successors(copies[n])} - removed
    if not reused or not reachable(graph.nx, readers).isdisjoint(early.values()):
        return False
    for name in sorted(reused):
        copy, ahead = copies.pop(name), early[name]
        for ref in ctx.analysis.shapes.outputs(name):
            moved = TensorRef(copy, ref.port)
            graph.replace_uses(moved, TensorRef(ahead, ref.port),
                               [v for v, _ in graph.consumers(moved)])
        for after in graph.successors(copy):
            if after not in removed and copy in graph.control_inputs(after):
                graph.add_control(ahead, after)
    for copy in removed:
        graph.remove_node(copy)
    return True


def _result(best: Rewrite, note: str) -> RecomputeResult:
    return RecomputeResult(
        best.graph, True, best.shapes, note,
        checkpoints=sorted(best.checkpoints),
        recomputed=sorted(best.recomputed),
        recomputed_ahead=sorted(n for n in best.ahead if n in best.checkpoints),
        reuse_ahead=best.reuse,
        triggers=len(best.triggers),
        ungated_segments=best.ungated,
        fanout_pads=best.pads,
        extra_flops=best.extra_flops,
        kept_because={reason: sorted(nodes) for reason, nodes in sorted(best.blocked.items())},
        memory=best.report,
    )
