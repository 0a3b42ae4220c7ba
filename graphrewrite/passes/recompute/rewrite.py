"""The recompute pass's rewrite: copy what a plan recomputes, rewire the gradient flow to the
copies, gate them with triggers (see the package's docstring)."""

from __future__ import annotations

import networkx as nx

from ...analysis.split import reachable
from ...core.graph import Graph
from ...core.names import AHEAD_SUFFIX, COPY_SUFFIX
from ...core.tensor_ref import TensorRef
from ...planning import plan_nodes, search
from ...planning.context import Context
from ..triggers import add_triggers, keep_fusable

__all__ = ["apply", "SHAPE_READERS"]


def apply(ctx: Context, checkpoints: set[str], ahead: frozenset = frozenset(),
          executor_gates: bool = False, reuse: bool = False) -> search.Rewrite:
    """Copy what the gradient flow reads between `checkpoints`, rewire it, add the triggers
    (with `executor_gates`, those for copies read late too: `triggers.py`).
    The checkpoints in `ahead` are not kept from the forward pass but recomputed too (see
    `_recompute_ahead`); with `reuse`, the ahead pass's values serve the segment
    back-propagation reaches first (`_reuse_ahead`)."""
    graph = ctx.graph.copy()
    split = ctx.analysis.split
    flow = split.gradient_flow
    # only what can be copied is recomputed ahead: a fed input (a U-Net's per-pixel labels)
    # stays the one its feed fills
    ahead = frozenset(n for n in ahead if ctx.blocker(n) is None)
    blocked: dict[str, set[str]] = {}
    recomputed, recomputable = plan_nodes.recomputed_nodes(ctx, checkpoints, blocked)
    order = ctx.order()  # the copy's, as nothing was added yet
    copies = _copy(graph, recomputed, order, COPY_SUFFIX)
    segments = plan_nodes.segments(ctx, set(copies))
    _mirror_waits(graph, copies, segments)
    backward = split.backward
    # The backward values outside the flow that it reads (shape readers aside: see the
    # package's docstring) read the copies too: a tanh-GELU's gradient `x ** 2` is the product
    # Grappler shares with the forward `x ** 3` (a BERT step rounded otherwise when it read the
    # original and the copy expanded its own), and it no longer lives from the forward pass
    # to its reader.
    early_values = {n for n in ctx.early_values() if graph.op(n) not in SHAPE_READERS}
    for name, copy in copies.items():
        for ref in ctx.analysis.shapes.outputs(name):
            readers = [v for v, _ in graph.consumers(ref) if v in flow or v in early_values
                       or _gated_shape_reader(graph, v, backward)]
            graph.replace_uses(ref, TensorRef(copy, ref.port), readers)
    writers, after_writes = ctx.ref_writers()
    ref_reads = {n for n in copies if any(r.node in writers for r in graph.data_inputs(n))}
    # A trigger waits on what the step runs: waiting on a gradient Grappler would prune (with
    # respect to a GELU's constant 1) keeps it, and its input then has one reader more, which
    # MinimizeBroadcasts groups otherwise (a Keras transformer's weights 1.5e-8 apart).
    waitable = flow & ctx.needed()
    triggers, gate_of, ungated = add_triggers(graph, ctx.graph, copies, segments,
                                              waitable - after_writes if ref_reads else waitable,
                                              order, executor_gates, ctx.loops_back())
    early = _recompute_ahead(graph, ctx, ahead, copies, gate_of, recomputable, order)
    for made in (copies, early):
        _before_ref_writes(graph, writers, made)
    reuse = reuse and _reuse_ahead(graph, ctx, copies, early,
                                   _first_reached(ctx, segments, set(early)))
    made = [*copies.items(), *early.items()]  # an original may have both copies
    gates = keep_fusable(graph, ctx.graph, made)
    shapes = ctx.analysis.shapes.with_copies(made, gates)
    return search.Rewrite(graph, set(checkpoints), copies, triggers, ungated, blocked, shapes,
                   ahead=early, ahead_checkpoints=frozenset(ahead), reuse=reuse)


def _copy(graph: Graph, names: set[str], order: list[str], suffix: str) -> dict[str, str]:
    """Copy `names` as `<name><suffix>`, in `order`, each copy reading the copies of its inputs
    (the suffix keeps each copy where its original sorts by name, see `names.py`)."""
    copies = {}
    for name in (n for n in order if n in names):
        copies[name] = graph.copy_node(name, graph.unique_name(name + suffix), copies)
    return copies


def _mirror_waits(graph: Graph, copies: dict[str, str], segments: list[set[str]]) -> None:
    """Each copy waits for the copies of what its original waits for by a control edge within
    its segment. A diet pass's dequantization of a weight waits for the activation its reader
    multiplies, so only a few weights are float32 at a time; its copy, waiting on the
    segment's trigger alone, would dequantize every weight of the segment when the
    recomputation starts (a dieted ResNet-50: the last stage's 21 MiB of kernels at once, at
    the peak). Within one segment the copies mirror the original's acyclic edges; across
    segments a wait could close a cycle through the triggers."""
    for segment in segments:
        for name in segment:
            for before in graph.control_inputs(name):
                if before in segment:
                    graph.add_control(copies[before], copies[name])


