"""Reads of a variable that race its update, made to run before it.

A step may read a variable where nothing orders the read against the variable's update: a TF1
summary of a weight (`tf.summary.histogram(v.op.name, v)`) fetched beside the train op, as an
Estimator's summary hook does. Which value it sees is the executor's choice. The original's
schedule reads first (the read is ready when the step starts, the update only at the end of
the backward pass); a rewrite that moves work around can let the update overtake it: an
Estimator-style step built outside the repo had one merged summary in two differ after
`serialize` alone (a weight's histogram read after its `ResourceApplyAdam`). So once any pass
has changed a graph, every reader of a variable the step runs, that no update needs and that
nothing orders, is made to finish before the variable's updates: the value the original read.
A resource variable's read is a snapshot (an update while it is held copies the variable), so
the read is ordered; a ref variable's read (its Identity) is the variable's own buffer, so its
readers are.

Only readers the fetched step runs anyway are ordered (a control edge makes its source run), and
none inside a v1 cond branch or loop frame (dead or repeated there). The pipeline runs this pass
after any other that changed the graph (`pipeline.run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import parameters
from ..analysis.split import in_cond_branch, loop_frame_nodes, reachable
from ..analysis.step import Analysis
from ..core.graph import Graph
from ..core.tensor_ref import TensorRef
from .base import PassOptions, PassResult

__all__ = ["ReadsFirstOptions", "ReadsFirstResult", "run", "order", "WRITE_PREFIXES"]

# Ops that write the variable their first input names (a ref or a resource handle).
WRITE_PREFIXES = ("Apply", "SparseApply", "ResourceApply", "ResourceSparseApply", "Assign",
                  "Scatter", "ResourceScatter")
QUERIES = ("VarIsInitializedOp", "IsVariableInitialized", "VariableShape")
VIEWS = ("Identity", "Snapshot", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
         "EnsureShape")  # a read passed on unchanged: its readers hold the same value
HANDLE_HOPS = ("Identity",)  # a resource handle passed on
REF_VARIABLES = ("VariableV2", "Variable")  # their Identity is a read: its output is the value


@dataclass(frozen=True)
class ReadsFirstOptions(PassOptions):
    pass


@dataclass
class ReadsFirstResult(PassResult):
    reads_first: list[str] = field(default_factory=list)  # readers now before the updates


def run(graph: Graph, analysis: Analysis, options: ReadsFirstOptions, model=None):
    """`order` on a copy of `graph`, for the step that fetches the analysis's fetches."""
    graph = graph.copy()
    ordered = order(graph, analysis.fetches)
    return ReadsFirstResult(graph, bool(ordered), reads_first=ordered)


def order(graph: Graph, fetches: list[str]) -> list[str]:
    """Order each reader of a variable racing its updates (see the module) before them: a
    control edge from the reader to each update the step runs. Returns the readers ordered."""
    needed = reachable(graph.nx, [f.split(":")[0] for f in fetches if f.split(":")[0] in graph],
                       upstream=True)
    touches = {var: _touches(graph, var) for var in parameters.variables(graph)}
    writes = {var: [w for w in found[0] if w in needed] for var, found in touches.items()}
    feeding = reachable(graph.nx, [w for ws in writes.values() for w in ws], upstream=True)
    framed = loop_frame_nodes(graph)
    ordered = []
    for var, (_, reads) in touches.items():
        if not writes[var]:
            continue
        # A resource read is a snapshot (an update while it is held copies the variable); a
        # ref's Identity is the variable's own buffer, read when its readers run.
        readers = {h for r in reads for h in _holders(graph, r)} \
            if graph.op(var) in REF_VARIABLES else set(reads)
        racing = sorted(r for r in readers if r in needed and r not in feeding
                        and r not in framed and not in_cond_branch(graph, r))
        if not racing:  # the usual case: every read feeds an update
            continue
        after = reachable(graph.nx, writes[var])  # what the updates come before
        for reader in racing:
            if reader not in after and any(graph.add_control(reader, write)
                                           for write in writes[var]):
                ordered.append(reader)
    return sorted(set(ordered))


def _touches(graph: Graph, var: str) -> tuple[list[str], list[str]]:
    """(writes, reads) of `var`: the ops writing it and those reading its value; a resource
    handle is followed through Identity hops (a ref's Identity is its value read)."""
    hops = () if graph.op(var) in REF_VARIABLES else HANDLE_HOPS
    writes, reads, frontier, seen = [], [], [var], {var}
    while frontier:
        name = frontier.pop()
        for consumer, slot in graph.consumers(TensorRef(name)):
            if consumer in seen or graph.op(consumer) in QUERIES:
                continue
            seen.add(consumer)
            op = graph.op(consumer)
            if op.startswith(WRITE_PREFIXES) and slot == 0:
                writes.append(consumer)
            elif op in hops:
                frontier.append(consumer)
            else:
                reads.append(consumer)
    return writes, reads


def _holders(graph: Graph, read: str) -> list[str]:
    """The nodes that hold `read`'s value while they run: its readers, past views; the read
    itself when nothing reads it."""
    holders, frontier, seen = [], [read], {read}
    while frontier:
        name = frontier.pop()
        consumers = [c for c, slot in graph.consumers(name) if slot >= 0]
        if not consumers:
            holders.append(name)
        for consumer in consumers:
            if consumer not in seen:
                seen.add(consumer)
                (frontier if graph.op(consumer) in VIEWS else holders).append(consumer)
    return holders
