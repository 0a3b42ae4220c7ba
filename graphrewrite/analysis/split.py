"""Forward/backward split of a training graph, by reachability rather than by name.

TF1 puts gradients under `gradients/`, GradientTape under `gradient_tape/`, Keras and custom code
elsewhere, and the tape's seed (`ones`) sits outside any gradient scope; names do not decide.

1. Anchors: nodes whose op type only ever appears in a backward pass (`ReluGrad`,
   `Conv2DBackpropInput`, `FusedBatchNormGradV3`, ...; else an optimizer's `ResourceApplyAdam`,
   else its writes of computed values to variables).
2. Forward values: what anchors read besides the incoming gradient (`ReluGrad`'s features,
   `FusedBatchNormGrad`'s x and reserve spaces) and everything those depend on.
3. Gradient seeds: ones-valued tensors (`OnesLike`, `Fill(.., 1)`, an all-ones `Const`) computed
   from constants and shapes only, from which an anchor is reachable, and which are not forward
   values (unless none is: a backward pass that computes forward values again). A forward
   constant of ones also reaches the loss, so of two candidates the one that reaches strictly
   more sinks (of all, then of those that depend on the batch) is not a seed. Back-propagation
   starts there.
4. Gradient flow: the seeds and everything reachable from them. These run in backprop order.
5. Forward: what the losses and the forward values depend on, minus the gradient flow; the losses
   being what the seeds were shaped after plus the sinks outside the gradient flow.
6. Backward: the rest, i.e. the gradient flow plus the backward nodes that read only forward values
   (shape computations, activation masks), which TensorFlow runs as soon as their inputs exist.

`backward_scope` overrides the search: the nodes under that name prefix seed the gradient flow.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import networkx as nx
import numpy as np
from tensorflow.core.framework import attr_value_pb2

from ..core import dtypes, ops
from ..core.errors import GraphRewriteError
from ..core.graph import Graph, neighbours
from ..core.names import MICRO_BATCH_GATE_PREFIX
from ..core.tensor_ref import TensorRef

__all__ = ["FORWARD_INPUTS", "UPDATE_PREFIXES", "VARIABLE_WRITES", "SHAPE_OPS", "FED_OPS",
           "no_backward_pass", "unfetched_backward", "CALL_OPS", "xla_calls", "xla_compiled",
           "computes_a_value", "fed_by", "SOURCE_INPUT_OPS", "is_gradient_op", "is_update_op",
           "anchors", "backward_functions", "Split", "split", "find_seeds", "reachable",
           "loop_frame_nodes", "cond_branch_nodes", "in_cond_branch", "untaken", "enclosed",
           "constant_valued", "fed_inputs"]

# Op type -> indices of inputs that are forward values (not the incoming gradient or a shape).
FORWARD_INPUTS = {
    "ReluGrad": (1,), "Relu6Grad": (1,), "EluGrad": (1,), "SeluGrad": (1,),
    "LeakyReluGrad": (1,), "SoftplusGrad": (1,), "SoftsignGrad": (1,),
    "TanhGrad": (0,), "SigmoidGrad": (0,), "RsqrtGrad": (0,), "SqrtGrad": (0,),
    "ReciprocalGrad": (0,), "InvGrad": (0,),
    "BiasAddGrad": (), "BiasAddGradV1": (), "AvgPoolGrad": (), "AvgPool3DGrad": (),
    # A filter gradient reads the forward input first, but a transposed convolution's (its
    # forward op is Conv2DBackpropInput) reads the incoming gradient there: neither counts.
    "Conv2DBackpropInput": (1,), "Conv2DBackpropFilter": (),
    "Conv3DBackpropInputV2": (1,), "Conv3DBackpropFilterV2": (),
    "DepthwiseConv2dNativeBackpropInput": (1,), "DepthwiseConv2dNativeBackpropFilter": (0,),
    "FusedBatchNormGrad": (1, 2, 3, 4), "FusedBatchNormGradV2": (1, 2, 3, 4),
    "FusedBatchNormGradV3": (1, 2, 3, 4, 5),
    "MaxPoolGrad": (0, 1), "MaxPoolGradV2": (0, 1), "MaxPool3DGrad": (0, 1),
    "LRNGrad": (1, 2),
}
OUTPUT_OPS = frozenset({"Identity", "IdentityN"})  # a sink of these is what a step returns
UPDATE_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")
VARIABLE_WRITES = frozenset({"AssignVariableOp", "AssignSubVariableOp", "AssignAddVariableOp",
                             "Assign", "AssignSub", "AssignAdd"})
# Ops through which a constant-valued tensor stays constant-valued even if fed a variable input.
# Ops that report a value (as text, or to a summary) and compute none: a sink of these stands
# for what it reports. An Estimator-style step's merged summary read the loss and the logits,
# and was taken for the loss.
REPORTING_OPS = frozenset({"ScalarSummary", "HistogramSummary", "ImageSummary", "AudioSummary",
                           "AudioSummaryV2", "TensorSummary", "TensorSummaryV2", "MergeSummary",
                           "WriteSummary", "WriteScalarSummary", "WriteHistogramSummary",
                           "PrintV2", "StringFormat", "AsString", "Assert"})
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "OnesLike", "ZerosLike"})
FED_OPS = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "IteratorGetNext"})
SOURCE_INPUT_OPS = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault",
                              "VarHandleOp", "VariableV2", "Variable", "ReadVariableOp"})


def is_gradient_op(op: str) -> bool:
    """An op type that only a backward pass contains."""
    return op in FORWARD_INPUTS or "Backprop" in op or op.endswith(("Grad", "GradV2", "GradV3"))


def is_update_op(op: str) -> bool:
    """An optimizer's fused update (`ResourceApplyAdam`)."""
    return op.startswith(UPDATE_PREFIXES)


