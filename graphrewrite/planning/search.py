"""The recompute planners `estimate` (the default) and `search`: which checkpoints to keep.

Both price candidate checkpoint sets (the policies' spreads, their refinements, recomputation
ahead, two-level plans) and choose the lowest peak, the cheapest recomputation among near-equal
ones (`choose`), or with a budget the cheapest within it. Planner `search` applies and simulates
every plan; `estimate` prices them on the original's schedule (`estimate.py`) and simulates only
the best few of each stage (`Pricer`). Applying and simulating is the pass's: the planner
receives it as `simulate` (as networkx's flow algorithms receive their `flow_func`), so the
planners never import the rewrite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ..analysis import memory
from ..analysis.shapes import Shapes
from ..core.graph import Graph
from . import checkpoints as policies
from . import plan_nodes
from .context import Context
from .estimate import PlanEstimator

__all__ = ["Pins", "MIN_GAIN", "PEAK_SLACK", "REFINE_ROUNDS", "REFINE_TRIES", "AHEAD_GAIN",
           "AHEAD_FLOPS", "REUSE_TRIES", "FINALISTS", "STAGE_FINALISTS", "TRUST_ERROR", "TRUST_AFTER",
           "HUGE_NODES", "HUGE_TRUST_AFTER", "FREE_ROUNDS", "FREE_TRIES", "FREE_NODES", "Rewrite",
           "Simulate", "plan", "decide",
           "Pricer", "estimate", "choose", "add_free", "ahead_trials", "two_level_trials"]

log = logging.getLogger(__name__)

MIN_GAIN = 0.01    # a rewrite that models less than 1% lower peak is not worth its compute


PEAK_SLACK = 0.02  # peaks this close count as equal; then less recomputation wins


REFINE_ROUNDS, REFINE_TRIES = 3, 4  # bounded local search after the candidate sweep


# Recomputing checkpoints ahead costs a forward pass over the early layers: only for 5% less
# peak, and for at most 15% of the step's FLOPs more than single-level recomputation (measured
# with steps timed in turns: deep MLP +13% FLOPs, step 1.35x; DenseNet-121 +13%, 1.19x-1.28x).
AHEAD_GAIN, AHEAD_FLOPS = 0.05, 0.15


REUSE_TRIES = 2  # two-level plans low enough but too dear, tried again with `reuse`


# Planner estimate: plans applied and simulated from the first stage, and from each later one.
FINALISTS, STAGE_FINALISTS = 4, 2


# Once the estimate has matched the simulated peak this closely on this many plans of a graph,
# later stages take it as the simulation (see `Pricer`). One is not enough: a MetaGraphDef's
# first finalist can match while later plans are a few percent off (a small ResNet with Adam
# then kept 2 MiB more, its plan checked correct at the end).
TRUST_ERROR, TRUST_AFTER = 0.001, 2  # the best two of the first stage's finalists


# Graphs of more than HUGE_NODES nodes take the estimate on trust from the start
# (HUGE_TRUST_AFTER plans simulated first): the final graph's simulation still checks the plan,
# and one it refutes is planned again with every finalist simulated (`recompute.run`). Applying
# and simulating a finalist costs about 10 s at 100k nodes. Measured on the 99k-node residual
# MLP (`fixtures/scaling.py --depths 11000`): its two finalists simulated to exactly their
# estimates (error 0.0), and trusting from the start leaves its rewrite byte-identical (same
# checkpoints, modelled peak 366886952 bytes) in 70 s of CPU instead of 92. Should the check
# refute a plan, the search is repeated at about the cost of one with every finalist simulated
# (up to 25 s more at 99k); no graph of the zoo or the fixtures is this large.
HUGE_NODES, HUGE_TRUST_AFTER = 50_000, 0


FREE_ROUNDS, FREE_TRIES, FREE_NODES = 3, 24, 2000  # `add_free`: rounds, tries, graph size
# `add_free`: reads under this share of the peak are kept where that recomputes under
# SMALL_SAVING of the FLOPs (a teacher's whole forward pass, not a batch norm's statistics).
SMALL_READ, SMALL_SAVING = 0.001, 0.5


@dataclass
class Rewrite:
    """One applied choice of checkpoints and what it did."""

    graph: Graph
    checkpoints: set[str]
    recomputed: dict[str, str] | frozenset  # original -> copy (an estimate's: the originals)
    triggers: dict[str, list[str]]   # trigger -> its control inputs
    ungated: list                    # segments no safe trigger was found for (first nodes)
    blocked: dict[str, set[str]]     # reason -> nodes kept because they cannot be recomputed
    shapes: Shapes
    pads: int = 0                    # IdentityN readers restoring data-reader counts (see run)
    ahead: dict[str, str] = field(default_factory=dict)  # checkpoint (and its segment) -> copy
    ahead_checkpoints: frozenset = frozenset()  # the checkpoints asked to be recomputed ahead
    peak: int = 0
    extra_flops: int = 0
    live_at_peak: set = field(default_factory=set)
    reuse: bool = False  # the ahead pass's values serve the first segment it covers
    report: memory.MemoryReport | None = None  # the final graph's simulated step

# Apply a plan and simulate the rewritten step: (ctx, checkpoints, ahead, reuse) -> Rewrite with
# its peak, extra FLOPs and what is live at the peak (the recompute pass's `evaluate`).
Simulate = Callable[..., "Rewrite"]


def plan(ctx: Context, candidates: list[set[str]], budget: int,
                 pricer: Pricer) -> tuple[Rewrite, str]:
    """Policy memory's search: the candidates and the spreads near the best of them, refined,
    then recomputation ahead and two-level plans; the best plan and a note."""
    attempts = pricer.keep([pricer.score(c) for c in candidates], FINALISTS)
    attempts += pricer.keep([pricer.score(c) for c in policies.memory_policy(
        ctx, near=choose(attempts).checkpoints)], STAGE_FINALISTS)
    best = _refine(ctx, choose(attempts), attempts, pricer)
    best = add_free(ctx, best, attempts, pricer)
    bases = [best] if pricer.estimator is None else _runners_up(attempts, best)
    trials = [t for base in bases for t in ahead_trials(ctx, base, pricer)]
    trials += two_level_trials(ctx, pricer)
    best, note = decide(attempts, trials, budget, ctx.analysis.flops, pricer)
    if budget and best.peak <= budget:
        best, note = _within_budget([best, *_kept_whole(ctx, best, budget, pricer)], budget)
    return best, note


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


def decide(attempts: list[Rewrite], trials: list[Rewrite], budget: int, step_flops: int,
           pricer: Pricer) -> tuple[Rewrite, str]:
    """The best single-level plan, unless a two-level one (`trials`) lowers the peak by
    AHEAD_GAIN for at most AHEAD_FLOPS of the step's FLOPs more; with a budget, the least
    recomputation within it. A two-level plan low enough but too dear is tried once more
    with the ahead pass serving the segment back-propagation reaches first (`reuse`,
    applied and simulated: the values it holds a little longer can raise the peak)."""
    if budget:
        return _within_budget([*attempts, *trials], budget)
    best = choose(attempts)
    affordable = best.extra_flops + AHEAD_FLOPS * step_flops
    low = sorted((t for t in trials if t.peak <= best.peak * (1 - AHEAD_GAIN)),
                 key=lambda t: (t.peak, t.extra_flops))
    better = [t for t in low if t.extra_flops <= affordable]
    if not better:
        for trial in low[:REUSE_TRIES]:
            reused = pricer.simulate(pricer.ctx, trial.checkpoints, trial.ahead_checkpoints,
                                      reuse=True)
            if reused.reuse and reused.peak <= best.peak * (1 - AHEAD_GAIN) \
                    and reused.extra_flops <= affordable:
                better.append(reused)
    return (choose(better) if better else best), ""


@dataclass(frozen=True)
class Pins:
    """What a user requires of every plan (`--pin`): these nodes held as checkpoints (`keep`),
    those never held (`recompute`: copied when the gradient flow reads them, if they may be)."""

    keep: frozenset = frozenset()
    recompute: frozenset = frozenset()

    def apply(self, checkpoints, ahead=frozenset()) -> tuple[set[str], frozenset]:
        """`checkpoints` and the checkpoints recomputed ahead, as the pins have them."""
        return (set(checkpoints) | self.keep) - self.recompute, frozenset(ahead) - self.keep


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
    off and it is simulated throughout). On graphs of more than HUGE_NODES nodes the estimate
    is trusted after HUGE_TRUST_AFTER plans instead. The plan chosen so is checked by the
    simulation of the final graph (`run`): should that miss its estimate, the search runs
    again without trust."""

    def __init__(self, ctx: Context, planner: str, budget: int, simulate: Simulate,
                 trust: bool = True, pins: Pins | None = None):
        if pins:  # every plan simulated, however it was made, as the pins have it
            unpinned = simulate

            def simulate(ctx, checkpoints, ahead=frozenset(), reuse=False):
                return unpinned(ctx, *pins.apply(checkpoints, ahead), reuse)
        self.ctx, self.budget, self.trust, self.simulate = ctx, budget, trust, simulate
        self.pins = pins
        self.estimator = PlanEstimator(ctx.graph, ctx.analysis) if planner == "estimate" else None
        self.evaluated: dict[tuple, Rewrite] = {}
        self.errors: list[float] = []  # |estimated / simulated - 1| of each plan simulated
        self.took_estimates = False  # some finalist was kept as estimated, not simulated
        self.trust_after = TRUST_AFTER if len(ctx.graph) <= HUGE_NODES else HUGE_TRUST_AFTER

    def trusted(self) -> bool:
        return self.trust and len(self.errors) >= self.trust_after and \
            max(self.errors, default=0.0) <= TRUST_ERROR

    def score(self, checkpoints: set[str], ahead: frozenset = frozenset()) -> Rewrite:
        if self.estimator is None:  # `simulate` applies the pins
            return self.simulate(self.ctx, checkpoints, ahead)
        if self.pins:
            checkpoints, ahead = self.pins.apply(checkpoints, ahead)
        return estimate(self.estimator, self.ctx, checkpoints, ahead)

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
                    self.evaluated[key] = self.simulate(self.ctx, plan.checkpoints,
                                                    plan.ahead_checkpoints)
                    self.errors.append(abs(plan.peak / max(self.evaluated[key].peak, 1) - 1))
                kept.append(self.evaluated[key])
        return kept


