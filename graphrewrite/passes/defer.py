"""Defer pass: compute a large value the backward pass needs, but that does not depend on the
gradient, when the gradient it meets is ready.

Two kinds. An optimizer's update often multiplies a slot by a constant before it meets the
gradient (Keras SGD with momentum: `m * momentum - lr * g`): a value of the parameters alone;
a sparse update writes it to the slot first (TF1 Adam on an embedding: `m.assign(m * beta1)`,
then a scatter-add of the gradient's rows, which waits on that write), and the slot then holds
a new buffer beside the old from the step's start.
And a custom gradient's factors of the forward values (Keras swish's `beta * x` in `1 + beta *
x * (1 - sigmoid)`, EfficientNet's every activation): backward nodes outside the gradient flow
(`Split.early_backward`) that the step runs. The executor computes either as soon as its
inputs exist, at the start of the step or in the forward pass, and holds it until the gradient
arrives: a slot's copy of every slot, an activation-sized tensor per swish. Each such
value of at least `min_bytes` whose readers are all backward nodes is made to wait, by control
inputs, for the gradient-flow values read where its chain of such values meets the gradient
flow: it is computed when it is needed and dies at once (what it reads is held instead, once,
or recomputed). Nothing is copied and no value changes: the same kernel reads the same inputs,
later.

A third kind is a gradient term computed long before the other terms of its sum. A value the
forward pass reads in several places gets the sum of their gradients (`AddN`); where one
term's chain depends on little more than the loss's gradient (a WaveNet's skip connections,
each layer's skip output summed at the end: every layer's skip gradient is ready as soon as
the backward pass starts), the executor computes it at once and holds it until the other term
(the residual path's gradient, layer by layer) arrives: one activation-sized tensor per layer
at the backward pass's start. The chain's first nodes are made to wait for the last term's
producers, so the term is computed when its sum can be; what it reads is held instead (once,
where terms share it). Its twin, the weights' gradient of the same layer, waits with it
(`_siblings`). Kept where the bytes the backward pass holds, summed over the modelled
schedule, go down and the step's peak does not rise.

Only values computed from resource-variable reads are deferred: a ref variable's `Identity`
aliases a buffer that an in-place update may change, so reading it later could read another
value. A backward value outside the flow is deferred only outside v1 loops (inside a v1
cond's branch too: what it waits for is outside every branch, so it fires whichever branch
runs), and never a stateful op; nothing waits for a value inside a v1 loop's frame (a gradient
loop's accumulator zeros made to wait for the weight gradient they meet: TensorFlow refused the
step, its frames mismatched).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import networkx as nx

from tensorflow.core.framework import attr_value_pb2, types_pb2
from tensorflow.python.framework import tensor_util

from ..analysis import memory, parameters
from ..analysis import split as split_mod
from ..analysis.bind import DENSE_WRITES
from ..analysis.split import reachable
from ..analysis.step import Analysis
from ..core import ops
from ..core.graph import Graph
from ..core.tensor_ref import CONTROL, TensorRef
from .base import PassOptions, PassResult
from .pads import GROUPED_OPS, MERGED_OPS, can_gate
from .triggers import FORWARDING_OPS

__all__ = ["REF_VARIABLE_OPS", "EMPTY_ON_GPU", "SUM_OPS", "UNWAITED_OPS", "TERM_TRIES", "POWERS",
           "DeferOptions", "DeferResult", "run"]

log = logging.getLogger(__name__)

REF_VARIABLE_OPS = frozenset({"VariableV2", "Variable"})
# The types `Empty` has GPU kernels for (TensorFlow's inplace_ops.cc): another would be placed
# on the host, and copied to the device.
EMPTY_ON_GPU = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF,
                          types_pb2.DT_BFLOAT16, types_pb2.DT_INT32, types_pb2.DT_INT64})


@dataclass(frozen=True)
class DeferOptions(PassOptions):
    min_bytes: int = 64 * 1024  # smaller values are not worth a control edge
    terms: bool = True  # also the early terms of gradient sums (the third kind)


@dataclass
class DeferResult(PassResult):
    deferred: list[str] = field(default_factory=list)  # values made to wait for a gradient
    late_terms: list[str] = field(default_factory=list)  # gradient terms made to wait (heads)


def run(graph: Graph, analysis: Analysis, options: DeferOptions, model=None):
    """Give each large value the backward pass reads before the gradient reaches it the
    gradient-flow inputs of the readers where its chain meets the flow as control inputs (see
    the module's docstring)."""
    flow = analysis.split.gradient_flow
    params = analysis.parameters(graph)
    # backward values outside the flow that the step runs: TF1's gradients also compute some
    # nobody reads (GELU's `x / sqrt(2)` differentiated by its constant), and a deferred one
    # would make the planners think its forward inputs are read late
    needed = reachable(graph.nx, analysis.fetches, upstream=True)
    early = analysis.split.early_backward & needed
    enclosed = split_mod.loop_frame_nodes(graph)
    sets = _Sets(flow, params, early, enclosed, flow | early, params | early)
    deferrable = [n for n in graph.nodes()
                  if _deferrable(graph, analysis, sets, n, options.min_bytes)]
    original, deferred = graph, []
    graph = graph.copy() if deferrable else graph
    for name in deferrable:
        # Checked on the graph as it grows: an earlier deferral may have made a wait depend
        # on this value.
        downstream = reachable(graph.nx, [name])
        met = _meets_flow(graph, name, flow)
        waits = sorted(_gateable(original, {r for v in met for r in graph.data_inputs(v)
                                            if r.node in flow}, flow) - downstream - enclosed)
        reads = _slot_reads(graph, name, params, downstream, needed)
        if not reads and any(graph.op(v) in DENSE_WRITES for v in graph.successors(name)):
            continue  # its reads would be held instead, and the values between
        for wait in waits:
            for later in [name, *reads]:
                graph.add_control(wait, later)
        if waits:
            deferred.append(name)
            _zeros_kept_from_folding(graph, name)
    late, report, graph = _defer_terms(graph, original, analysis, enclosed, options.min_bytes,
                                       bool(deferred)) if options.terms else ([], None, graph)
    if not deferred and not late:  # the usual case outside training steps: no note
        return DeferResult(original, False)
    return DeferResult(graph, True, shapes=analysis.shapes, memory=report,
                       deferred=sorted(deferred), late_terms=late)


SUM_OPS = frozenset({"AddN", "Add", "AddV2"})  # a gradient's sum over the value's readers
# Term heads Grappler regroups or fuses differently with a control input (MinimizeBroadcasts'
# chains, the arithmetic optimizer's Pow) are left to run when ready.
UNWAITED_OPS = GROUPED_OPS | MERGED_OPS | {"Pow"}


def _defer_terms(graph: Graph, original: Graph, analysis: Analysis, enclosed: set[str],
                 min_bytes: int, changed: bool
                 ) -> tuple[list[str], memory.MemoryReport | None, Graph]:
    """Make the early terms of gradient sums wait for their sums' last terms, in a copy of
    `graph`, where that holds less (the module's third kind). Terms are weighed in groups
    reading the same large gradients (a WaveNet's skip terms all read the skip sum's: one term
    alone would hold it longer for less than it frees; all of them hold it once) on the original's
    schedule: the bytes each term holds until its wait, against those its reads then hold
    beyond their last reader. The groups that free more than they hold wait, if the simulated
    step then holds less in its backward pass and peaks no higher. Returns the chain heads
    made to wait, the step simulated with the waits (None when none were kept) and the graph
    (`graph` itself when none were)."""
    flow = analysis.split.gradient_flow
    position = {n: i for i, n in enumerate(analysis.memory.order)}
    freed_at = {b.owner: (len(position) if b.end is None else b.end)
                for b in analysis.memory.buffers}
    groups: dict[frozenset, dict[str, set[str]]] = {}  # large reads -> {head: waits}
    saved: dict[frozenset, int] = {}  # byte-steps the group's terms stop holding
    until: dict[frozenset, int] = {}  # the latest wait of the group
    for total in sorted(n for n in flow if graph.op(n) in SUM_OPS and n not in enclosed):
        terms = [r for r in graph.data_inputs(total) if r.node in flow and r.node in position]
        if len(terms) < 2:
            continue
        last = max(terms, key=lambda r: position[r.node])
        for term in terms:
            if term.node == last.node:
                continue
            chain = _term_chain(graph, term.node, total, flow, enclosed)
            size = max((analysis.shapes.nbytes(r) or 0 for n in chain
                        for r in analysis.shapes.outputs(n)), default=0)
            heads = [n for n in chain if not any(r.node in chain for r in graph.data_inputs(n))]
            if size < min_bytes or not heads or any(_unwaited(graph, h)
                                                    or graph.op(h) in memory.ALIAS_OPS
                                                    for h in heads):
                continue  # (an alias frees nothing: its buffer is what it reads)
            waits = _gateable(original, {last}, flow) - enclosed
            start, wait = min(position[h] for h in heads), max(
                (position.get(w, -1) for w in waits), default=-1)
            if wait <= start or waits & reachable(graph.nx, heads):
                continue  # not computed before the last term, or the last term reads it
            reads = frozenset(_owner(graph, r) for n in chain for r in graph.data_inputs(n)
                              if r.node in flow and r.node not in chain
                              and (analysis.shapes.nbytes(r) or 0) >= min_bytes)
            for head in heads + _siblings(graph, heads, chain, flow, enclosed, waits, position,
                                          wait):
                groups.setdefault(reads, {}).setdefault(head, set()).update(waits)
            saved[reads] = saved.get(reads, 0) + size * (wait - start)
            until[reads] = max(until.get(reads, 0), wait)
    net = {reads: saved[reads] - sum((analysis.shapes.nbytes(r) or 0) * max(
        0, until[reads] - freed_at.get(r, until[reads])) for r in reads) for reads in groups}
    chosen = sorted(r for r in groups if net[r] > 0)
    # those at once; where the simulation refutes that, the groups freeing most one by one
    ranked = sorted(groups, key=lambda r: (-saved[r], sorted(map(str, r))))
    tries = ([chosen] if chosen else []) + [[r] for r in ranked[:TERM_TRIES - 1]
                                            if [r] != chosen]
    device = analysis.options.device
    current, heads = None, []
    for batch in tries:
        waited = graph.copy()
        for reads in batch:
            for head, waits in groups[reads].items():
                for before in sorted(waits):
                    waited.add_control(before, head)
        if not nx.is_directed_acyclic_graph(waited.nx):  # terms waiting on each other's sums
            continue
        if current is None:
            current = memory.simulate(graph, analysis.shapes, analysis.fetches, device) \
                if changed else analysis.memory
        after = memory.simulate(waited, analysis.shapes, analysis.fetches, device)
        held = [_backward_held(report, flow) for report in (current, after)]
        made = sorted(h for reads in batch for h in groups[reads])
        kept = held[1] < held[0] and after.peak() <= current.peak()
        log.info("defer: %d gradient terms made to wait: the backward pass holds %d -> %d "
                 "byte-steps, peak %d -> %d bytes%s", len(made), *held, current.peak(),
                 after.peak(), "" if kept else ": not kept")
        if kept and not set(made) & set(heads):
            current, heads, graph = after, heads + made, waited
            if batch is chosen:
                break
    return sorted(heads), (current if heads and device is None else None), graph


def _unwaited(graph: Graph, name: str) -> bool:
    """Whether a term head is left to run when ready (`UNWAITED_OPS`). A product Grappler's
    arithmetic optimizer can group with nothing groups alike with a control input, and waits:
    no product reads it or is read by it alone (MinimizeBroadcasts' chains), and its sum adds
    something other than a product (so no factor is hoisted out of the sum's terms). An L2
    penalty's gradient `w * 2wd`, read by its weight's gradient sum beside a convolution's
    weight gradient, is one (a ResNet50V2's, 70 MiB held from the backward pass's start)."""
    op = graph.op(name)
    if op != "Mul":
        return op in UNWAITED_OPS
    readers = [reader for reader, _ in graph.consumers(TensorRef(name))]
    if any(graph.op(r.node) == "Mul" and len(graph.consumers(r)) == 1
           for r in graph.data_inputs(name)):
        return True
    return not readers or not all(
        graph.op(reader) in SUM_OPS and any(graph.op(r.node) != "Mul" for r in
                                            graph.data_inputs(reader) if r.node != name)
        for reader in readers)


# Simulations of the step `defer` spends on gradient terms at most: the groups the schedule's
# estimate chooses at once, then, where that holds more, those freeing most one by one (each a
# second or two on a 17k-node DDPM U-Net, whose terms all held more as run).
TERM_TRIES = 3


def _siblings(graph: Graph, heads: list[str], chain: set[str], flow, enclosed: set[str],
              waits: set[str], position: dict[str, int], wait: int) -> list[str]:
    """The twins of the heads that run before the wait: readers of the same gradient that read
    a forward value beside what a head reads outside the flow, one forward node reading both (a
    convolution's weights' gradient reads its input where the input's gradient reads its
    filter). Waiting with the term, a twin reads that forward value when its layer's backward
    pass does (the residual path's weights' gradient reads it then too), so recomputation can
    make it there instead of holding it from the backward pass's start (a WaveNet: 0.65x ->
    0.45x)."""
    found = []
    for head in heads:
        beside = {r for r in graph.data_inputs(head) if r.node not in flow}
        together = {user for r in beside for user, _ in graph.consumers(r)} - {head}
        for ref in {r for r in graph.data_inputs(head) if r.node in flow}:
            for reader, _ in graph.consumers(ref):
                if reader in chain or reader not in flow or reader in enclosed or \
                        position.get(reader, wait) >= wait or \
                        ops.is_stateful(graph.op(reader)) or _unwaited(graph, reader):
                    continue
                forward = {r for r in graph.data_inputs(reader) if r.node not in flow}
                if any(user in together for r in forward for user, _ in graph.consumers(r)) \
                        and not waits & reachable(graph.nx, [reader]):
                    found.append(reader)
    return sorted(set(found))


def _owner(graph: Graph, ref: TensorRef) -> TensorRef:
    """The tensor whose buffer `ref` is, seen through aliases (each layer's `Reshape` of the
    same gradient)."""
    while graph.op(ref.node) in memory.ALIAS_OPS and graph.data_inputs(ref.node):
        ref = graph.data_inputs(ref.node)[0]
    return ref


def _backward_held(report: memory.MemoryReport, flow) -> int:
    """Bytes live on the device summed over the schedule's steps from the backward pass's
    first node on: what held terms cost before recomputation, whose step peaks at the forward
    pass's end (they do not raise it; they raise the backward pass's peak once recomputation
    has dropped the activations, and a term deferred frees its bytes at every step between)."""
    first = next((i for i, n in enumerate(report.order) if n in flow), len(report.order))
    last = len(report.order)
    change: dict[int, int] = {}
    for buffer in report.buffers:
        end = last if buffer.end is None else buffer.end + 1
        if buffer.place != memory.DEVICE or end <= first:
            continue
        start = max(buffer.start, first)
        change[start] = change.get(start, 0) + buffer.size
        change[end] = change.get(end, 0) - buffer.size
    held = live = 0
    steps = sorted(change)
    for step, following in zip(steps, steps[1:]):
        live += change[step]
        held += live * (following - step)
    return held


def _term_chain(graph: Graph, term: str, total: str, flow, enclosed: set[str]) -> set[str]:
    """`term` and the gradient-flow values above it that only it (through one another) reads:
    they run when the term is needed and no other reader waits. A tuple's `NoOp` gate may read
    them too (TF1's gradient tuples): what it gates then waits as well."""
    chain, stack = {term}, [term]
    if term in enclosed or ops.is_stateful(graph.op(term)) or not all(
            r == total or graph.op(r) == "NoOp" for r in graph.successors(term)):
        return set()  # (a term read elsewhere too would hold back its other readers)
    while stack:
        for ref in graph.data_inputs(stack.pop()):
            up = ref.node
            if up in chain or up not in flow or up in enclosed or ops.is_stateful(graph.op(up)):
                continue
            if all(r in chain or r == total or graph.op(r) == "NoOp"
                   for r in graph.successors(up)):
                chain.add(up)
                stack.append(up)
    return chain


def _slot_reads(graph: Graph, name: str, params, downstream: set[str],
                needed: set[str]) -> list[str]:
    """The reads of a slot that `name` is computed from and written back to (`m * beta1` into
    `m`; Keras's `-m * (1 - beta_1)` added to it), through values nothing else reads, when the
    step writes that slot nowhere else before `name`: they wait with it, or they would read
    it at the step's start (a variable a sparse update touches is copied on read) and hold
    the copy, or the values between, until `name` is computed."""
    slots = {graph.data_inputs(w)[0].node for w in graph.successors(name)
             if graph.op(w) in DENSE_WRITES}
    chain, stack, reads = {name}, [name], []
    while slots and stack:
        for ref in graph.data_inputs(stack.pop()):
            value = ref.node
            if value in chain or not all(r in chain or r in downstream
                                         for r in graph.successors(value)):
                continue
            if graph.op(value) == "ReadVariableOp":
                slot = graph.data_inputs(value)[0].node
                if slot in slots and all(u in downstream or graph.op(u) in parameters.READ_OPS
                                         for u in graph.successors(slot) if u in needed):
                    reads.append(value)
            elif value in params and not parameters.is_variable(graph, value):
                chain.add(value)
                stack.append(value)
    return reads


def _zeros_kept_from_folding(graph: Graph, name: str) -> None:
    """Make a deferred `Fill` of zeros an `Empty` initialised to zeros (the same bytes):
    Grappler's constant folding makes a Fill of a known shape and a constant value a `Const`
    (and TensorFlow's own folding one of up to 10 MiB), whose kernel holds its tensor for as
    long as the session runs, so the deferral would move nothing. `Empty` is stateful, which
    neither folds. A v1 cond's gradient keeps such zeros of each activation for the branch not
    taken: most of a Keras learning-phase MobileNetV2's peak."""
    if graph.op(name) != "Fill":
        return
    dims, value = graph.data_inputs(name)
    node = graph.node_def(name)
    if graph.op(value.node) != "Const" or node.attr["index_type"].type != types_pb2.DT_INT32 \
            or node.attr["T"].type not in EMPTY_ON_GPU:
        return
    if tensor_util.MakeNdarray(graph.node_def(value.node).attr["value"].tensor).tobytes().strip(
            b"\0"):
        return
    controls = [TensorRef(c, CONTROL) for c in graph.control_inputs(name)]
    recorded = {key: node.attr[key] for key in ("_output_shapes",) if key in node.attr}
    graph.redefine(name, "Empty", [dims, *controls],  # the Fill's recorded shape: its size
                   {"dtype": node.attr["T"], "init": attr_value_pb2.AttrValue(b=True),
                    **recorded})


def _gateable(original: Graph, waits: set[TensorRef], flow) -> set[str]:
    """The producers of `waits`, each that may not drive a control edge (`pads.can_gate`: a
    Mul Grappler would then no longer group with its reader, which rounds otherwise) replaced
    by the nearest gradient-flow nodes above it that may: the value is then computed a little
    earlier, still after the gradient reaches its layer. Through an `IdentityN` (a TF2 tape's
    over every gradient) only the input of the output read is followed: one gradient, not all."""
    found, stack, seen = set(), list(waits), set(waits)
    while stack:
        ref = stack.pop()
        name = ref.node
        if can_gate(original, name) and original.op(name) not in FORWARDING_OPS:
            found.add(name)
            continue
        inputs = original.data_inputs(name)
        if original.op(name) == "IdentityN":
            inputs = inputs[ref.port:ref.port + 1]
        for up in inputs:
            if up.node in flow and up not in seen:
                seen.add(up)
                stack.append(up)
    return found


def _meets_flow(graph: Graph, name: str, flow) -> set[str]:
    """The gradient-flow readers of `name` and of the values outside the flow it reaches."""
    met, seen, stack = set(), {name}, [name]
    while stack:
        for reader in graph.successors(stack.pop()):
            if reader in flow:
                met.add(reader)
            elif reader not in seen:
                seen.add(reader)
                stack.append(reader)
    return met


@dataclass(frozen=True)
class _Sets:
    """The node sets every candidate is checked against, made once per run."""

    flow: frozenset
    params: frozenset
    early: frozenset
    enclosed: set
    backward: frozenset  # flow | early
    sources: frozenset   # params | early


def _deferrable(graph: Graph, analysis: Analysis, sets: _Sets, name: str,
                min_bytes: int) -> bool:
    op = graph.op(name)
    if name in sets.params:
        if parameters.is_variable(graph, name):
            return False
    elif name not in sets.early or name in sets.enclosed or ops.is_stateful(op):
        return False
    if op in memory.ALIAS_OPS or op in parameters.READ_OPS:
        return False
    readers = graph.successors(name)
    if name in sets.params:  # read by the gradient flow, or written to a slot (see above)
        if not readers or not all(v in sets.flow or graph.op(v) in DENSE_WRITES
                                  for v in readers):
            return False
    elif not readers or not all(v in sets.backward for v in readers):
        return False
    size = max((analysis.shapes.nbytes(r) or 0 for r in analysis.shapes.outputs(name)),
               default=0)
    if size < min_bytes or _rewritten_by_grappler(graph, name):
        return False
    upstream = reachable(graph.nx, [name], upstream=True)
    if upstream & sets.flow:  # it already waits for the gradient (a slot read after its update)
        return False
    return not any(graph.op(s) in REF_VARIABLE_OPS for s in upstream & sets.sources)


def _rewritten_by_grappler(graph: Graph, name: str) -> bool:
    """Whether a control input would change what Grappler makes of `name`: a Pow whose base
    another power reads (the arithmetic optimizer expands a tanh-GELU's forward `x ** 3` into
    products, one of which common subgraph elimination then shares with the backward pass's
    `x ** 2`, but not with one waiting on a control edge: a BERT step's weights 7e-9 apart).
    An optimizer's `accum ** -0.5` has no such twin and waits like any slot arithmetic."""
    if graph.op(name) != "Pow" or not graph.data_inputs(name):
        return False
    base = graph.data_inputs(name)[0]
    return any(user != name and graph.op(user) in POWERS for user, _ in graph.consumers(base))


POWERS = frozenset({"Pow", "Square", "Mul"})  # what Grappler's arithmetic optimizer shares