def anchors(graph: Graph, constant: set[str] = frozenset()) -> tuple[list[str], bool]:
    """(anchors, whether they are gradient ops): gradient ops, and calls (While, If,
    PartitionedCall) of functions that contain one; in a graph without any (a model of MatMuls
    and composite activations), the optimizer's fused updates, else its writes of computed
    values to variables (a Keras optimizer's `AssignSubVariableOp`; an initialiser writes a
    constant). Never both: clipping's constants of ones reach the updates too."""
    backward = backward_functions(graph.shell.library)
    found, updates, writes = [], [], []
    for name in graph.nodes():
        node = graph.node_def(name)
        if is_gradient_op(node.op) or node.op in backward or backward and any(
                value.func.name in backward for value in node.attr.values()
                if value.HasField("func")):
            found.append(name)
        elif is_update_op(node.op):
            updates.append(name)
        elif node.op in VARIABLE_WRITES and any(
                r.node not in constant for r in graph.data_inputs(name)[1:]):
            writes.append(name)
    return (found, True) if found else (updates or writes, False)


def backward_functions(function_library) -> frozenset:
    """Library functions whose bodies contain gradient ops, directly or through calls."""
    library = {f.signature.name: f for f in function_library.function}
    calls = {name: {n.op for n in f.node_def} | {v.func.name for n in f.node_def
                                                  for v in n.attr.values() if v.HasField("func")}
             for name, f in library.items()}
    found = {name for name, f in library.items() if any(is_gradient_op(n.op) for n in f.node_def)}
    changed = True
    while changed:
        grown = {name for name, callees in calls.items() if callees & found}
        changed = not grown <= found
        found |= grown
    return frozenset(found)


def unfetched_backward(graph: Graph, split_found: "Split", fetches: list[str]) -> str | None:
    """What a pass says when the graph has a backward pass but the step runs none of it: what
    it fetches (its train op) needs no gradient. A Keras optimizer's `minimize` in TF1 graph
    mode can return an op that only counts iterations, its updates left outside it (a Swin-like
    step built outside the repo trained nothing, and mode memory said only that nothing could
    be recomputed). None when the step reaches a seed."""
    needed = reachable(graph.nx, fetches, upstream=True)
    if needed & set(split_found.seeds):
        return None
    written = sorted({graph.data_inputs(n)[0].node for n in needed
                      if graph.op(n) in VARIABLE_WRITES or is_update_op(graph.op(n))})
    shown = ", ".join(written[:3]) + (f", ... ({len(written)} in all)" if len(written) > 3 else "")
    return (f"the step runs no backward pass: what it fetches ({', '.join(fetches[:3])}) needs "
            f"none of the graph's gradients (seed {split_found.seeds[0]})"
            + (f"; it writes only {shown}" if written else "")
            + ": check what the train op runs, or name the step's outputs with --outputs")


def no_backward_pass(graph: Graph) -> str:
    """What a pass says when the split finds no gradient seed: where the backward pass is
    instead, when a function holds one that the passes do not enter: a functional loop's body
    (a loop of training steps, as Keras's `steps_per_execution` writes `model.train_function`,
    or of accumulated micro-batches: a step is what the passes plan) or a call XLA compiles
    (`jit_compile=True`)."""
    backward = backward_functions(graph.shell.library)
    loops = sorted(n for n in graph.nodes() if graph.op(n) in ("While", "StatelessWhile")
                   and graph.node_def(n).attr["body"].func.name in backward)
    compiled = [n for n in xla_calls(graph) if graph.node_def(n).attr["f"].func.name in backward]
    if loops:
        return (f"no backward pass in the step itself: it runs inside loop '{loops[0]}', over "
                "training steps (as Keras's steps_per_execution writes model.train_function) "
                "or over micro-batches whose gradients it accumulates; mode memory runs it one "
                "iteration at a time, but graphrewrite plans a "
                "step's own forward and backward passes, not a loop body's: export one step "
                "(a tf.function over tensors calling model.train_step((x, y))), or unroll the "
                "loop with a Python for")
    if compiled:
        return (f"no backward pass in the step itself: it runs inside '{compiled[0]}', a call "
                "XLA compiles (jit_compile=True), which plans that call's memory itself and "
                "would merge recomputed copies back; graphrewrite leaves it: export the step "
                "without jit_compile to rewrite it")
    return "no backward pass found: nothing to do"


CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})  # calls of a function


def xla_calls(graph: Graph) -> list[str]:
    """Function calls XLA compiles, sorted."""
    library = {f.signature.name: f for f in graph.shell.library.function}
    return sorted(n for n in graph.nodes() if graph.op(n) in CALL_OPS
                  and xla_compiled(graph.node_def(n), library))


def xla_compiled(call, library: dict) -> bool:
    """Whether XLA compiles the call NodeDef `call` (`_XlaMustCompile` on the call or on its
    function in `library`, by name)."""
    function = library.get(call.attr["f"].func.name)
    return any("_XlaMustCompile" in attrs and attrs["_XlaMustCompile"].b
               for attrs in (call.attr, *((function.attr,) if function is not None else ())))


@dataclass(frozen=True)
class Split:
    forward: frozenset
    backward: frozenset
    seeds: tuple          # gradient seed nodes (where back-propagation starts)
    gradient_flow: frozenset
    losses: tuple         # forward nodes the seeds mirror, plus forward sinks
    constant: frozenset   # nodes whose value depends on no input, variable or random draw
    differentiated: tuple = ()  # what the seeds differentiate: the loss, whether fetched or not

    @property
    def early_backward(self) -> frozenset:
        """Backward nodes outside the gradient flow: they run as soon as forward values exist."""
        return self.backward - self.gradient_flow


def split(graph: Graph, backward_scope: str | None = None) -> Split:
    """Classify every node as forward or backward (see the module docstring)."""
    dag = _dag(graph)
    # With loop back edges: loop-carried values flow through them. A graph without any (and
    # without edges from missing nodes) has them all in `dag` already.
    whole = dag.number_of_edges() == graph.nx.number_of_edges() and len(dag) == len(graph.nx)
    full = dag if whole else _dependencies(graph)
    constant = constant_valued(graph, dag)
    data = _data_only(graph, dag)
    if backward_scope:
        seeds = [n for n in graph.nodes() if n.startswith(backward_scope)]
        if not seeds:  # a typo would read as "no backward pass"
            raise GraphRewriteError(f"no node's name starts with ${{backward_scope}} "
                                    f"'{backward_scope}'")
    else:
        seeds = find_seeds(graph, dag, data, constant)
    # Not through a micro-batch's gate: the next micro-batch's forward pass waits for it
    # (`passes.micro_batches`) and is no gradient.
    flow = reachable(full, seeds, stop={n for n in graph.nodes()
                                        if n.startswith(MICRO_BATCH_GATE_PREFIX)})
    sinks = {n for n in graph.nodes() if full.out_degree(n) == 0}
    # A TF2 step returns its loss through an `Identity` that waits on every update by control
    # edges; that output is in the flow, the value it returns is not. Keras's TF1 train
    # function groups its loss with the updates (`group_deps` waits on both by control edges).
    data_full = data if whole else _data_only(graph, full)
    data_flow = reachable(data_full, seeds)
    returned = _returned(graph, sinks & flow - data_flow, flow - data_flow)
    outside = {n for n in sinks | returned if n not in constant} - flow
    # Each seed's loss from its own flow: a GAN's generator loss reads fewer activations than
    # the discriminator's, which depends on the generator's output too.
    flows = [reachable(full, [s]) for s in seeds] if len(seeds) > 1 else [flow]
    candidates = {n for n in _reported(graph, outside) if n not in constant} - flow
    differentiated = (set(_mirrored(graph, seeds)) - flow) or set().union(
        *(_differentiated(graph, data_full, f, candidates) for f in flows))
    losses = differentiated | outside
    forward = reachable(full, (losses | _forward_value_inputs(graph)) - flow, upstream=True) - flow
    backward = set(graph.nodes()) - forward
    return Split(frozenset(forward), frozenset(backward), tuple(sorted(seeds)), frozenset(flow),
                 tuple(sorted(losses)), frozenset(constant), tuple(sorted(differentiated)))