def estimate(estimator: PlanEstimator, ctx: Context, checkpoints: set[str],
              ahead: frozenset = frozenset()) -> Rewrite:
    """Price a checkpoint choice on the original's schedule (`estimate.py`), without applying
    it: a Rewrite with no graph."""
    blocked: dict[str, set[str]] = {}  # left empty: the chosen plan is applied again
    unchecked = plan_nodes.unchecked(ctx)
    removed = plan_nodes.removed(ctx, checkpoints)
    recomputed = unchecked.everything - removed  # `recomputed_nodes`'s set (`plan_nodes.removed`)
    early = plan_nodes.ahead_members(ctx, ahead,
                                     plan_nodes.recomputable_test(ctx, checkpoints, blocked))
    groups = [(chain & ahead, {v for a in chain & ahead for v in ctx.graph.successors(a)
                               if v in recomputed})
              for chain in plan_nodes.segments(ctx, early)]
    found = estimator.estimate_recomputed(unchecked.everything, removed, groups)
    attempt = Rewrite(None, set(checkpoints), recomputed, {}, [], blocked,
                      None, ahead=dict.fromkeys(early, ""), ahead_checkpoints=frozenset(ahead),
                      peak=found.peak, live_at_peak=found.live_at_peak)
    # the FLOPs of `recomputed` as those of `everything` (summed once) less `removed`'s
    attempt.extra_flops = unchecked.flops - ctx.flops(removed) + ctx.flops(early)
    log.debug("recompute: %d checkpoints -> estimated peak %d bytes, %d extra FLOPs",
              len(checkpoints), attempt.peak, attempt.extra_flops)
    return attempt


