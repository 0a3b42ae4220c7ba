"""Triggers of the recompute pass: when each segment of copies may run.

One trigger NoOp per connected segment of copies, deepest segment first. It waits for the
gradient-flow nodes that feed the segment's readers (what back-propagation must have reached),
for every gradient-flow reader of what back-propagation computed before them that they do not
depend on (`Ancestry.readers`: a layer's weight gradient beside its input gradient holds the
large gradient of the layer above until it ends, and a recomputation started before would
overlap it; the model, one node at a time, would not show it), and only for nodes the segment's
copies do not reach, so no cycle can form. In the chosen rewrite (`executor_gates`), copies read
later than their segment's first get triggers of their own (`_gate_late_copies`).

Both questions are answered incrementally, so adding every trigger costs about what the graph's
size does, not that times the number of segments: reachability from the copies on a topological
order kept valid as triggers are added (`topo.TopoOrder`), and the ancestors of the waits as the
previous trigger's ancestors plus what is new (`Ancestry`).

Grappler's remapper fuses a convolution or matrix product with the BiasAdd and activation after
it, and a batch norm with its activation, only when none of them has a control edge; with oneDNN
(TensorFlow's default on x86) the fused kernels round otherwise than the kernels apart (a CPU
without AVX-512: a first layer's kernel 1.9e-9 apart after two steps, a DenseNet's weights 2e-7).
A gated copy of such a chain therefore waits through an Identity on its first node's input
instead (`keep_fusable`), and is fused as its original is.
"""

from __future__ import annotations

from tensorflow.core.framework import attr_value_pb2

from ..analysis.split import reachable
from ..core.graph import Graph
from ..core.names import GATE_PREFIX, TRIGGER_PREFIX
from ..core.tensor_ref import CONTROL, TensorRef
from ..core.topo import TopoOrder
from .pads import can_gate

__all__ = ["FORWARDING_OPS", "CHAIN_OPS", "add_triggers", "chain_root", "keep_fusable",
           "Ancestry"]

FORWARDING_OPS = ("Identity", "IdentityN", "Snapshot")
CHAIN_OPS = ("Mul", "Add", "AddV2")  # what MinimizeBroadcasts regroups
# What the remapper fuses (tensorflow/core/grappler/optimizers/remapper.cc), each part without
# control edges: a contraction, then a bias and an activation; a batch norm and its activation.
# (Each has its first input's type as attribute T, which the gate's Identity takes.)
HEAD_OPS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul", "BatchMatMul",
                      "BatchMatMulV2", "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
EPILOGUE_OPS = frozenset({"BiasAdd", "Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid"})


def add_triggers(graph: Graph, original: Graph, copies: dict[str, str], segments, flow,
                 order: list[str], executor_gates: bool, loops_back: bool):
    """One trigger per segment of `copies` (original -> copy; `segments`: sets of originals;
    `loops_back`: whether the graph has v1 loop back edges). Returns the triggers with their
    waits, each gated copy's trigger, and the segments that got none (each by its first
    original)."""
    position = {n: i for i, n in enumerate(order)}
    components = sorted((sorted(c, key=position.get) for c in segments),
                        key=lambda c: position[c[0]], reverse=True)
    all_copies = set(copies.values())
    late = [copies[n] for n in order if n in copies]
    reach = _Reach(graph, None if loops_back else TopoOrder.build(graph, order, late))
    ancestry = Ancestry(graph, original, flow, all_copies)
    triggers, gate_of, ungated = {}, {}, []
    for component in components:
        members = {copies[n] for n in component}
        targets = {v for c in members for v in graph.successors(c) if v not in all_copies}
        inputs = {r.node for refs in graph.data_inputs_of(targets).values() for r in refs
                  if r.node in flow}
        inputs -= reach.reaching(members, inputs)
        waits = {_wait_of(graph, n, flow) for n in inputs}
        # In every candidate, not only the chosen one: without these waits the model ranks
        # ResNet-50's candidates differently (TF2 step: 0.47x -> 0.57x measured).
        waits = sorted(waits | _unfinished(graph, ancestry, reach, members, waits))
        if not waits:
            ungated.append(component[0])
            continue
        roots = [copies[n] for n in component
                 if not any(r.node in copies for r in original.data_inputs(n))]
        trigger = _add_trigger(graph, reach, component[0], waits, roots)
        ancestry.advance(trigger)
        triggers[trigger] = waits
        gate_of.update(dict.fromkeys(members, trigger))
        if executor_gates:
            triggers.update(_gate_late_copies(graph, original, ancestry, reach,
                                              {copies[n]: n for n in component}, all_copies,
                                              flow, set(waits)))
    return triggers, gate_of, ungated