def _returned(graph: Graph, outputs: set[str], waiting: set[str]) -> set[str]:
    """What `outputs` (sinks that wait on the updates) return: their inputs, and through an
    `Identity` or `IdentityN` that waits too, its inputs (a SavedModel's signature returns
    the step's output `Identity` through its call's `IdentityN`: the loss was not found, and
    verify followed the first scalar fetched with a warning)."""
    found, todo, seen = set(), list(outputs), set(outputs)
    while todo:
        for ref in graph.inputs(todo.pop()):
            if ref.is_control and not computes_a_value(graph, ref.node):
                continue
            found.add(ref.node)
            if ref.node in waiting and graph.op(ref.node) in ("Identity", "IdentityN") \
                    and ref.node not in seen:
                seen.add(ref.node)
                todo.append(ref.node)
    return found


def computes_a_value(graph: Graph, name: str) -> bool:
    """A node that computes a value: not a write, an update or a group (nor an unknown op)."""
    op = graph.op(name)
    definition = ops.op_def(op)
    return (op not in VARIABLE_WRITES and op != "NoOp" and not is_update_op(op)
            and definition is not None and bool(definition.output_arg))


def find_seeds(graph: Graph, dag: nx.DiGraph, data: nx.DiGraph, constant: set[str]) -> list[str]:
    """Ones-valued, constant-derived tensors that reach a gradient op and are not forward values.

    Only the last of a chain of such tensors counts (`Fill(shape, Const(1))` is the seed, not its
    `Const(1)`). `dag` and `data` as `split` makes them (`_dag`, `_data_only`): their nodes in
    topological order.
    """
    found, by_gradients = anchors(graph, constant)
    if not found:
        return []
    # By data edges only (`data`: those of `dag`): a rewritten graph's trigger makes a
    # recomputed or swapped-in forward value wait on the gradient flow, which does not make the
    # seed a forward value.
    forward_values = _forward_values(graph, data, constant)
    reaches_anchor = reachable(dag, found, upstream=True)
    ones = [n for n in graph.nodes() if n in reaches_anchor and n in constant
            and _is_ones(graph, n)]
    # A backward pass that computes its forward values again (`tf.recompute_grad`: the
    # recomputation reads the incoming gradient so as to run after it) has the seed upstream of
    # forward values too: then the rules below pick it among all the ones.
    candidates = {n for n in ones if n not in forward_values} or set(ones)
    # Drop each candidate another is reachable from: one pass from the sinks up, not a walk
    # over the whole backward pass per candidate. By data edges: a second optimizer's
    # gradients built under `control_dependencies([first_train_op])` (a GAN's generator step
    # after its discriminator's) wait on the first, seed and all, without being computed from
    # its seed.
    above_candidate: set[str] = set()
    readers = neighbours(data)
    for name in reversed(list(data)):  # `_dag`'s nodes: in topological order
        if any(s in candidates or s in above_candidate for s in readers[name]):
            above_candidate.add(name)
    candidates -= above_candidate
    # A custom gradient's constants of ones (Keras swish's `1 + x * (1 - sigmoid)`) reach the
    # gradient ops below them; the seed reaches them all. By data edges, as below; anchored on
    # the updates, also from a write into the reads ordered after it: a Keras Adam's variable
    # update reads the moments it has just written, and only Adam's own constants (`1 - beta`)
    # reach that update by data edges alone.
    flows = data if by_gradients else _reads_after_writes(graph, data)
    reach = {n: frozenset(nx.descendants(flows, n)) for n in candidates}
    anchored = {n: reach[n].intersection(found) for n in candidates}
    candidates = {n for n in candidates if not any(anchored[n] < anchored[o] for o in candidates)}
    # A constant of ones every reader of which computes with the batch beside it makes forward
    # values: one-hot labels' `on_value` (read with the labels' ids), which reaches the
    # gradients through a cross entropy's backprop, and whose flow the seed joins midway.
    batch = reachable(data, fed_inputs(graph)) if len(candidates) > 1 else set()
    if len(candidates) > 1:
        candidates = _not_labels(graph, candidates, batch, constant) or candidates
    # Clipping's constants, a GAN generator's labels `ones_like(logits)`: they join the seed's
    # flow midway. (Where two join each other, as `tf.compat.v1.losses`' count of ones and the
    # seed do, the rules below decide; a count of ones in the weights' shape makes no scalar
    # seed join its flow.) Asked only of two or more candidates.
    leading = reachable(flows, found, upstream=True) if len(candidates) > 1 else set()
    candidates = _not_joining_a_flow(graph, data, candidates, constant, leading) or candidates
    # A forward constant of ones (a sampled softmax's labels) meets the batch in the forward
    # pass (its cross entropy reads the logits), where the seed's flow has not been; the seed
    # meets it in gradients that read what that constant's flow made (the cross entropy's
    # backprop).
    if len(candidates) > 1:
        met = {n: _batch_met(graph, n, reach[n], constant, leading) for n in candidates}
        candidates = {n for n in candidates if not any(
            met[n] and not met[n] & reach[o] and met[o] & reach[n]
            for o in candidates if o != n)} or candidates
    # A forward constant of ones (a fresh layer-norm scale, GELU's `1 + erf`) reaches the loss
    # as well as every gradient; a seed reaches only gradients. Drop candidates that reach
    # strictly more sinks than another candidate does. By data edges: a TF2 step's output
    # `Identity` waits on every update by a control edge, so every node reaches it that way.
    sinks = {n for n in graph.nodes() if data.out_degree(n) == 0 and n not in constant}
    ends = {n: reach[n] & sinks for n in candidates}
    candidates = {n for n in candidates if not any(ends[o] < ends[n] for o in candidates)}
    # The same over the sinks that depend on the batch: a loss with a second term (an
    # estimator's L2 regularization loss) has the seed reach that term's dead gradients with
    # respect to its constants, which no constant of the first term reaches. Among those that
    # reach such sinks: a GAN's generator loss, from noise drawn in the step, reaches none,
    # and is no second term of the critic's (a WGAN-GP built outside the repo lost the
    # critic's seed so, and its backward pass counted as forward).
    ends = {n: ends[n] & batch for n in candidates}
    candidates = {n for n in candidates
                  if not any(ends[o] and ends[o] < ends[n] for o in candidates)}
    # The same over the sinks a step keeps (writes to variables, its outputs): a loss's own
    # constant of ones (a Keras loss's sample weight, `weighted_loss/Const`) reaches the
    # output and every update; the seed, besides the updates, the dead gradients of a second
    # loss term (the gradient with respect to a mean's count), which the first rule counted.
    kept = {n for n in sinks if ops.is_stateful(graph.op(n)) or graph.op(n) in OUTPUT_OPS}
    ends = {n: reach[n] & kept for n in candidates}
    return sorted(n for n in candidates if not any(ends[o] < ends[n] for o in candidates))