def choose(attempts: list[Rewrite]) -> Rewrite:
    """Within PEAK_SLACK of the lowest modelled peak, the cheapest recomputation wins."""
    lowest = min(a.peak for a in attempts)
    return min((a for a in attempts if a.peak <= lowest * (1 + PEAK_SLACK)),
               key=lambda a: (a.extra_flops, a.peak))


def _kept_whole(ctx: Context, base: Rewrite, budget: int, pricer: Pricer) -> list[Rewrite]:
    """With a budget: plans that recompute less than `base` by keeping some of its segments
    whole (every value of the segment the backward pass reads is held, none recomputed), those
    whose recomputation costs the most FLOPs per byte held first; as many as keep the peak
    within the budget, found by bisection on simulated peaks (the estimate is least sure of
    plans that recompute little). Every plan the checkpoint spreads make recomputes nearly the
    whole forward pass, however low or high its peak: without these a budget could not buy
    back compute. Returns the plans simulated."""
    recomputed, _ = plan_nodes.recomputed_nodes(ctx, base.checkpoints, {})
    reads, shapes = ctx.flow_reads(), ctx.analysis.shapes
    cost = {}
    for segment in plan_nodes.segments(ctx, recomputed):
        held = sum(shapes.nbytes(r) or 0 for n in segment for r in reads.get(n, ()))
        cost[min(segment)] = (ctx.flops(segment) / max(held, 1), segment)
    ranked = [cost[k][1] for k in sorted(cost, key=lambda k: (-cost[k][0], k))]
    tried: dict[int, Rewrite] = {}

    def peak(count: int) -> int:
        if count not in tried:
            kept = set(base.checkpoints).union(*ranked[:count])
            tried[count] = pricer.simulate(ctx, kept, base.ahead_checkpoints)
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
    return choose([a for a in attempts if a.peak <= best.peak * (1 + PEAK_SLACK)] or [best])


