"""Accumulate pass: sum many gradient contributions into one buffer as they arrive.

An AddN (or AccumulateNV2) holds every input until the last one exists. As a chain of AddV2
nodes, each contribution is added, and freed, as soon as it and the running sum exist; an
element-wise op writes into its dying input, so the chain accumulates in place. The chain adds
in the order Grappler's AddN would (its common-subexpression pass sorts the inputs of commutative
ops by name), and TensorFlow's AddN kernel adds its inputs one after another, left to right, so
the sum is bitwise the same. The last link keeps the AddN's name: its readers are unchanged.

A guard NoOp, which nothing fetches and so never runs, takes a control edge from every other
link: Grappler's AddOpsRewrite skips nodes that drive a control dependency, so it does not fold
the chain back into an AddN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorflow.core.framework import attr_value_pb2

from ..analysis.step import Analysis
from ..core.graph import Graph
from ..core.names import ACCUMULATE_GUARD_SUFFIX, ACCUMULATE_SUFFIX
from ..core.tensor_ref import CONTROL, TensorRef
from .base import PassOptions, PassResult

__all__ = ["SUMMING_OPS", "AccumulateOptions", "AccumulateResult", "run"]

SUMMING_OPS = ("AddN", "AccumulateNV2")


@dataclass(frozen=True)
class AccumulateOptions(PassOptions):
    min_inputs: int = 3  # a sum of two holds nothing back

    def __post_init__(self):
        object.__setattr__(self, "min_inputs", max(2, self.min_inputs))


@dataclass
class AccumulateResult(PassResult):
    accumulated: list[str] = field(default_factory=list)  # AddN nodes now running sums
    terms: int = 0


def run(graph: Graph, analysis: Analysis, options: AccumulateOptions, model=None):
    """Replace every AddN/AccumulateNV2 with at least `min_inputs` inputs by a running sum."""
    sums = [n for n in graph.nodes() if graph.op(n) in SUMMING_OPS
            and len(graph.data_inputs(n)) >= options.min_inputs]
    if not sums:
        return AccumulateResult(graph, False, note="no AddN or AccumulateNV2 with "
                                                   f"{options.min_inputs}+ inputs")
    terms = sum(len(graph.data_inputs(n)) for n in sums)
    graph = graph.copy()
    for name in sums:
        _chain(graph, name)
    return AccumulateResult(graph, True, accumulated=sums, terms=terms)


def _chain(graph: Graph, name: str) -> None:
    node = graph.node_def(name)
    terms = sorted(graph.data_inputs(name), key=str)
    waits = [TensorRef(c, CONTROL) for c in graph.control_inputs(name)]
    attrs = {"T": attr_value_pb2.AttrValue(type=node.attr["T"].type)}
    total, links = terms[0], []
    for index, term in enumerate(terms[1:-1], start=1):
        link = graph.add_node(graph.unique_name(f"{name}{ACCUMULATE_SUFFIX}_{index}"), "AddV2",
                              [total, term] + (waits if index == 1 else []), attrs, node.device)
        total = TensorRef(link)
        links.append(link)
    graph.redefine(name, "AddV2", [total, terms[-1]] + ([] if links else waits), attrs)
    if not links:
        return
    keep = {"_grappler_do_not_remove": attr_value_pb2.AttrValue(b=True)}
    graph.add_node(graph.unique_name(name + ACCUMULATE_GUARD_SUFFIX), "NoOp",
                   [TensorRef(link, CONTROL) for link in links], keep, node.device)
