"""Recompute pass: keep checkpoints, recompute the rest of what the backward pass reads.

For each forward node the gradient flow reads that is not a checkpoint, the pass copies it and
everything between it and the checkpoints above it (each node once), and rewires the
gradient-flow consumers to the copies, and the backward values computed from forward values
alone (a tanh-GELU's `x ** 2`); forward consumers, and backward shape computations, keep the
originals, which are then freed early. A node the flow
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
(`rewrite`): the weight is dequantized again when its layer is recomputed, instead of
its float32 form being held from the forward pass.

In memory mode the first few checkpoints may be recomputed ahead (`rewrite`): copied
too, and computed when back-propagation reaches the first segment reading them, rather than held
from the forward pass; tried for the first of the chosen checkpoints and for the two-level
spreads of `checkpoints.two_level`. A two-level plan that lowers the peak enough but costs too
much is tried once more with `reuse`: the segment back-propagation reaches first among those
the ahead pass covers reads the ahead pass's values instead of computing them a third time
(`rewrite`).

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
from contextlib import contextmanager
from dataclasses import dataclass, field

from ...analysis import memory
from ...analysis.split import no_backward_pass, unfetched_backward
from ...analysis.step import Analysis
from ...core.errors import GraphRewriteError
from ...core.graph import Graph
from ...core.selectors import select
from ...planning import checkpoints as policies
from ...planning import search
from ...planning.budget import parse_budget
from ...planning.context import Context
from ...planning.peak import why_so_little
from ..base import PassOptions, PassResult, counted
from ..pads import keep_apart, pad_readers
from .rewrite import apply

__all__ = ["SMALL_GAIN", "PLANNERS", "RecomputeOptions", "RecomputeResult", "run", "finish",
           "evaluate"]

log = logging.getLogger(__name__)

SMALL_GAIN = 0.05  # under this, the report says what holds the peak


PLANNERS = ("estimate", "search", "exact")  # exact: `exact.py`, an optional extra


@dataclass(frozen=True)
class RecomputeOptions(PassOptions):
    policy: str = "memory"          # memory | speed | collection | manual
    checkpoints: str | None = None  # selectors, for policy=collection
    ahead: str | None = None        # policy collection: checkpoints recomputed ahead (a plan's)
    budget: str | None = None       # policy memory: the least recomputation under this peak
    planner: str = "estimate"       # policy memory: estimate | search (see `run`)
    reuse: bool = False             # with ahead: the ahead pass serves a segment (`rewrite`)
    # Pins (policy memory, planners estimate and search): selectors of nodes every plan holds
    # as checkpoints, never holds, or never copies (as PyTorch's CheckpointPolicy MUST_SAVE /
    # MUST_RECOMPUTE); the note says what they cost against the plan without them.
    pin_keep: str | None = None
    pin_recompute: str | None = None
    pin_never: str | None = None

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
        placed = self.pin_keep or self.pin_recompute  # never-copied nodes bind any planner
        if placed and (self.policy != "memory" or self.planner == "exact"):
            raise GraphRewriteError("recompute: keep and recompute pins need policy memory and "
                                    "planner estimate or search")

    def pinned(self) -> dict[str, str]:
        """kind -> selectors, of the pins given."""
        return {kind: text for kind, text in (("keep", self.pin_keep),
                                              ("recompute", self.pin_recompute),
                                              ("never", self.pin_never)) if text}

    def takes_budget(self) -> bool:
        return self.policy == "memory"


@dataclass
class RecomputeResult(PassResult):
    checkpoints: list[str] = field(default_factory=list)       # kept
    recomputed: list[str] = field(default_factory=list)        # copied for the backward pass
    recomputed_ahead: list[str] = field(default_factory=list)  # checkpoints computed again
    reuse_ahead: bool = False  # the ahead pass's values serve the first segment it covers
    triggers: int = 0
    ungated_segments: int = 0  # segments no safe trigger was found for
    ungated: list[str] = field(default_factory=list)  # their first nodes
    fanout_pads: int = 0
    extra_flops: int = 0
    kept_because: dict[str, list[str]] = field(default_factory=dict)  # reason -> nodes
    pinned: dict[str, list[str]] = field(default_factory=dict)  # kind -> nodes (`--pin`)
    budget_missed: list[str] = field(default_factory=list)  # planners' sentences in `note`

    def section(self) -> dict:
        found = super().section()
        found["skipped"] = counted(found.pop("kept_because"))
        return found


def run(graph: Graph, analysis: Analysis, options: RecomputeOptions, model=None):
    """Keep the policy's checkpoints and recompute the rest the backward pass reads.

    Every candidate checkpoint set is priced; the lowest peak wins (the cheapest recomputation
    among near-equal peaks). Planner `search` applies each candidate and simulates the rewritten
    step (a hundred rewrites and simulations of the whole graph); planner `estimate` (the
    default) prices them on the original's schedule (`estimate.py`, linear in what a plan
    recomputes) and applies and simulates only the best few of each stage (`search.Pricer`): the
    spreads, their fine-tuning, each round of dropping checkpoints, the two-level trials.
    Decisions between stages are taken on the simulated peaks, as `search` takes them, or on
    the estimates once they have matched (`search.Pricer`; the final graph's simulation checks
    them). Automatic policies leave the graph alone unless the modelled peak drops by MIN_GAIN
    (`search`). With a
    budget, policy memory takes the least recomputation (extra FLOPs) among all it tried whose
    peak is within it, two-level spreads included whatever their cost.
    """
    if not analysis.split.seeds:
        return RecomputeResult(graph, False, note=no_backward_pass(graph))
    unfetched = unfetched_backward(graph, analysis.split, analysis.fetches)
    if unfetched:
        return RecomputeResult(graph, False, note=unfetched)
    ctx = Context.build(graph, analysis)
    pins, pinned = _pins(ctx, options)
    if options.policy == "collection":
        candidates = policies.collection_policy(ctx, options.checkpoints,
                                                model.meta_graph if model else None)
    else:
        candidates = policies.POLICIES[options.policy](ctx)
    if not candidates:
        return RecomputeResult(graph, False, note="no checkpoint candidates found: "
                               + policies.why_no_candidates(ctx))
    budget = parse_budget(options.budget, analysis.memory.peak())
    if budget >= analysis.memory.peak():
        return RecomputeResult(graph, False, note=(
            "the modelled peak is already within the budget: nothing recomputed"))
    ahead = frozenset(select(graph, options.ahead)) if options.ahead else frozenset()
    note, pricer = "", None
    if options.policy == "memory" and options.planner == "exact":
        from ...planning import exact  # its solver is an optional extra: imported when asked
        chosen, note = exact.plan(ctx, budget)
        best = evaluate(ctx, chosen)
    elif options.policy == "memory":
        pricer = search.Pricer(ctx, options.planner, budget, evaluate, pins=pins)
        best, note = search.plan(ctx, candidates, budget, pricer)
    else:
        best = search.choose([evaluate(ctx, checkpoints, ahead, options.reuse)
                              for checkpoints in candidates])
    automatic = options.policy in ("memory", "speed")  # hints and selectors are obeyed as given

    def untrusted():
        """Policy memory's search again, every finalist simulated."""
        return search.plan(ctx, candidates, budget, search.Pricer(
            ctx, options.planner, budget, evaluate, trust=False, pins=pins))

    unchanged = RecomputeResult(graph, False, note=(
        f"no checkpoint choice lowers the modelled peak by {search.MIN_GAIN:.0%} or more: "
        "nothing recomputed between checkpoints; " + why_so_little(ctx, analysis.memory)),
        pinned=pinned)
    if automatic and best.peak > analysis.memory.peak() * (1 - search.MIN_GAIN) and \
            pricer is not None and pricer.took_estimates:
        # nothing found on trusted estimates: every finalist simulated before saying so (a
        # capsule network's estimates missed a plan simulated at 0.69x by 31%)
        log.info("recompute: no plan lowers the estimated peak: planned again, every "
                 "finalist simulated")
        (best, note), pricer = untrusted(), None
    if automatic and best.peak > analysis.memory.peak() * (1 - search.MIN_GAIN):
        return unchanged
    final = finish(ctx, best)
    if pricer is not None and pricer.took_estimates and \
            abs(best.peak / max(final.report.peak(), 1) - 1) > search.TRUST_ERROR:
        log.info("recompute: the plan's estimated peak (%d bytes) is not its simulated one (%d): "
                 "planned again, every finalist simulated", best.peak, final.report.peak())
        best, note = untrusted()
        if best.peak > analysis.memory.peak() * (1 - search.MIN_GAIN):
            return unchanged
        final = finish(ctx, best)
    missed = note  # the planners' only note: the budget out of reach
    if automatic and final.report.peak() > analysis.memory.peak() * (1 - SMALL_GAIN):
        note = " ".join(filter(None, (note, "recomputing between checkpoints saves under "
                                      f"{SMALL_GAIN:.0%} as written: "
                                      + why_so_little(ctx, final.report))))
    if pins is not None:
        note = " ".join(filter(None, (note, _pins_cost(graph, analysis, options, budget,
                                                       final))))
    result = _result(final, note)
    result.pinned = pinned
    result.budget_missed = [missed] if missed else []
    return result


