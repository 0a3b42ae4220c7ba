"""Modes: named rewrite pipelines, and `optimize`, which runs one on a loaded model.

A mode names a pipeline of passes (the grammar of TensorFlow's Graph Transform Tool,
`name(k=v) name2`). Only `none` exists yet: load, check, save, nothing rewritten; it is how a user
checks that a model survives the round trip unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from .errors import GraphError
from .graph import Graph
from .io import Model

MODES: dict[str, str] = {
    "none": "",
}


@dataclass
class OptimizeResult:
    graph: Graph
    mode: str
    pipeline: str
    nodes_before: int
    nodes_after: int
    stats: dict = field(default_factory=dict)


def optimize(model: Model, mode: str) -> OptimizeResult:
    """Run the pipeline of `mode` on a copy of the model's graph and check the result."""
    if mode not in MODES:
        raise ValueError(f"unknown mode '{mode}' (modes: {', '.join(MODES)})")
    graph = copy.deepcopy(model.graph)
    problems = graph.check()
    if problems:
        raise GraphError(f"mode '{mode}' produced an invalid graph: {problems[0]}")
    return OptimizeResult(graph, mode, MODES[mode], len(model.graph), len(graph))
