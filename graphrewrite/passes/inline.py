"""Inline pass: splice in the function calls that hold a step's forward and backward passes.

A `tf.function` called inside a differentiated `tf.function` step (a model's forward pass
wrapped in its own `tf.function`) exports as a call of its forward function and a call of its
backward function: to every analysis each is one node, so there is nothing to recompute or swap.
Inlined (`inline.inline_gradient_calls`), the step is what TensorFlow runs anyway: its function
inlining at session start does the same, and the two steps stay bitwise equal.

With `updates`, the calls that write variables are inlined too, XLA-compiled ones included
(`inline.inline_update_calls`): what diet, which changes the numbers anyway, needs to see a Keras
optimizer's updates as it makes them on a machine with a GPU.
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
    updates: bool = False  # also the calls that write variables, XLA-compiled ones included


@dataclass
class InlineResult(PassResult):
    inlined: list[str] = field(default_factory=list)  # function calls spliced in


def run(graph: Graph, analysis: Analysis, options: InlineOptions, model=None):
    """Inline the calls of gradient-carrying functions and of those whose results they read.
    Without a function library there is no call to inline: the graph is not converted to a
    GraphDef to find none (a second on a 100k-node graph)."""
    if not graph.shell.library.function:
        return InlineResult(graph, False)
    graph_def, calls = graph.to_graph_def(), []
    for inline_some in (inline.inline_gradient_calls,
                        inline.inline_update_calls if options.updates else None):
        found = inline_some(graph_def) if inline_some else None
        if found is not None:
            graph_def, calls = found[0], calls + found[1]
    if not calls:
        return InlineResult(graph, False)
    return InlineResult(Graph.from_graph_def(graph_def), True, inlined=calls)