def _forward_values(graph: Graph, data: nx.DiGraph, constant: set[str]) -> set[str]:
    """What the forward values gradient ops read are computed from (by data edges), except the
    condition of a choice between two constants: `tf.recompute_grad` adds
    `where(g == g, 0., nan)` of the incoming gradient `g` to its recomputation's inputs, so that
    it runs after `g`, and the seed upstream of `g` then computes no forward value."""
    up = neighbours(data, upstream=True)
    seen = {n for n in _forward_value_inputs(graph) if n in up}
    stack = list(seen)
    while stack:
        name = stack.pop()
        if graph.op(name) in ("Select", "SelectV2") and all(
                r.node in constant for r in graph.data_inputs(name)[1:]):
            continue
        for other in up[name]:
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return seen


def _batch_met(graph: Graph, start: str, reach: frozenset, constant: set[str],
               leading: set[str]) -> set[str]:
    """The computed values `start`'s flow first meets on the way to an anchor: read by a node of
    `leading` beside a constant-valued value of that flow (or `start`)."""
    met, seen, stack = set(), {start}, [start]
    while stack:
        name = stack.pop()
        for reader in graph.successors(name):
            if reader in seen or reader not in reach or reader not in leading:
                continue
            seen.add(reader)
            values = {r.node for r in graph.data_inputs(reader)}
            if name not in values:
                continue  # a control edge
            computed = {v for v in values if v not in constant and v != start}
            if computed:
                met |= computed
            else:
                stack.append(reader)
    return met


def _not_labels(graph: Graph, candidates: set[str], batch: set[str],
                constant: set[str]) -> set[str]:
    """Candidates some reader of which computes with no value of the batch beside them: a
    seed's readers include its own gradient's first steps (a mean's division by its count, a
    reshape), which read constants and shapes."""
    def made_with_the_batch(name: str) -> bool:
        readers = {r for r, slot in graph.consumers(TensorRef(name)) if slot is not None
                   and slot >= 0}
        return bool(readers) and all(
            any(ref.node != name and ref.node in batch and ref.node not in constant
                for ref in graph.data_inputs(reader)) for reader in readers)

    return {n for n in candidates if not made_with_the_batch(n)}