def _gate_late_copies(graph: Graph, original: Graph, ancestry, reach, members: dict[str, str],
                      all_copies: set[str], flow, segment_waits: set[str]):
    """Triggers for the copies of a segment that back-propagation reads later than its first:
    each waits for the gradients its readers read, as the segment's roots do. Without them
    the executor computes the whole segment as soon as the roots' trigger fires, beside the
    large gradient of the layer above (the model's one-at-a-time schedule would not show it).
    A group of copies is only given the waits it does not reach, checked on the graph as it
    grows, so no cycle can form. `members`: copy -> its original (not read from the copy's
    name: in a graph rewritten before, `unique_name` gives the copy a suffix `_1`). Returns
    the new triggers with their waits."""
    groups: dict[tuple, list[str]] = {}
    for copy, source in members.items():
        if chain_root(original, source):
            continue
        targets = {v for v in graph.successors(copy) if v in flow and v not in all_copies}
        waits = {_wait_of(graph, r.node, flow) for t in targets for r in graph.data_inputs(t)
                 if r.node in flow and r.node not in all_copies} - segment_waits
        if waits:
            groups.setdefault(tuple(sorted(waits)), []).append(copy)
    triggers = {}
    for waits, gated in groups.items():
        waits = {w for w in waits if can_gate(original, w)}
        waits -= reach.reaching(gated, waits)
        waits = sorted(waits | _unfinished(graph, ancestry, reach, gated, waits))
        if waits:
            triggers[_add_trigger(graph, reach, gated[0], waits, gated)] = waits
    return triggers


def chain_root(original: Graph, name: str) -> bool:
    """Whether Grappler's arithmetic optimizer regroups the chain of `name`'s op that ends at
    `name` (MinimizeBroadcasts: a Mul of a Mul read nowhere else, also through an Identity
    Grappler removes; a dieted batch-norm scale's dequantization times `Rsqrt`). It leaves a
    chain whose root has a control input as it is, so a gated copy would round differently
    from its original."""
    op = original.op(name)
    if op not in CHAIN_OPS or original.control_inputs(name):
        return False
    for ref in original.data_inputs(name):
        source = ref.node
        while original.op(source) == "Identity" and original.nx.out_degree(source) == 1:
            source = original.data_inputs(source)[0].node  # a ref variable's `read`: removed
        if original.op(source) == op and original.nx.out_degree(source) == 1:
            return True
    return False


def keep_fusable(graph: Graph, original: Graph, copies) -> dict[str, TensorRef]:
    """Take the control inputs a rewrite gave the copies (`copies`: (original, copy) pairs) of
    a chain Grappler fuses off the chain: an epilogue copy's go to the chain's first copy above
    it (the first output of each read by the next alone), and a first copy's to a kept Identity
    of its first input, which it reads instead. Only where the original has no control input
    (else it is not fused either). No cycle can form: the new waits are made by nodes that
    already waited on them, one step further up a chain. Returns each Identity added with the
    tensor it forwards."""
    source_of = {copy: name for name, copy in copies}

    def added(copy: str) -> list[str]:
        return [] if original.control_inputs(source_of[copy]) else graph.control_inputs(copy)

    for copy in sorted(c for c in source_of if graph.op(c) in EPILOGUE_OPS and added(c)):
        top = copy
        while graph.op(top) in EPILOGUE_OPS:
            above = graph.data_inputs(top)[0].node
            if above not in source_of or len(graph.consumers(TensorRef(above))) != 1 \
                    or original.control_inputs(source_of[above]):
                break
            top = above
        if graph.op(top) in HEAD_OPS and top != copy:
            for wait in _drop_controls(graph, copy):
                graph.add_control(wait, top)
    gates = {}
    for copy in sorted(c for c in source_of if graph.op(c) in HEAD_OPS and added(c)):
        read = graph.data_inputs(copy)[0]
        waits = _drop_controls(graph, copy)
        gate = graph.add_node(
            graph.unique_name(GATE_PREFIX + copy), "Identity",
            [read] + [TensorRef(w, CONTROL) for w in waits],
            {"T": graph.node_def(copy).attr["T"],
             "_grappler_do_not_remove": attr_value_pb2.AttrValue(b=True)},
            device=graph.node_def(copy).device)
        graph.replace_uses(read, TensorRef(gate), [copy])
        gates[gate] = read
    return gates


def _drop_controls(graph: Graph, name: str) -> list[str]:
    """Take `name`'s control inputs away; returns them."""
    waits = graph.control_inputs(name)
    node = graph.node_def(name)
    graph.redefine(name, node.op, graph.data_inputs(name), dict(node.attr))
    return waits


def _add_trigger(graph: Graph, reach, name: str, waits: list[str], gated: list[str]) -> str:
    """A NoOp `graphrewrite/recompute_trigger/<name>` waiting on `waits`, which `gated` wait on."""
    trigger = graph.add_node(graph.unique_name(TRIGGER_PREFIX + name), "NoOp",
                             [TensorRef(w, CONTROL) for w in waits],
                             device=graph.node_def(gated[0]).device)
    reach.place_after(trigger, waits)
    for node in gated:
        graph.add_control(trigger, node)
        reach.add_edge(trigger, node)
    return trigger