def _pins(ctx: Context, options: RecomputeOptions) -> tuple[search.Pins | None, dict]:
    """The pins the options select (never-copied nodes given to `ctx` as blockers), and the
    nodes of each kind for the report."""
    pinned = {kind: select(ctx.graph, text) for kind, text in options.pinned().items()}
    if not pinned:
        return None, {}
    ctx.pin_never(pinned.get("never", ()), "never copied (pinned, or its copy would change how "
                  "Grappler fuses it)")
    if not pinned.keys() & {"keep", "recompute"}:
        return None, pinned
    return search.Pins(frozenset(pinned.get("keep", ())),
                       frozenset(pinned.get("recompute", ()))), pinned


def _pins_cost(graph: Graph, analysis: Analysis, options: RecomputeOptions, budget: int,
               pinned: search.Rewrite) -> str:
    """What the pins cost: the plan found without them, on its own context, beside it."""
    free_ctx = Context.build(graph, analysis)
    free, _ = search.plan(free_ctx, policies.POLICIES["memory"](free_ctx), budget,
                          search.Pricer(free_ctx, options.planner, budget, evaluate))
    mib = 2**20
    return (f"pins: modelled peak {pinned.report.peak() / mib:.1f} MiB and "
            f"{pinned.extra_flops / 1e9:.3f} GFLOP recomputed, against "
            f"{free.peak / mib:.1f} MiB and {free.extra_flops / 1e9:.3f} GFLOP without them")