def _not_joining_a_flow(graph: Graph, data: nx.DiGraph, candidates: set[str],
                        constant: set[str], leading: set[str]) -> set[str]:
    """Candidates that join no other candidate's flow midway: dropped is one whose reader on
    the way to an anchor (in `leading`) another's flow reaches while it is not in that flow
    itself. A seed's reader that leads nowhere (the dead gradient of `compute_average_loss`'s
    `div_no_nan` with respect to its count, which reads the forward sum) does not count, or a
    forward constant of ones (GELU's `1 + erf`) would drop the seed. Clipping's constants of
    ones reach every update as the seed does, but their readers are in the seed's flow; a
    GAN generator's labels are a factor of its loss's gradient (`grad * z`), read where the
    seed's flow has been. A flow follows values, not shapes: it
    does not pass from a computed value into a constant-valued node (`Shape(x)`), so the seed,
    read beside shapes of forward values, stays, and so does an `OnesLike(loss)` seed beside a
    forward constant of ones (which the last rule drops). A constant of several elements makes
    no scalar one join its flow: a masked sequence loss's count of ones (`num_present`, in the
    weights' shape), which its gradient reads beside the scalar loss's seed."""
    readers = neighbours(data)

    def flow(start: str) -> set[str]:
        seen, stack = {start}, [start]
        while stack:
            name = stack.pop()
            for other in readers[name]:
                if other not in seen and (name in constant or other not in constant):
                    seen.add(other)
                    stack.append(other)
        return seen - {start}

    flows = {n: flow(n) for n in candidates}
    scalar = {n: _one_element(graph, n) for n in candidates}
    sinks = {n for n in data if data.out_degree(n) == 0 and n not in constant}

    def backward_only(reader: str, n: str, other: str) -> bool:
        """Whether the values of `other`'s flow that `reader` reads lead to no sink `n`'s
        flow misses. A masked mean's divisor `maximum(count, 1.)` divides the loss too, and
        the seed's first gradient reads it: a forward value, so its constant of ones does not
        drop the (scalar) seed (a seq2seq built outside the repo lost its seed so). Asked of
        one-element candidates only: a GAN's labels `ones_like(logits)` meet the seed's flow
        where it also leads to their own dead gradient."""
        met = [r.node for r in graph.data_inputs(reader) if r.node in flows[other]]
        return all(nx.descendants(data, v) & sinks <= flows[n] for v in met)

    return {n for n in candidates
            if not any(reader in flows[other] and n not in flows[other]
                       and not (scalar[n] and scalar[other] is False)
                       and (not scalar[n] or backward_only(reader, n, other))
                       for reader in readers[n] if reader in leading
                       for other in candidates if other != n)}


def _one_element(graph: Graph, name: str) -> bool | None:
    """Whether constant `name` holds one element (a scalar loss's seed does), None when its
    shape is not recorded."""
    node = graph.node_def(name)
    if node.op == "Const":
        dims = node.attr["value"].tensor.tensor_shape.dim
        return all(d.size == 1 for d in dims)
    if node.op == "Fill":
        dims = graph.data_inputs(name)[0].node
        if graph.op(dims) == "Const":
            from tensorflow.python.framework import tensor_util

            value = graph.node_def(dims).attr["value"].tensor
            return bool(np.prod(tensor_util.MakeNdarray(value)) == 1)
    recorded = node.attr["_output_shapes"].list.shape if "_output_shapes" in node.attr else []
    if len(recorded) == 1 and not recorded[0].unknown_rank:
        sizes = [d.size for d in recorded[0].dim]
        return None if any(d < 0 for d in sizes) else bool(np.prod(sizes) == 1)
    return None


def reachable(graph: nx.DiGraph, sources, upstream: bool = False,
              stop: set[str] = frozenset()) -> set[str]:
    """`sources` and every node reachable from them (downstream, or upstream), in linear time;
    not past the nodes in `stop` (they are reached, what follows them is not)."""
    seen = set(sources)
    stack = [name for name in seen if name not in stop]
    adjacency = neighbours(graph, upstream)
    while stack:
        name = stack.pop()
        try:
            others = adjacency[name]
        except KeyError:
            raise nx.NetworkXError(f"The node {name} is not in the digraph.") from None
        for other in others:
            if other not in seen:
                seen.add(other)
                if other not in stop:
                    stack.append(other)
    return seen


def loop_frame_nodes(graph: Graph) -> set[str]:
    """Nodes inside v1 while-loop frames: reachable from an Enter without passing an Exit."""
    return enclosed(graph, ("Enter", "RefEnter"), ("Exit", "RefExit"))


def cond_branch_nodes(graph: Graph) -> set[str]:
    """Nodes inside v1 cond branches: reachable from a Switch without passing a Merge."""
    return enclosed(graph, ("Switch", "RefSwitch"), ("Merge", "RefMerge"))


_BRANCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def in_cond_branch(graph: Graph, name: str) -> bool:
    """Whether `name` is among `cond_branch_nodes` (found once a graph): its outputs are dead
    when its branch is not taken, and so is whatever waits on it."""
    found = _BRANCHES.get(graph)
    if found is None:
        found = _BRANCHES[graph] = frozenset(cond_branch_nodes(graph))
    return name in found