def add_free(ctx: Context, best: Rewrite, attempts: list[Rewrite], pricer: Pricer) -> Rewrite:
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
    small = _small_reads(ctx, current)
    if small:  # kept at once: a frozen teacher's softened answers, recomputed whole for 1 KiB
        tried = pricer.score(kept | small, ahead)
        if tried.peak <= current.peak and tried.extra_flops < SMALL_SAVING * current.extra_flops:
            current, kept = tried, set(tried.checkpoints)
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
    found = pricer.simulate(ctx, kept, ahead)
    attempts.append(found)
    return found if found.peak <= best.peak else best


def _small_reads(ctx: Context, plan: Rewrite) -> set[str]:
    """Values `plan` recomputes that the backward pass reads and that hold under SMALL_READ of
    its peak: keeping them costs nothing at the peak, and one may stand at the end of a long
    chain read for it alone. A distilling student's loss reads its frozen teacher's softmax,
    [32, 10]: the teacher was recomputed whole, 6.9 of the step's 9.1 GFLOP, for no lower
    peak; kept, the rewrite measured 48.4 MiB against 61.4, at the same step time. `add_free`
    keeps them only where that saves SMALL_SAVING of the FLOPs: a batch norm's statistics,
    kept, moved seven tests' plans and saved nothing measurable."""
    reads, shapes = ctx.flow_reads(), ctx.analysis.shapes
    return {n for n in plan.recomputed if reads.get(n) and sum(
        shapes.nbytes(r) or 0 for r in reads[n]) <= SMALL_READ * plan.peak}


def ahead_trials(ctx: Context, best: Rewrite, pricer: Pricer) -> list[Rewrite]:
    """The chosen checkpoints with the first j of them (from the input) recomputed ahead
    instead of held (two-level recomputation of the early layers), j = 1, 2, 3, 4, 6, 8, ..."""
    position = {n: i for i, n in enumerate(ctx.order())}
    kept = sorted(best.checkpoints, key=position.get)
    counts = sorted({round(1.4 ** e) for e in range(20) if round(1.4 ** e) < len(kept)})
    return pricer.keep([pricer.score(best.checkpoints, frozenset(kept[:j])) for j in counts],
                       STAGE_FINALISTS)


def two_level_trials(ctx: Context, pricer: Pricer) -> list[Rewrite]:
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
