"""Inline pass: splice in the function calls that hold a step's forward and backward passes.

A `tf.function` called inside a differentiated `tf.function` step (a model's forward pass
wrapped in its own `tf.function`) exports as a call of its forward function and a call of its
backward function: to every analysis each is one node, so there is nothing to recompute or swap.
Inlined (`inline.inline_gradient_calls`), the step is what TensorFlow runs anyway: its function
inlining at session start does the same, and the two steps stay bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import inline
from ..analysis.step import Analysis
from ..core.graph import Graph
from .base import PassOptions, PassResult

__all__ = ["InlineOptions", "InlineResult", "run"]


@dataclass(frozen=True)
class InlineOptions(PassOptions):
    pass


@dataclass
class InlineResult(PassResult):
    inlined: list[str] = field(default_factory=list)  # function calls spliced in


def run(graph: Graph, analysis: Analysis, options: InlineOptions, model=None):
    """Inline the calls of gradient-carrying functions and of those whose results they read.
    Without a function library there is no call to inline: the graph is not converted to a
    GraphDef to find none (a second on a 100k-node graph)."""
    if not graph.shell.library.function:
        return InlineResult(graph, False)
    found = inline.inline_gradient_calls(graph.to_graph_def())
    if found is None:
        return InlineResult(graph, False)
    inlined, calls = found
    return InlineResult(Graph.from_graph_def(inlined), True, inlined=calls)