def untaken(graph: Graph) -> tuple[frozenset, frozenset]:
    """(the nodes a step never runs, the `Switch` outputs it never makes): the sides of v1
    `Switch`es their predicates never take, when the predicate is a constant or a
    `PlaceholderWithDefault` of one (Keras's learning phase, a `tf.compat.v1.layers`
    `is_training`), as `verify` runs it, unfed. A node is dead when an input it reads or waits
    for is (a `Merge` when all it reads are)."""
    switches = [n for n in graph.nodes() if graph.op(n) == "Switch"]
    taken = {}
    for name in switches:
        value = _known_value(graph, graph.data_inputs(name)[1].node)
        if value is not None:
            taken[name] = int(bool(value))
    if not taken:
        return frozenset(), frozenset()
    dead: set[str] = set()
    for name in graph.topological_order():
        op = graph.op(name)
        refs = graph.inputs(name)
        gone = [r.node in dead or (r.node in taken and not r.is_control
                                   and r.port != taken[r.node]) for r in refs]
        if op == "Merge":
            data = [g for r, g in zip(refs, gone) if not r.is_control
                    and not graph.loops_back(r.node)]
            if data and all(data):
                dead.add(name)
        elif any(gone):
            dead.add(name)
    unmade = {TensorRef(name, 1 - port) for name, port in taken.items() if name not in dead}
    return frozenset(dead), frozenset(unmade)


def _known_value(graph: Graph, name: str):
    """The value of a predicate known before the step runs (a scalar constant, or the default
    of an unfed `PlaceholderWithDefault`, through Identities), else None."""
    while graph.op(name) in ("Identity", "PlaceholderWithDefault"):
        name = graph.data_inputs(name)[0].node
    if graph.op(name) != "Const":
        return None
    from tensorflow.python.framework import tensor_util

    value = tensor_util.MakeNdarray(graph.node_def(name).attr["value"].tensor)
    return value.item() if value.size == 1 else None


def enclosed(graph: Graph, begin: tuple[str, ...], end: tuple[str, ...]) -> set[str]:
    """Nodes reachable from a node of an op in `begin` without passing one of an op in `end`
    (both included)."""
    inside, stack = set(), [n for n in graph.nodes() if graph.op(n) in begin]
    while stack:
        name = stack.pop()
        if name in inside:
            continue
        inside.add(name)
        if graph.op(name) not in end:
            stack.extend(v for v in graph.successors(name) if v not in inside)
    return inside


def _dag(graph: Graph) -> nx.DiGraph:
    """Data and control dependencies between real nodes, loop back edges dropped; its nodes in
    topological order (its users walk them so)."""
    order = graph.topological_order()
    position = {n: i for i, n in enumerate(order)}
    dag = nx.DiGraph()
    dag.add_nodes_from(order)
    # Each producer-consumer pair once (`graph.nx.edges()` gives it once per edge), in its order.
    dag.add_edges_from((u, v) for u, readers in graph.succ.items() if u in position
                       for v in readers if v in position and position[u] < position[v])
    return dag


def _dependencies(graph: Graph) -> nx.DiGraph:
    """Data and control dependencies between real nodes, loop back edges included."""
    real = set(graph.nodes())
    full = nx.DiGraph()
    full.add_nodes_from(real)
    full.add_edges_from((u, v) for u, v in graph.nx.edges() if u in real and v in real)
    return full


def _data_only(graph: Graph, edges: nx.DiGraph) -> nx.DiGraph:
    """The data edges among `edges` (control edges dropped)."""
    data = nx.DiGraph()
    data.add_nodes_from(edges)
    among = neighbours(edges)
    # Each pair once, in `graph.nx.edges()`'s order, if one of its edges carries data.
    data.add_edges_from((u, v) for u, readers in graph.succ.items() if u in among
                        for v, keyed in readers.items() if v in among[u]
                        and any(d["slot"] is not None for d in keyed.values()))
    return data


def fed_by(graph: Graph, sources) -> set[str]:
    """What the values of `sources` flow into, by data edges and through the variables they
    are written to and read from again (a Keras loss tracker's mean of the loss)."""
    flows = _reads_after_writes(graph, _data_only(graph, _dag(graph)))
    return reachable(flows, [s for s in sources if s in flows])


def _reads_after_writes(graph: Graph, data: nx.DiGraph) -> nx.DiGraph:
    """`data` with an edge from each variable write into each read of the same variable that
    waits on it by a control edge (automatic control dependencies order them so): the value
    written flows into that read."""
    extra = []
    for name in graph.nodes():
        if graph.op(name) != "ReadVariableOp":
            continue
        handle = graph.data_inputs(name)[0].node
        extra += [(write, name) for write in graph.control_inputs(name)
                  if (graph.op(write) in VARIABLE_WRITES or is_update_op(graph.op(write)))
                  and graph.data_inputs(write)[:1] and graph.data_inputs(write)[0].node == handle]
    if not extra:
        return data
    flows = data.copy()
    flows.add_edges_from(extra)
    return flows


