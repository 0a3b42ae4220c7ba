"""Apply-early pass: each parameter's update runs before the backward pass goes on.

The executor runs an optimizer's update when its inputs exist and a thread is free; nothing makes
it run before the next layer's backward. A Keras optimizer in a TF2 step writes each update as a
dozen element-wise kernels (centered RMSprop: `rho * v`, `g * g`, ... each a weight-sized
temporary), and a weight's gradient lives until its update has read it. When each update runs is
the executor's choice, which the memory model can only guess: on a deep MLP built outside the repo
(12 x 1024 units, centered RMSprop, batch 256), after `defer`, it modelled 256 MiB as run against
190 measured; with the waits below, 190 modelled and 194 measured (the original: 274).

So the stages of the update, in the order the memory model computes the gradients, each wait for
the one before: the readers of the gradient a stage starts from (the layer's incoming gradient: its
weight and input gradients read it alike) take control inputs from the previous stage's writes. A
stage is the update of one or more parameters that start from the same gradients, found by
structure: a node belongs to parameter p's update when every write of a parameter it leads to
(through data edges, and a write's control edges) is p's, p being a variable the loss is computed
from (a slot's write leads to its parameter's, which reads the slot after it). A TF2 tape's
`IdentityN` over every gradient is bypassed first, as Grappler does. Where a stage's update depends
on a later gradient (clipping by the global norm: every update reads the norm of all gradients) a
wait would be a cycle and is not added; a step training a convolution gets none
(`FILTER_GRADIENTS`). Only the order changes: bitwise. The waits are kept where the step as
TensorFlow runs it (`step.as_run`) needs no more memory with them, within the model's error
(`WITHIN`): a GAN's step, whose two optimizers' backward passes the memory model interleaves,
modelled 0.72x without them and 0.95x with them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import networkx as nx

from ..analysis import parameters, schedule, state, step
from ..analysis import split as split_mod
from ..analysis.split import reachable
from ..core.graph import Graph
from ..core.tensor_ref import CONTROL, TensorRef
from .base import PassOptions, PassResult
from .pads import GROUPED_OPS

# A step training a convolution gets no waits: its weights are small beside its activations, so
# an early update frees little, and on two TF2 CNN steps the waits measured 8-17% higher
# (ResNet-50: 443 -> 481 MiB; MobileNetV2: 367 -> 430, and leaving out only the waits around
# its kernels' updates modelled higher still), on TF1 CNNs and a U-Net no lower.
FILTER_GRADIENTS = frozenset({"Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter",
                              "Conv3DBackpropFilterV2"})

# How far the waits may raise the modelled peak as run and be kept: the model's mean error over
# 60 measured steps (2.9%). Two TF2 MLPs and a TF2 GPT decoder built outside the repo modelled
# 1.7-2.1% higher with them and measured 1-8% lower (an MLP: 220 against 240 MiB).
WITHIN = 0.03

log = logging.getLogger(__name__)

__all__ = ["ApplyEarlyOptions", "ApplyEarlyResult", "MANY", "variable_writes", "update_of",
           "stages", "bypass_identities", "run", "WITHIN", "FILTER_GRADIENTS"]

MANY = "*"  # a node leading to the updates of several parameters: the backward pass


@dataclass(frozen=True)
class ApplyEarlyOptions(PassOptions):
    pass


@dataclass
class ApplyEarlyResult(PassResult):
    # parameters whose updates the backward pass now waits for
    applied_early: list[str] = field(default_factory=list)


def variable_writes(graph: Graph, names) -> dict[str, str]:
    """Each node in `names` that writes a variable (its first input), with that variable."""
    found = {}
    for name in names:
        op = graph.op(name)
        if op.startswith(state.WRITES) or "Scatter" in op:
            inputs = graph.data_inputs(name)
            if inputs and parameters.is_variable(graph, inputs[0].node):
                found[name] = inputs[0].node
    return found


def _join(a, b):
    return b if a is None or a == b else a if b is None else MANY


def update_of(graph: Graph, split, writes: dict[str, str]) -> dict[str, str]:
    """Each gradient-flow node leading to the writes of one parameter's update only: that
    parameter (a variable the loss is computed from; not a slot, nor Adam's `beta1_power`).
    `MANY` for one leading to several. `writes`: the gradient flow's (`variable_writes`)."""
    flow = split.gradient_flow
    loss_inputs = graph.data_ancestors(split.differentiated or split.losses)
    written_parameters = set(writes.values()) & loss_inputs
    owner: dict[str, object] = {}
    for name in reversed(graph.topological_order()):
        if name in flow:
            found = writes.get(name) if writes.get(name) in written_parameters else None
            for reader, edges in graph.succ[name].items():
                # a write's control edges order the reads after it (a slot read by its
                # parameter's update); others only group (TF1's gradient `tuple`, a trigger)
                if name in writes or any(e["port"] != CONTROL for e in edges.values()):
                    found = _join(found, owner.get(reader))
            owner[name] = found
    return {n: p for n, p in owner.items() if p is not None}


def stages(graph: Graph, split, order: list[str]) -> list[tuple[list, list, list[TensorRef]]]:
    """The updates' stages in the order `order` computes them: each its parameters, their writes
    and the backward-pass tensors it starts from. Updates starting from a shared tensor are one
    stage."""
    writes = variable_writes(graph, split.gradient_flow)
    owner = update_of(graph, split, writes)
    entries: dict[str, set[TensorRef]] = {}
    for name, param in owner.items():
        if param != MANY:
            for ref in graph.data_inputs(name):
                if owner.get(ref.node) == MANY:
                    entries.setdefault(param, set()).add(ref)
    links = nx.Graph()  # parameters sharing an entry are one stage
    for param, refs in entries.items():
        links.add_edges_from((param, ref) for ref in refs)
    grouped = [sorted(n for n in part if isinstance(n, str))
               for part in nx.connected_components(links)]
    position = {n: i for i, n in enumerate(order)}
    found = []
    for members in grouped:
        refs = sorted({r for p in members for r in entries[p]})
        stage_writes = sorted(w for w in writes if owner.get(w) in members)
        start = min(position.get(r.node, len(order)) for r in refs)
        found.append((start, stage_writes, members, refs))
    found.sort()
    return [(members, w, refs) for _, w, members, refs in found if w]


def bypass_identities(graph: Graph, flow, fetches) -> int:
    """Make the readers of each gradient-flow `IdentityN` Grappler removes read its inputs (a
    TF2 tape's over every gradient: as a node it waits for all of them, so a wait across it
    would be a cycle). Returns the IdentityNs bypassed."""
    bypassed = schedule.bypassed_identities(
        graph, [n for n in flow if graph.op(n) == "IdentityN"], fetches)
    for identity, inputs in bypassed.items():
        for port, ref in enumerate(inputs):
            graph.replace_uses(TensorRef(identity, port), ref)
    return len(bypassed)


def run(graph: Graph, analysis: step.Analysis, options: ApplyEarlyOptions, model=None):
    """Make the readers of each update stage's starting gradients wait for the writes of the
    stage before (see the module's docstring)."""
    flow = analysis.split.gradient_flow
    if any(graph.op(n) in FILTER_GRADIENTS for n in flow):
        return ApplyEarlyResult(graph, False, note="updates left to run when ready: the step "
                                "trains convolutions")
    original, graph = graph, graph.copy()
    bypass_identities(graph, flow, analysis.fetches)
    found = stages(graph, analysis.split, analysis.memory.order)
    inside = split_mod.loop_frame_nodes(graph) | split_mod.cond_branch_nodes(graph)
    early = []
    for (params, writes, _), (_, _, refs) in zip(found, found[1:]):
        if any(w in inside for w in writes):
            continue
        upstream = reachable(graph.nx, writes, upstream=True)
        readers = sorted({r for ref in refs for r, _ in graph.consumers(ref)
                          if r in flow and r not in inside and r not in upstream
                          and graph.op(r) not in GROUPED_OPS})
        if [(w, r) for w in writes for r in readers if graph.add_control(w, r)]:
            early += params
    if not early:
        return ApplyEarlyResult(original, False)
    if model is not None:
        # both Grappler calls begun at once: the second runs while the first is simulated
        started = [(g, step.start_as_run(model, g, analysis)) for g in (original, graph)]
        before, after = (report and report.allocated_peak() for report in
                         (step.as_run(model, g, analysis, s) for g, s in started))
        if before is not None and after is not None and after > before * (1 + WITHIN):
            log.info("apply_early: the waits raise the peak as run (%d -> %d bytes): not kept",
                     before, after)
            return ApplyEarlyResult(original, False, note="updates left to run when ready: "
                                    "making them wait raised the modelled peak as run")
    return ApplyEarlyResult(graph, True, applied_early=sorted(early))