def _unfinished(graph: Graph, ancestry, reach, copies, waits) -> set[str]:
    """The gradient-flow readers of what back-propagation computed before `waits` that `waits`
    do not depend on and `copies` do not reach (waiting on them would be a cycle); not
    Identities (see `_wait_of`), not nodes a new control output would change Grappler's
    rewrites of (`pads.can_gate`), and not readers that only feed other such readers (a
    Reshape before the MatMul)."""
    readers = ancestry.readers(waits)
    readers -= reach.reaching(copies, readers)
    return {v for v in readers if not any(s in readers for s in graph.succ[v])}


def _wait_of(graph: Graph, name: str, flow) -> str:
    """The node a trigger waits on for `name`: `name`, or, when it only forwards a value, the
    gradient-flow node whose value it forwards. Grappler's dependency optimizer removes an
    Identity only while its inputs times its readers are at most their sum; a trigger reading
    it would keep it (and a tf.tuple's control_dependency Identity is what the gradient flow
    reads), so its readers would keep a data input instead of the control input the original
    forwards to them, which MinimizeBroadcasts then groups differently (issue 14)."""
    while graph.op(name) in FORWARDING_OPS:
        inputs = [r.node for r in graph.data_inputs(name)[:1] if r.node in flow]
        if not inputs:
            break
        name = inputs[0]
    return name


class _Reach:
    """Which nodes a set of copies reaches: on the kept topological order, or (graphs with
    loop back edges) by walking all they reach."""

    def __init__(self, graph: Graph, order: TopoOrder | None):
        self.graph, self.order = graph, order

    def reaching(self, sources, asked) -> set[str]:
        if self.order is None:
            return reachable(self.graph.nx, sources).intersection(asked)
        return self.order.reaching(sources, asked)

    def place_after(self, name: str, before) -> None:
        if self.order is not None:
            self.order.place_after(name, before)

    def add_edge(self, u: str, v: str) -> None:
        if self.order is not None:
            self.order.add_edge(u, v)


class Ancestry:
    """The ancestors of the last trigger, through the gradient flow, copies and triggers, and
    the gradient-flow nodes outside them that read them (their frontier). Back-propagation
    reaches segments in turn, so the next segment's waits usually depend on the last trigger:
    their ancestors are then the last trigger's plus the few nodes in between, found without
    walking the rest again. Where they do not, everything is walked, as before."""

    def __init__(self, graph: Graph, original: Graph, flow, copies: set[str]):
        self.graph, self.original = graph, original
        self.pred, self.succ = graph.pred, graph.succ
        self.flow, self.copies = flow, copies
        self.closed: set[str] = set()    # the last trigger and all its ancestors
        self.frontier: set[str] = set()  # flow nodes outside `closed` reading flow nodes in it
        # that a trigger may wait on
        self.last: str | None = None
        self.gateable: dict[str, bool] = {}  # reader -> `_can_wait_on` it, found once

    def readers(self, waits) -> set[str]:
        """The frontier of the ancestors of `waits` (themselves included)."""
        new, met = self._walk(waits, self.closed)
        if met:
            return (self.frontier - new) | self._readers(new, new, self.closed)
        everything, _ = self._walk(waits, ())
        return self._readers(everything, everything)

    def advance(self, trigger: str) -> None:
        """Make `trigger`, just added, the last trigger."""
        new, met = self._walk([trigger], self.closed)
        if met:
            self.closed |= new
            self.frontier = (self.frontier - new) | self._readers(new, self.closed)
        else:
            self.closed, _ = self._walk([trigger], ())
            self.frontier = self._readers(self.closed, self.closed)
        self.last = trigger

    def _walk(self, starts, known) -> tuple[set[str], bool]:
        """The ancestors of `starts` not in `known` (a set closed under ancestors), and whether
        the walk met the last trigger (then the ancestors are those plus `known`)."""
        pred, flow, copies, last = self.pred, self.flow, self.copies, self.last
        found, met = set(), False
        stack = [s for s in starts if s not in known]
        met = any(s == last for s in starts)
        while stack:
            name = stack.pop()
            if name in found:
                continue
            found.add(name)
            for p in pred[name]:
                if p in found or not (p in flow or p in copies or p.startswith(TRIGGER_PREFIX)):
                    continue
                if p in known:
                    met = met or p == last
                else:
                    stack.append(p)
        return found, met

    def _readers(self, nodes, outside, also_outside=()) -> set[str]:
        """The gradient-flow nodes, not copies, outside `outside` and `also_outside` that read
        a gradient-flow node of `nodes` and that a trigger may wait on (`_can_wait_on`)."""
        flow, copies = self.flow, self.copies
        return {v for a in nodes if a in flow for v in self.succ[a] if v in flow
                and v not in outside and v not in also_outside and v not in copies
                and self._can_wait_on(v)}

    def _can_wait_on(self, name: str) -> bool:
        """Not an Identity (see `_wait_of`) nor a node a new control output would change
        Grappler's rewrites of (`pads.can_gate`). Readers that may not be waited on stay
        out of the frontier: a frozen graph's fetched gradient Identities would otherwise
        pile up in it, one per layer, and every trigger would walk them all."""
        found = self.gateable.get(name)
        if found is None:
            found = self.gateable[name] = (self.graph.op(name) not in FORWARDING_OPS
                                           and can_gate(self.original, name))
        return found
