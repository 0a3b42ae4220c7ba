"""Everything the planner and `inspect` know about a model: shapes, split, memory, FLOPs.

Analyses only read the graph. `analyse` runs them in order, once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import flops as flops_mod
from . import memory, shapes as shapes_mod, split as split_mod
from .errors import GraphRewriteError
from .graph import Graph
from .io import Model

log = logging.getLogger(__name__)


@dataclass
class Analysis:
    fetches: list[str]
    shapes: shapes_mod.Shapes
    split: split_mod.Split
    memory: memory.MemoryReport
    flops: int


def default_fetches(model: Model) -> list[str]:
    """What one training step fetches: a MetaGraphDef's `train_op` (and `losses`) collections,
    else every sink of the graph."""
    graph = model.graph
    meta = model.meta_graph
    if meta is not None and "train_op" in meta.collection_def:
        names = list(meta.collection_def["train_op"].node_list.value)
        if "losses" in meta.collection_def:
            names += list(meta.collection_def["losses"].node_list.value)
        found = [n.split(":")[0].lstrip("^") for n in names]
        if all(n in graph for n in found):
            return list(dict.fromkeys(found))
    return [n for n in graph.nodes() if graph.nx.out_degree(n) == 0]


def analyse(model: Model, graph: Graph | None = None, input_shapes: dict | None = None,
            backward_scope: str | None = None, fetches: list[str] | None = None) -> Analysis:
    """Shapes, forward/backward split, simulated step memory and FLOPs of `graph`."""
    graph = graph or model.graph
    fetches = fetches or default_fetches(model)
    missing = [f for f in fetches if f.split(":")[0] not in graph]
    if missing:
        raise GraphRewriteError(f"output '{missing[0]}' is not a node of the graph")
    fetch_nodes = list(dict.fromkeys(f.split(":")[0] for f in fetches))
    shapes = shapes_mod.infer(graph, input_shapes)
    split = split_mod.split(graph, backward_scope)
    report = memory.simulate(graph, shapes, fetch_nodes)
    total = flops_mod.total_flops(graph, shapes, report.order)
    if report.unknown:
        log.warning("%d tensors have an unknown size and count 0 bytes (e.g. %s); fix input "
                    "dimensions with --input-shape", len(report.unknown),
                    ", ".join(str(r) for r in report.unknown[:3]))
    return Analysis(fetch_nodes, shapes, split, report, total)
