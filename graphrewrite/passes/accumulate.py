"""Accumulate pass: sum many gradient contributions into one buffer as they arrive.

An AddN (or AccumulateNV2) holds every input until the last one exists. As a chain of AddV2
nodes, each contribution is added, and freed, as soon as it and the running sum exist; an
element-wise op writes into its dying input, so the chain accumulates in place. The chain adds
in the order Grappler's AddN would (its common-subexpression pass sorts the inputs of commutative
ops by name) and groups them as TensorFlow's AddN kernel does (`aggregate_ops.cc`): the first
`n % 8` inputs (8 or 9 where that leaves under 2) left to right, then each next 8 summed left to
right on their own and that sum added to the total (`out += in1 + ... + in8`). So the sum is
bitwise the same; a single chain of 20 terms (an unrolled LSTM's weight gradient) was not. The
last link keeps the AddN's name: its readers are unchanged.

Each link but the last drives a control edge into a guard NoOp of its own, which nothing
fetches and so never runs: Grappler's AddOpsRewrite skips nodes that drive a control
dependency, so it does not fold the chain back into an AddN. One guard for every link did not
do: the dependency optimizer dropped the edges each later link implies, and AddOpsRewrite folded
the freed links (an unrolled LSTM's bias gradient, 30 terms, then differed by 2e-9).

A sum that is part of a tree of sums (a term another sum's alone, or its value read by one sum
alone) stays: AddOpsRewrite folds the original's tree into one AddN of all its leaves, which a
chain over the sum's own terms does not add in the same order (a WGAN-GP's critic kernel
gradient, `AddN(AddN(...), a, b)`, differed by 2e-4 after two steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorflow.core.framework import attr_value_pb2

from ..analysis.step import Analysis
from ..core.graph import Graph
from ..core.names import ACCUMULATE_GUARD_SUFFIX, ACCUMULATE_SUFFIX
from ..core.tensor_ref import CONTROL, TensorRef
from .base import PassOptions, PassResult

__all__ = ["SUMMING_OPS", "KERNEL_WIDTH", "AccumulateOptions", "AccumulateResult", "run",
           "kernel_groups"]

SUMMING_OPS = ("AddN", "AccumulateNV2")
KERNEL_WIDTH = 8  # inputs TensorFlow's AddN kernel sums in one expression


@dataclass(frozen=True)
class AccumulateOptions(PassOptions):
    min_inputs: int = 3  # a sum of two holds nothing back
    # only sums whose terms hold at least this share of the modelled peak (mode memory: those
    # that matter, an unrolled LSTM's weight gradient; a GAN's small sums changed how Grappler
    # fused the step, a capsule network's rounded differently)
    min_share: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "min_inputs", max(2, self.min_inputs))


@dataclass
class AccumulateResult(PassResult):
    accumulated: list[str] = field(default_factory=list)  # AddN nodes now running sums
    terms: int = 0


def run(graph: Graph, analysis: Analysis, options: AccumulateOptions, model=None):
    """Replace every AddN/AccumulateNV2 with at least `min_inputs` inputs by a running sum."""
    sums = [n for n in graph.nodes() if graph.op(n) in SUMMING_OPS
            and len(graph.data_inputs(n)) >= options.min_inputs and not _in_a_tree(graph, n)]
    if options.min_share and analysis is not None:
        least = options.min_share * analysis.memory.peak()
        sums = [n for n in sums if sum(analysis.shapes.nbytes(r) or 0
                                       for r in graph.data_inputs(n)) >= least]
    if not sums:  # in mode memory (a share asked for) the usual case: nothing to say
        return AccumulateResult(graph, False, note="" if options.min_share else
                                f"no AddN or AccumulateNV2 with {options.min_inputs}+ inputs")
    terms = sum(len(graph.data_inputs(n)) for n in sums)
    graph = graph.copy()
    for name in sums:
        _chain(graph, name)
    return AccumulateResult(graph, True, accumulated=sums, terms=terms)


def kernel_groups(count: int) -> list[int]:
    """The sizes of the groups TensorFlow's AddN kernel sums `count` inputs in, in order: each
    group left to right, the first one the running total, each later one added to it whole."""
    head = count % KERNEL_WIDTH
    head = min(count, head + KERNEL_WIDTH if head < 2 else head)
    return [head] + [KERNEL_WIDTH] * ((count - head) // KERNEL_WIDTH)


def _in_a_tree(graph: Graph, name: str) -> bool:
    """Whether the sum `name` is part of a tree of sums Grappler folds into one AddN."""
    def only_reader(node: str) -> str | None:
        readers = {u for u, slot in graph.consumers(TensorRef(node)) if slot is not None
                   and slot >= 0}
        return readers.pop() if len(readers) == 1 else None

    adds = (*SUMMING_OPS, "AddV2", "Add")
    reader = only_reader(name)
    return (reader is not None and graph.op(reader) in adds) or any(
        graph.op(r.node) in adds and only_reader(r.node) == name
        for r in graph.data_inputs(name))


def _chain(graph: Graph, name: str) -> None:
    node = graph.node_def(name)
    terms = sorted(graph.data_inputs(name), key=str)
    waits = [TensorRef(c, CONTROL) for c in graph.control_inputs(name)]
    attrs = {"T": attr_value_pb2.AttrValue(type=node.attr["T"].type)}
    links: list[str] = []
    additions = len(terms) - 1

    def add(left: TensorRef, right: TensorRef) -> TensorRef:
        first = [] if links else waits  # the AddN's control inputs: on the first addition
        if len(links) == additions - 1:  # the last addition: the AddN itself
            graph.redefine(name, "AddV2", [left, right] + first, attrs)
            return TensorRef(name)
        link = graph.add_node(graph.unique_name(f"{name}{ACCUMULATE_SUFFIX}_{len(links) + 1}"),
                              "AddV2", [left, right] + first, attrs, node.device)
        links.append(link)
        return TensorRef(link)

    def summed(group: list[TensorRef]) -> TensorRef:
        total = group[0]
        for term in group[1:]:
            total = add(total, term)
        return total

    start, total = 0, None
    for size in kernel_groups(len(terms)):
        group = summed(terms[start:start + size])
        total = group if total is None else add(total, group)
        start += size
    if not links:
        return
    keep = {"_grappler_do_not_remove": attr_value_pb2.AttrValue(b=True)}
    for link in links:
        graph.add_node(graph.unique_name(link + ACCUMULATE_GUARD_SUFFIX), "NoOp",
                       [TensorRef(link, CONTROL)], keep, node.device)