def _before_ref_writes(graph: Graph, writers: dict, copies: dict[str, str]) -> None:
    """A copied read of a ref variable (a dieted weight's `Cast`, `Context.copyable_parameters`)
    reads the variable when it runs, so it must run before the step writes the variable: each
    of the variable's `writers` waits for it (its trigger waits on no node after a write)."""
    for name, copy in copies.items():
        for ref in graph.data_inputs(name):
            for writer in writers.get(ref.node, ()):
                graph.add_control(copy, writer)


def _recompute_ahead(graph: Graph, ctx, ahead, copies, gate_of, recomputable, order) -> dict:
    """Checkpoints recomputed ahead of their segments: instead of holding them from the forward
    pass, copy them (with what lies between them and the kept checkpoint below) and run the
    copies when back-propagation reaches the first segment reading any of them; the copies and
    the gradient flow read the recomputed values, the forward pass the originals, which die
    early. Two-level recomputation: at the price of one more forward pass over that part, the
    early layers' checkpoints are not held while the backward pass works through the later
    ones. Returns original -> copy."""
    if not ahead:
        return {}
    flow = ctx.analysis.split.gradient_flow
    early = _copy(graph, plan_nodes.ahead_members(ctx, ahead, recomputable), order, AHEAD_SUFFIX)
    _mirror_waits(graph, early, plan_nodes.segments(ctx, set(early)))
    copy_names = set(copies.values())
    for name in ahead:
        for ref in ctx.analysis.shapes.outputs(name):
            readers = [v for v, _ in graph.consumers(ref) if v in flow or v in copy_names]
            graph.replace_uses(ref, TensorRef(early[name], ref.port), readers)
    chains = nx.Graph()
    chains.add_nodes_from(early.values())
    chains.add_edges_from((r.node, c) for c in early.values() for r in graph.data_inputs(c)
                          if r.node in chains)
    position = {n: i for i, n in enumerate(graph.topological_order())}
    for chain in nx.connected_components(chains):
        downstream = reachable(graph.nx, chain)
        gates = {gate_of[v] for c in chain for v in graph.successors(c) if v in gate_of}
        gates = sorted((g for g in gates if g not in downstream), key=position.get)
        if gates:  # the segment back-propagation reaches first; it cannot depend on the chain
            for root in chain:
                if not any(r.node in chain for r in graph.data_inputs(root)):
                    graph.add_control(gates[0], root)
    return early


def _first_reached(ctx, segments: list[set[str]], early: set[str]) -> set[str]:
    """The nodes that both the ahead pass and a recomputed segment compute, in the segment
    back-propagation reaches first among those the ahead pass covers (the highest in the
    forward order), for each group of ahead copies. The ahead pass computes that segment's
    nodes just before back-propagation needs them (only the layers between the highest
    checkpoint recomputed ahead and the held one above it run in between): recomputing them
    once more then is a third forward pass over that part (a 3-layer transformer: a fifth
    of the step's FLOPs for no byte saved)."""
    if not early:
        return set()
    position = {n: i for i, n in enumerate(ctx.order())}
    reused = set()
    for chain in plan_nodes.segments(ctx, early):
        covering = [s for s in segments if not s.isdisjoint(chain)]
        if covering:
            top = max(covering, key=lambda s: max(position[n] for n in s))
            reused |= top & chain
    return reused


def _reuse_ahead(graph: Graph, ctx, copies: dict[str, str], early: dict[str, str],
                 reused: set[str]) -> bool:
    """The readers of the copies of `reused` (`_first_reached`) read the ahead copies instead,
    and those copies are removed (and leave `copies`); False (nothing changed) when there are
    none, or when a reader lies upstream of what the ahead pass waits for (the rewired graph
    would have a cycle). The ahead copies are then held from the ahead pass until that
    segment's back-propagation, a little longer than its own copies would be: whether the
    peak allows it is for the planner to simulate (`search.decide`)."""
    removed = {copies[n] for n in reused}
    readers = {v for n in reused for v in graph.successors(copies[n])} - removed
    if not reused or not reachable(graph.nx, readers).isdisjoint(early.values()):
        return False
    for name in sorted(reused):
        copy, ahead = copies.pop(name), early[name]
        for ref in ctx.analysis.shapes.outputs(name):
            moved = TensorRef(copy, ref.port)
            graph.replace_uses(moved, TensorRef(ahead, ref.port),
                               [v for v, _ in graph.consumers(moved)])
        for after in graph.successors(copy):  # what waited for the copy waits for `ahead`
            if copy in graph.control_inputs(after):
                node = graph.node_def(after)
                inputs = [r for r in graph.inputs(after) if not (r.is_control and r.node == copy)]
                if after not in removed and ahead not in graph.control_inputs(after):
                    inputs.append(TensorRef(ahead, -1))
                graph.redefine(after, node.op, inputs, dict(node.attr))
    for copy in removed:
        graph.remove_node(copy)
    return True


# Ops that read only their input's shape.
SHAPE_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _gated_shape_reader(graph: Graph, name: str, backward) -> bool:
    """A backward node that reads only shapes and waits on control inputs (see the module's
    docstring)."""
    return (name in backward and graph.op(name) in SHAPE_READERS
            and bool(graph.control_inputs(name)))
