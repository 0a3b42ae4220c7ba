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

Only values computed from resource-variable reads are deferred: a ref variable's `Identity`
aliases a buffer that an in-place update may change, so reading it later could read another
value. A backward value outside the flow is deferred only outside v1 loops (inside a v1
cond's branch too: what it waits for is outside every branch, so it fires whichever branch
runs), and never a stateful op; nothing waits for a value inside a v1 loop's frame (a gradient
loop's accumulator zeros made to wait for the weight gradient they meet: TensorFlow refused the
step, its frames mismatched).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
from .pads import can_gate
from .triggers import FORWARDING_OPS

__all__ = ["REF_VARIABLE_OPS", "EMPTY_ON_GPU", "DeferOptions", "DeferResult", "run"]

REF_VARIABLE_OPS = frozenset({"VariableV2", "Variable"})
# The types `Empty` has GPU kernels for (TensorFlow's inplace_ops.cc): another would be placed
# on the host, and copied to the device.
EMPTY_ON_GPU = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF,
                          types_pb2.DT_BFLOAT16, types_pb2.DT_INT32, types_pb2.DT_INT64})


@dataclass(frozen=True)
class DeferOptions(PassOptions):
    min_bytes: int = 64 * 1024  # smaller values are not worth a control edge


@dataclass
class DeferResult(PassResult):
    deferred: list[str] = field(default_factory=list)  # values made to wait for a gradient


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
    if not deferrable:  # the usual case outside training steps: no note, modes run it always
        return DeferResult(graph, False)
    original, graph, deferred = graph, graph.copy(), []
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
    return DeferResult(graph, bool(deferred), shapes=analysis.shapes, deferred=sorted(deferred))


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
    """Whether a control input would change what Grappler makes of `name`: a Pow (the
    arithmetic optimizer expands a tanh-GELU's forward `x ** 3` into products, one of which
    common subgraph elimination then shares with the backward pass's `x ** 2`, but not with one
    waiting on a control edge: a BERT step's weights 7e-9 apart)."""
    return graph.op(name) == "Pow"