def _forward_value_inputs(graph: Graph) -> set[str]:
    nodes = set()
    for name in graph.nodes():
        indices = FORWARD_INPUTS.get(graph.op(name))
        if indices:
            inputs = graph.data_inputs(name)
            nodes.update(inputs[i].node for i in indices if i < len(inputs))
    return nodes


def constant_valued(graph: Graph, dag: nx.DiGraph | None = None) -> set[str]:
    """Nodes whose value does not depend on any input, variable or random draw (shapes of inputs
    are fine: they are static). `dag`: as `_dag` makes it (its nodes in topological order)."""
    dag = dag if dag is not None else _dag(graph)
    constant = set()
    for name in dag:
        op = graph.op(name)
        if op in SOURCE_INPUT_OPS or (op != "Const" and ops.is_stateful(op)):
            continue
        inputs = graph.data_inputs(name)
        if op == "Const" or op in SHAPE_OPS or (inputs and all(r.node in constant
                                                               for r in inputs)):
            constant.add(name)
    return constant


def _is_ones(graph: Graph, name: str) -> bool:
    node = graph.node_def(name)
    if node.op == "OnesLike":
        return True
    if node.op == "Fill":
        value = graph.data_inputs(name)[1].node
        return graph.op(value) == "Const" and _const_all_ones(graph.node_def(value))
    return node.op == "Const" and _const_all_ones(node)


def _const_all_ones(node) -> bool:
    from tensorflow.python.framework import tensor_util

    tensor = node.attr["value"].tensor
    if not dtypes.is_floating(tensor.dtype):
        return False
    try:
        values = tensor_util.MakeNdarray(tensor)
    except (TypeError, ValueError):
        return False
    return values.size > 0 and bool(np.all(values == 1))


_NO_TYPE = attr_value_pb2.AttrValue()  # read, never stored: `attr[key]` would add the key


def _reported(graph: Graph, names: set[str]) -> set[str]:
    """`names`, each reporting op among them (`REPORTING_OPS`) replaced by the values it
    reports, through reporting ops before it (a merged summary's scalars and histograms)."""
    found, todo, seen = set(), list(names), set(names)
    while todo:
        name = todo.pop()
        if graph.op(name) not in REPORTING_OPS:
            found.add(name)
            continue
        for ref in graph.data_inputs(name):
            if ref.node not in seen:
                seen.add(ref.node)
                todo.append(ref.node)
    return found


def _differentiated(graph: Graph, data: nx.DiGraph, flow: set[str], sinks: set[str]) -> set[str]:
    """The sinks outside the gradient flow whose values depend on the most of the activations
    the flow reads: the loss, when its seed copies no shape from it (a scalar loss of static
    shape gets `Fill(Const([]), 1)`, a GradientTape's `ones`). Metrics, unused model outputs
    and moving-average updates depend on a part of those at most; initialisers on none (by data
    edges). A value that is no sink may cover more: a Keras `train_step`'s loss is read by its
    loss tracker's update, a write that waits (by control edges) before the optimizer's and
    returns nothing. Then the value written, of all the writes outside the flow the one that
    covers the most, is the loss."""
    activations = reachable(data, fed_inputs(graph))
    reads = {r.node for n in flow for r in graph.data_inputs(n)
             if r.node not in flow and r.node in activations}

    def covered(names) -> dict[str, int]:
        return {n: len(reachable(data, [n], upstream=True) & reads) for n in sorted(names)
                if n in data}

    by_sink = covered(sinks)
    most = max(by_sink.values(), default=0)
    writes = {n for n in activations - flow - set(sinks)
              if data.out_degree(n) == 0 and graph.op(n) in VARIABLE_WRITES}
    written = covered({r.node for n in writes for r in graph.data_inputs(n)[1:]})
    if written and max(written.values()) > most:
        by_sink, most = written, max(written.values())
    return {n for n, count in by_sink.items() if count == most and most > 0}


def fed_inputs(graph: Graph) -> list[str]:
    """The placeholders and iterators that feed data (not a TF2 step's resource handles)."""
    return [n for n in graph.nodes() if graph.op(n) in FED_OPS  # (an iterator has no dtype)
            and graph.node_def(n).attr.get("dtype", _NO_TYPE).type != dtypes.RESOURCE]


def _mirrored(graph: Graph, seeds) -> list[str]:
    """The tensors a seed copies its shape from (`OnesLike(loss)`, `Fill(Shape(loss), 1)`)."""
    found = []
    for seed in seeds:
        if graph.op(seed) == "OnesLike":
            found.append(graph.data_inputs(seed)[0].node)
        elif graph.op(seed) == "Fill":
            dims = graph.data_inputs(seed)[0].node
            if graph.op(dims) == "Shape":
                found.append(graph.data_inputs(dims)[0].node)
    return found

