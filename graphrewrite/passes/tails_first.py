"""Tails first pass: a branch's heavy backward ops wait for another branch's loss tail.

Where a loss has several terms, each reaching the model through its own head, each term's
gradient first runs through the loss's own tail (a focal loss's elementwise products of the
whole [batch, anchors, classes] logits) before its first convolution or matrix gradient. The
executor starts every branch as soon as it can: a detector's box head ran its convolution
gradients (and their scratch) while its class head's focal-loss gradient still held ten
forward values of the logits' size. Each branch's gradient entering its first heavy op (a
convolution, matrix product or einsum gradient) is tried in turn as the one the other
branches' first heavy ops wait for; a try is kept where the step as TensorFlow runs it
(`analysis.as_run`) needs less memory, by a larger share than the share of time it adds
(`planning.as_run`). An FPN/RetinaNet-like step built outside the repo, in mode memory:
0.89x -> 0.73x of its original's peak measured, bitwise.

Only control edges are added: no number changes, and an edge whose target is an ancestor of its
source (a cycle) is never added.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import networkx as nx

from ..analysis.flops import CONVOLUTIONS
from ..analysis.step import Analysis
from ..core.graph import Graph
from ..planning.as_run import as_run
from .base import PassOptions, PassResult

__all__ = ["HEAVY", "TRIES", "TailsFirstOptions", "TailsFirstResult", "run"]

log = logging.getLogger(__name__)

# The convolutions' gradients and the matrix products: what a branch's backward pass starts with.
HEAVY = frozenset({op for op in CONVOLUTIONS if "Backprop" in op}
                  | {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
TRIES = 8  # branches tried, the first the schedule reaches first: each is a Grappler run


@dataclass(frozen=True)
class TailsFirstOptions(PassOptions):
    pass


@dataclass
class TailsFirstResult(PassResult):
    tails_first: list[str] = field(default_factory=list)  # gradients the other branches wait for


def run(graph: Graph, analysis: Analysis, options: TailsFirstOptions, model=None):
    """Make the other branches' first heavy backward ops wait for the branch gradients whose
    waiting lowers the step's peak as run."""
    if model is None or analysis.split is None:
        return TailsFirstResult(graph, False)
    waits = _tries(graph, analysis)
    if not waits:
        return TailsFirstResult(graph, False)
    best, kept = as_run(model, graph, analysis), []
    for tail, targets in waits:
        trial = graph.copy()
        later = nx.ancestors(trial.nx, tail)  # a kept try's edges can close a cycle here
        for target in targets:
            if target not in later:
                trial.add_control(tail, target)
        cost = as_run(model, trial, analysis)
        log.info("tails_first: %d heavy ops wait for %s: as run %s -> %s", len(targets), tail,
                 best, cost)
        if best is not None and best.better(cost):
            graph, best = trial, cost
            kept.append(tail)
    if not kept:
        return TailsFirstResult(graph, False, note="no branch's heavy backward ops, made to "
                                "wait for another branch's loss gradient, lower the step's "
                                "peak as run")
    return TailsFirstResult(graph, True, tails_first=kept)


def _tries(graph: Graph, analysis: Analysis) -> list[tuple[str, list[str]]]:
    """(gradient, the first heavy ops neither downstream nor upstream of it: an edge into one
    upstream would close a cycle) for each gradient that enters a first heavy backward op (one
    no heavy backward op runs before), in schedule order, at most TRIES of them; none where
    every first heavy op is downstream of one (a single head). A gradient with no such op
    (a chunked loss's blocks, which already run one after the other) is no try: it would
    cost a Grappler run and add nothing."""
    # By data edges from the seeds: gradients, not the recomputed activations the gradient
    # flow gates by control edges, nor `serialize`'s chain of every convolution gradient.
    flow, seeds = analysis.split.gradient_flow, set(analysis.split.seeds)
    gradients: set[str] = set()
    after_heavy: set[str] = set()
    first: list[str] = []
    for name in graph.topological_order():
        if name not in flow:
            continue
        inputs = [r.node for r in graph.data_inputs(name)]
        if name not in seeds and not any(node in gradients for node in inputs):
            continue
        gradients.add(name)
        if any(node in after_heavy for node in inputs):
            after_heavy.add(name)
        elif graph.op(name) in HEAVY:
            first.append(name)
            after_heavy.add(name)
    if len(first) < 2:
        return []
    position = {name: i for i, name in enumerate(analysis.memory.order)}
    entering = sorted({r.node for h in first for r in graph.data_inputs(h)
                       if r.node in gradients},
                      key=lambda n: (position.get(n, len(position)), n))
    tries = []
    for tail in entering:
        downstream = nx.descendants(graph.nx, tail)
        upstream = nx.ancestors(graph.nx, tail)
        targets = [h for h in first if h not in downstream and h not in upstream]
        if targets:  # never all of them: the gradient enters one
            tries.append((tail, targets))
        if len(tries) == TRIES:
            break
    return tries
