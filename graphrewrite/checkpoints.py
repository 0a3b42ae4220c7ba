"""Which forward tensors to keep (checkpoints) and which nodes may be recomputed at all.

Policies are small named functions, as JAX's remat policies are:

- `memory`: bottleneck tensors of the forward pass (every path from the main inputs to the loss
  runs through them), balanced by the bytes the backward pass reads between them. Bottlenecks
  are dominators, found in near-linear time (Cooper, Harvey and Kennedy, via networkx), not by
  the seed's quadratic search; small side inputs (labels, token ids reused as targets, masks)
  cannot hide them (see `bottlenecks`). The policy offers log-spaced counts (sqrt(N) among them),
  spread by bytes and by position; the recompute pass keeps the one whose rewritten graph models
  the lowest peak, then tries dropping the checkpoints live at that peak.
- `speed`: outputs of the expensive ops (MatMul, BatchMatMul, Conv*, Einsum), by op type.
- `collection`: what `--checkpoints` selects, else a MetaGraphDef collection named `checkpoints`.
- `manual`: Grappler's `_recompute_hint` attribute marks the nodes to recompute; the rest is kept.

Never recomputed (they act as checkpoints, and the report says why): inputs, constants and
anything computed only from constants (TensorFlow's constant folding would turn copies into new
constants), variable reads, stateful and random ops (a recomputed dropout mask is a silent wrong
answer), nodes inside v1 while-loop frames, function calls (While, If, PartitionedCall).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from . import ops
from .analysis import Analysis
from .errors import GraphRewriteError
from .graph import Graph
from .memory import needed_nodes
from .selectors import select
from .split import loop_frame_nodes, reachable
from .tensor_ref import TensorRef
from .summary import FUNCTIONAL_CONTROL_OPS, PLACEHOLDER_OPS, V1_LOOP_OPS

EXPENSIVE_OPS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv3D",
    "DepthwiseConv2dNative", "Einsum", "_FusedMatMul", "_FusedConv2D",
})
VARIABLE_READ_OPS = frozenset({"ReadVariableOp", "VariableV2", "Variable", "VarHandleOp",
                               "ResourceGather", "PlaceholderWithDefault"})
CALL_OPS = FUNCTIONAL_CONTROL_OPS | {"PartitionedCall", "StatefulPartitionedCall"}
FLOATING_TYPES = frozenset({1, 2, 14, 19})  # float, double, bfloat16, half
# An activation is "large" when it holds at least this fraction of the largest one: entries and
# bottlenecks must be large, so small side inputs and scalars are neither.
LARGE_FRACTION = 1 / 64


@dataclass
class Context:
    """What the policies and the recompute pass need to know about the graph."""

    graph: Graph
    analysis: Analysis
    constant: frozenset
    in_loop_frame: set[str]
    functions: frozenset = frozenset()
    _blockers: dict = field(default_factory=dict)

    @classmethod
    def build(cls, graph: Graph, analysis: Analysis) -> "Context":
        functions = frozenset(f.signature.name for f in graph.shell.library.function)
        return cls(graph, analysis, analysis.split.constant, loop_frame_nodes(graph), functions)

    def blocker(self, name: str) -> str | None:
        """Why `name` must not be recomputed, or None when copying it is safe."""
        if name not in self._blockers:
            self._blockers[name] = self._find_blocker(name)
        return self._blockers[name]

    def _find_blocker(self, name: str) -> str | None:
        graph = self.graph
        op = graph.op(name)
        functions = self.functions
        if op in PLACEHOLDER_OPS:
            return "graph input"
        if op == "Const":
            return "constant"
        if name in self.constant:
            return "computed from constants only"
        if op in VARIABLE_READ_OPS:
            return "variable read"
        if "Random" in op or op in ("Multinomial", "TruncatedNormal", "RandomShuffle"):
            return "random op"
        if name in self.in_loop_frame or op in V1_LOOP_OPS:
            return "inside a while-loop frame"
        if op in CALL_OPS or op in functions or any(
                v.HasField("func") for v in graph.node_def(name).attr.values()):
            return "function call"
        if ops.is_stateful(op):
            return "stateful op" if ops.op_def(op) is not None else "op unknown to TensorFlow"
        if not self.analysis.shapes.outputs(name):
            return "no outputs"
        return None


# --------------------------------------------------------------------------- policies

def speed_policy(ctx: Context) -> list[set[str]]:
    """Keep the outputs of expensive ops; recompute the cheap rest."""
    graph = ctx.graph
    return [{n for n in ctx.analysis.split.forward if graph.op(n) in EXPENSIVE_OPS}]


def collection_policy(ctx: Context, selectors: str | None, meta_graph=None) -> list[set[str]]:
    """Keep what the selectors (or the MetaGraphDef's `checkpoints` collection) name."""
    if selectors:
        return [set(select(ctx.graph, selectors))]
    if meta_graph is None or "checkpoints" not in meta_graph.collection_def:
        raise GraphRewriteError("mode 'collection' needs --checkpoints SELECTORS, or a "
                                "MetaGraphDef with a 'checkpoints' collection")
    collection = meta_graph.collection_def["checkpoints"]
    names = list(collection.node_list.value) or [
        v.decode() for v in collection.bytes_list.value]
    return [set(select(ctx.graph, ",".join(names)))]


def manual_policy(ctx: Context) -> list[set[str]]:
    """Recompute what carries `_recompute_hint`; keep every other forward node."""
    graph = ctx.graph
    hinted = {n for n in graph.nodes() if "_recompute_hint" in graph.node_def(n).attr}
    return [set(ctx.analysis.split.forward) - hinted]


def memory_policy(ctx: Context) -> list[set[str]]:
    """Candidate checkpoint sets: bottlenecks, about sqrt(N) of them, at a few counts."""
    chain = bottlenecks(ctx)
    if not chain:
        return []
    weights = _bytes_needed_before(ctx, chain)
    counts, k = [], 1.0
    while round(k) <= len(chain):  # log-spaced: sqrt(N) is a guide, the model picks
        if round(k) not in counts:
            counts.append(round(k))
        k *= 1.4
    uniform = list(range(1, len(chain) + 1))  # balance by position instead of by bytes
    unique = []
    for chosen in (frozenset(_balanced(chain, w, k)) for w in (weights, uniform) for k in counts):
        if chosen not in unique:
            unique.append(chosen)
    return [set(c) for c in unique]


POLICIES = {"memory": memory_policy, "speed": speed_policy, "collection": collection_policy,
            "manual": manual_policy}


def bottlenecks(ctx: Context) -> list[str]:
    """Large forward tensors every path from the main inputs to the loss runs through, in order.

    The graph holds the forward nodes that are not constant-valued. A virtual source feeds the
    entries only: large floating-point inputs, and nodes with a large floating-point output
    computed from inputs and constants alone (an embedding lookup of token ids); not labels or
    ids themselves, and not the loss, which reads labels and logits. A small side input (labels, token ids reused as targets, a
    mask) is therefore never reached from the source, and its shortcut to the loss cannot hide
    the bottlenecks. A virtual sink drains every node without forward consumers. The
    bottlenecks are the sink's dominators, kept when their output is large.
    """
    graph, shapes, split = ctx.graph, ctx.analysis.shapes, ctx.analysis.split
    # Only what the loss depends on: side branches (batch-norm moving-average updates,
    # metrics) end elsewhere and must not count as ways around a bottleneck.
    needed = needed_nodes(graph, ctx.analysis.fetches)
    losses = [n for n in split.losses if n in needed] + [
        n for n in ctx.analysis.fetches if n in split.forward]
    towards_loss = reachable(graph.nx, losses, upstream=True) if losses else None
    nodes = [n for n in graph.topological_order() if n in split.forward and n not in ctx.constant
             and (towards_loss is None or n in towards_loss)]
    sizes = {n: max((shapes.nbytes(r) or 0 for r in shapes.outputs(n)), default=0)
             for n in nodes}
    threshold = max(sizes.values(), default=0) * LARGE_FRACTION
    large = {n for n in nodes if sizes[n] > 0 and sizes[n] >= threshold}
    forward = nx.DiGraph()
    forward.add_nodes_from(nodes)
    members = set(nodes)
    for name in nodes:
        forward.add_edges_from((r.node, name) for r in graph.data_inputs(name)
                               if r.node in members)
    source, sink = "graphrewrite:source", "graphrewrite:sink"
    for name in large:
        computed = [r.node for r in graph.data_inputs(name) if r.node not in ctx.constant]
        floating = _is_floating(shapes[TensorRef(name)])
        if floating and (graph.op(name) in PLACEHOLDER_OPS or (computed and all(
                graph.op(n) in PLACEHOLDER_OPS for n in computed))):
            forward.add_edge(source, name)
    if source not in forward:
        return []
    for name in reachable(forward, [source]) - {source}:
        if forward.out_degree(name) == 0:
            forward.add_edge(name, sink)
    dominators = nx.immediate_dominators(forward, source)
    chain, node = [], dominators.get(sink)
    while node is not None and node != source:
        if node in large:
            chain.append(node)
        node = dominators[node]
    position = {n: i for i, n in enumerate(nodes)}
    return sorted(chain, key=position.get)


def _is_floating(info) -> bool:
    return info is not None and info.dtype % 100 in FLOATING_TYPES


def _bytes_needed_before(ctx: Context, chain: list[str]) -> list[int]:
    """For each bottleneck: bytes of forward tensors the backward reads, produced up to it."""
    graph, shapes, flow = ctx.graph, ctx.analysis.shapes, ctx.analysis.split.gradient_flow
    order = graph.topological_order()
    position = {n: i for i, n in enumerate(order)}
    needed = []
    for name in ctx.analysis.split.forward:
        for ref in shapes.outputs(name):
            if any(v in flow for v, _ in graph.consumers(ref)):
                needed.append((position[name], shapes.nbytes(ref) or 0))
    needed.sort()
    weights, total, index = [], 0, 0
    for name in chain:
        while index < len(needed) and needed[index][0] <= position[name]:
            total += needed[index][1]
            index += 1
        weights.append(total)
    return weights


def _balanced(chain: list[str], weights: list[int], count: int) -> list[str]:
    """`count` bottlenecks splitting the cumulative bytes into equal parts."""
    total = weights[-1] or 1
    chosen = []
    for part in range(1, count + 1):
        target = total * part / (count + 1)
        best = min(range(len(chain)), key=lambda i: (abs(weights[i] - target), i))
        if chain[best] not in chosen:
            chosen.append(chain[best])
    return chosen