def finish(ctx: Context, best: search.Rewrite) -> search.Rewrite:
    """The chosen plan applied again with the waits only a concurrent executor needs (the model
    runs one node at a time, and ranks the candidates as well without them) and the fan-out
    pads (they never run), and its step simulated: the check of a plan chosen on estimates, and
    the pipeline's model of the rewritten step."""
    final = _with_executor_gates(ctx, best)
    final.pads = pad_readers(final.graph, ctx.graph, ctx.analysis,
                             {c: o for o, c in [*final.recomputed.items(), *final.ahead.items()]})
    keep_apart(final.graph)
    final.report = memory.simulate(final.graph, final.shapes, ctx.analysis.fetches)
    return final


def _with_executor_gates(ctx: Context, best: search.Rewrite) -> search.Rewrite:
    final = apply(ctx, best.checkpoints, best.ahead_checkpoints, executor_gates=True,
                  reuse=best.reuse)
    final.peak, final.extra_flops = best.peak, best.extra_flops
    final.live_at_peak = best.live_at_peak
    return final


def evaluate(ctx: Context, checkpoints: set[str],
              ahead: frozenset = frozenset(), reuse: bool = False) -> search.Rewrite:
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


def _result(best: search.Rewrite, note: str) -> RecomputeResult:
    return RecomputeResult(
        best.graph, True, best.shapes, note,
        checkpoints=sorted(best.checkpoints),
        recomputed=sorted(best.recomputed),
        recomputed_ahead=sorted(n for n in best.ahead if n in best.checkpoints),
        reuse_ahead=best.reuse,
        triggers=len(best.triggers),
        ungated_segments=len(best.ungated), ungated=sorted(best.ungated),
        fanout_pads=best.pads,
        extra_flops=best.extra_flops,
        kept_because={reason: sorted(nodes) for reason, nodes in sorted(best.blocked.items())},
        memory=best.report,
    )
