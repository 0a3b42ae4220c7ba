"""Forward dequantizing reads gated or not: both orders built and priced as `optimize` reports
the step (Grappler, then the allocator model), the lower kept (see the package's docstring)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...analysis import bind, memory
from ...analysis import shapes as shapes_mod
from ...analysis import step as analysis_mod
from ...analysis.schedule import needed_nodes
from ...analysis.split import reachable
from ...analysis.step import Analysis, AnalysisOptions
from ...core.graph import Graph
from ...core.tensor_ref import TensorRef
from .options import VIEW_OPS

__all__ = ["ReadsChoice", "choose_reads"]

log = logging.getLogger(__name__)


@dataclass
class ReadsChoice:
    kept: str                 # "gated" or "ungated"
    peaks: list[int]          # as run, [gated, ungated] allocator bytes; empty: not priced
    shapes: object = None     # the kept graph's Shapes, when inferred to price it


def choose_reads(graph: Graph, firsts: dict[str, str], analysis: Analysis | None,
                 model=None, order: str = "priced") -> tuple[Graph, ReadsChoice]:
    """`graph` with its forward dequantizing reads (`firsts`, see `_gate_reads`) gated or not:
    as `order` says, or ("priced") whichever step peaks lower as run: each order through
    Grappler, then simulated and replayed through the allocator model, as `optimize` reports
    the step (`analysis.as_run`; as written where Grappler fails). Gated wins ties, and is
    kept unpriced without a model to price with. Neither order changes a value, only when the
    copies are made."""
    if order == "ungated":
        return graph, ReadsChoice("ungated", [])
    gated = graph.copy()
    if not _gate_reads(gated, firsts):
        return graph, ReadsChoice("ungated", [])
    if order == "gated":
        return gated, ReadsChoice("gated", [])
    if model is None or analysis is None or analysis.memory is None:
        log.info("diet: forward reads gated (not priced: no model of the step)")
        return gated, ReadsChoice("gated", [])
    inputs = _input_shapes(graph, analysis.shapes, analysis.fetches)
    shapes = shapes_mod.infer(graph, inputs)  # the orders differ by control edges only
    device = _device(graph, analysis)
    found = Analysis(analysis.fetches, shapes, analysis.split, None, 0,  # what as_run reads
                     options=AnalysisOptions(inputs, analysis.fetches, device=device))
    reports = [analysis_mod.as_run(model, g, found) for g in (gated, graph)]
    how = "as run"
    if None in reports:  # Grappler refused one: both as written, to compare like with like
        reports = [memory.simulate(g, shapes, analysis.fetches, device) for g in (gated, graph)]
        how = "as written"
    peaks = [r.allocated_peak() for r in reports]
    kept = "ungated" if peaks[1] < peaks[0] else "gated"
    log.info("diet: forward reads %s: the step peaks at %.1f MiB gated, %.1f MiB ungated "
             "(modelled %s, allocator included)", kept, peaks[0] / 2**20, peaks[1] / 2**20, how)
    return (graph if kept == "ungated" else gated), ReadsChoice(kept, peaks, shapes)


def _device(graph: Graph, analysis: Analysis) -> str | None:
    """The `device` the analysis was simulated for, as far as its report tells: None (the
    graph's own placement decides, as by default) when that agrees with it, else the kind it
    implies."""
    if analysis.memory.accelerator == memory.cpu_is_host(graph):
        return None
    return "gpu" if analysis.memory.accelerator else "cpu"


def _input_shapes(graph: Graph, shapes, fetches: list[str]) -> dict[str, tuple]:
    """The placeholder shapes the analysis was made with where they are not the placeholder's
    own (`--input-shape`), so the rewritten step is priced at the same size; only placeholders
    the fetches need (Grappler prunes the others, and a shape given for a missing node is an
    error)."""
    out = {}
    for name in needed_nodes(graph, fetches):
        node = graph.node_def(name)
        if node.op not in ("Placeholder", "PlaceholderV2") or "shape" not in node.attr \
                or bind.is_resource_placeholder(node):
            continue
        info = shapes[TensorRef(name)] if shapes is not None else None
        if info is None or info.shape is None or None in info.shape:
            continue
        own = node.attr["shape"].shape
        if own.unknown_rank or tuple(d.size for d in own.dim) != tuple(info.shape):
            out[name] = tuple(info.shape)
    return out


def _gate_reads(graph: Graph, firsts: dict[str, str]) -> int:
    """Make each dequantization (`firsts`: the dequantized value -> its first op) wait for the
    other inputs of the ops that read it. A dequantization of a constant or of a variable has
    no input from the step, so the executor runs it when the step starts: every weight would
    be a float32 copy at once, beside its 16-bit form, until its forward use (a frozen
    ResNet-50 modelled 1.4x its original; a 64x64 ResNet-50 training step measured a fall of
    71% of the bytes saved). Gated, each lives from its reader's input to its reader. Gates
    are inputs computed from the step's data placeholders (not a TF2 step's captured
    variables) that the first op does not reach, checked as the gates are added (so no
    cycle), not placeholders; readers are found through views (a frozen variable's
    Identity). Returns the number of gates added."""
    placeholders = [n for n in graph.nodes() if graph.op(n) in bind.PLACEHOLDERS
                    and not bind.is_resource_placeholder(graph.node_def(n))]
    dependent = reachable(graph.nx, placeholders)
    added = 0
    for name, first in firsts.items():
        views, readers, todo = {name}, set(), [name]
        while todo:
            for user, slot in graph.consumers(TensorRef(todo.pop())):
                if slot is None or slot < 0:
                    continue
                if graph.op(user) in VIEW_OPS and slot == 0 and user not in dependent:
                    if user not in views:
                        views.add(user)
                        todo.append(user)
                else:
                    readers.add(user)
        if not readers:
            continue
        downstream = reachable(graph.nx, [first])
        # A placeholder is no gate: it is there when the step starts, and a control edge
        # from it is not remapped where the step is imported onto other inputs (tf2.rewrite).
        gates = {ref.node for user in readers for ref in graph.data_inputs(user)
                 if ref.node in dependent and ref.node not in downstream
                 and graph.op(ref.node) not in bind.PLACEHOLDERS}
        for gate in sorted(gates):
            graph.add_control(gate, first)
        added += len(gates)
    return added
