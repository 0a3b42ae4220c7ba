"""Diet pass: 16-bit variables and a lean optimizer state, as an offline rewrite of the step.

With Adam every float32 parameter costs 16 bytes of persistent memory: the value and two
moments (the gradient is transient). Diet variables (after tensor2tensor's, which changes the
model code instead) bring that to a little over 2 bytes:

- the variable holds 16 bits: `int16` fixed point (value = int * `scale`, one global scale) or
  `bfloat16`; every read of the old value reads a dequantized float32 tensor instead (the read
  node keeps its name and becomes the dequantization, so readers, savers and fetches are
  untouched); the backward pass's readers get a second dequantizing read that waits for their
  gradient, so no float32 copy of a weight lives from its forward use to its backward one;
- its optimizer update becomes the diet update: Adam's second moment is kept factored for 2-D
  weights and convolution kernels (a row and a column accumulator over (kh*kw*cin, cout),
  SM3's cover `min(r, c)`, never below the whole moment), full otherwise; the first moment is
  dropped (beta1 = 0, Adam's step then clipped as Adafactor's; momentum optimizers step with
  `lr / (1 - momentum)`, momentum's steady-state step) unless `momentum=keep` (float32, in its
  own slot) or `momentum=bfloat16` (a new 16-bit slot, rounded to nearest); the new value is
  quantized with stochastic rounding (a random op: unbiased, so updates smaller than one
  quantum still move the weight on average; recomputation never copies random ops) or to
  nearest;
- slots no longer read are removed with their initializers and checkpoint entries; new slots
  are added to the Saver, to the `variables` collection (through `metagraph.sync`) and to the
  init ops that run their weight's initializer (`init`, whatever its name), so the graph's own
  init op still initialises every variable;
- initial values are quantized once, in the initializer, and so are values a Saver restores:
  a checkpoint holds the dequantized weights as float32 under their own names, so it reads like
  the original's (see the README);
- a forward dequantizing read has no input from the step, so the executor runs it when the
  step starts; made to wait for the activation its reader multiplies ("gated"), its float32
  copy lives only around its use (a 64x64 ResNet-50 step: 94% of the bytes saved come off the
  measured peak, against 71% ungated). Which order peaks lower is the allocator's business as
  much as the tensors': on a 224x224 ResNet-50 the tensors live at the peak are as many bytes
  gated or fewer, but the BFC allocator holds 54-96 MiB more than they ask for (against 30-45
  ungated), because each 16-bit write is a new buffer the variable adopts (`AssignVariableOp`)
  wherever the backward pass left room, and the next step's first activations, gated, are
  handed the cut-up free memory in chunks up to twice their size. So both orders are built
  and priced as `optimize` reports the step (Grappler, then the allocator model), and the
  lower is kept (`choose_reads`).

Supported updates (`optimizers` reads them):
- `tf.compat.v1.train` Adam, Momentum (Nesterov's too), RMSProp (its mean square kept as Adam's
  second moment, its momentum as Momentum's), Adagrad (V2 too; its sum as a second moment
  starting where the slot does) and GradientDescent, on resource (`ResourceApply*`) and ref
  (`Apply*`) variables; Keras's legacy optimizers in graph mode use the same ops, and
  `ResourceApplyKerasMomentum` for SGD with momentum;
- a TF2 step's Keras Adam, SGD with momentum (Nesterov's too), RMSprop (with momentum too),
  Adagrad (its accumulator kept whole: where it starts is not in the step) and SGD, decomposed
  into reads and `Assign*VariableOp`s of resource placeholders: there the new slots are
  resource placeholders too, which `bind` and `tf2` give variables, and `bind` gives a dieted
  one its initial value quantized;
- with or without a decoupled weight decay (AdamW's `w -= w * wd * lr`, folded into the 16-bit
  write).
Anything else (sparse updates other than Adam's, centered RMSProp, Nadam, shared slots, unusual
readers) stays float32, and one warning lists those variables and why. A graph without
variables (a frozen graph) has its large float constants stored in 16 bits instead,
dequantized where read.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
from tensorflow.core.framework import types_pb2

from ...analysis import bind, inline, optimizers, parameters, step
from ...analysis.split import reachable
from ...analysis.step import Analysis
from ...core import dtypes
from ...core.graph import Graph
from ...core.tensor_ref import TensorRef
from ..reads_first import WRITE_PREFIXES
from .build import known_shape
from .constants import diet_constants
from .facts import placeholder_spec, writers
from .options import (APPLY_OPS, RESOURCE_READS, RESOURCE_VARIABLE, SMALL, DietOptions,
                      DietResult)
from .reads import choose_reads
from .variables import Diet

__all__ = ["run", "other_float_variables", "why_not", "DietOptions", "DietResult"]

log = logging.getLogger(__name__)

# Ops whose bodies (functions) may hold a step's updates, which diet does not read.
FUNCTIONAL_OPS = frozenset({"If", "StatelessIf", "Case", "StatelessCase", "While",
                            "StatelessWhile", "PartitionedCall", "StatefulPartitionedCall"})


def run(graph: Graph, analysis: Analysis, options: DietOptions, model=None) -> DietResult:
    """Diet every supported variable; in a graph without variables, its large constants.
    Where no update is found in the step itself but function calls write variables (Keras
    compiles each variable's update with XLA where it sees a GPU, a call each), diet is
    tried again with those calls inlined (`inline.inline_update_calls`): XLA-compiled
    updates then run on TensorFlow's kernels, a change of rounding beside diet's own."""
    if not parameters.variables(graph):
        return diet_constants(graph, options, analysis, model)
    result = _diet(graph, analysis, options, model)
    spliced = None if result.modified or model is None else \
        inline.inline_update_calls(graph.to_graph_def())
    if spliced is None:
        return result
    inlined = Graph.from_graph_def(spliced[0])
    retried = _diet(inlined, step.analyse(model, inlined, dataclasses.replace(
        analysis.options, fetches=analysis.fetches)), options, model)
    if not retried.modified:
        return result
    retried.updates_inlined = spliced[1]
    return retried


def _diet(graph: Graph, analysis: Analysis, options: DietOptions, model) -> DietResult:
    """`run` on the step as it is."""
    graph = graph.copy()
    diet = Diet(graph, options, analysis.split, analysis.shapes)
    kept: dict[str, list[str]] = {}
    found = []
    for name in list(graph.nodes()):
        op = graph.op(name)
        if op in APPLY_OPS:
            update = optimizers.tf1_update(graph, name) or f"{op} with unexpected inputs"
        elif op in optimizers.DECOMPOSED_WRITES and (
                bind.is_resource_placeholder(graph.node_def(graph.data_inputs(name)[0].node))
                or graph.op(graph.data_inputs(name)[0].node) == RESOURCE_VARIABLE):
            update = optimizers.keras_update(graph, name)
        else:
            continue
        if isinstance(update, str):  # reported below, if the variable is worth it
            diet.unread[graph.data_inputs(name)[0].node] = update
            continue
        found.append(update)
    slots = optimizers.slots_of(found)
    momentum_kinds: dict[str, str] = {}  # weight -> the optimizer whose momentum it takes
    for update in found:
        if update.var in slots:  # a Keras slot's own write, read as an update: not a weight
            continue
        reason = diet.refusal(update)
        if reason:
            kept.setdefault(reason, []).append(update.var)
            continue
        if optimizers.takes_sgd_momentum(graph, update) or update.kind == "lion":
            momentum_kinds[update.var] = {"rmsprop": "RMSProp's", "lion": "Lion's"}.get(
                update.kind, "SGD's")  # read before the rewrite
        diet.rewrite(update)
    if momentum_kinds and options.momentum == "drop":
        kinds = sorted(set(momentum_kinds.values()))
        sgd_like = [k for k in kinds if k != "Lion's"]
        effects = [" and ".join(sgd_like) + " then step by lr / (1 - momentum), which at high "
                   "rates can stop training (a CNN at lr 0.1, momentum 0.9 did)"
                   ] if sgd_like else []
        if "Lion's" in kinds:
            effects.append("Lion's by lr sign(g) (signSGD)")
        log.warning("diet: %d weights take momentum (%s), dropped: %s; momentum=bfloat16 "
                    "keeps it in 16 bits", len(momentum_kinds), " and ".join(kinds),
                    "; ".join(effects))
    if options.read_only:
        for name in read_only_variables(graph, analysis.fetches, set(diet.dieted) | slots):
            if diet.read_only_refusal(name) is None:
                diet.store_read_only(name)
    others = other_float_variables(graph, analysis.shapes, options, diet, slots,
                                   analysis.split.gradient_flow)
    if options.generic:
        _store_written(graph, diet, others, analysis.split, kept)
    else:
        for name in others:
            kept.setdefault(diet.unread.get(name) or why_not(graph, name), []).append(name)
    # A variable written twice (AdamW's decay beside its update) is listed under one reason,
    # and one refused as an update but stored by the generic form (SAM's perturbed weights)
    # under none.
    listed: set[str] = set(diet.dieted)
    for reason in list(kept):
        kept[reason] = sorted(set(kept[reason]) - listed)
        listed.update(kept[reason])
        if not kept[reason]:
            del kept[reason]
    # Small variables stay float32 by design (min_size); the others are worth a warning.
    unexpected = {r: v for r, v in kept.items() if not r.startswith(SMALL)}
    if unexpected:
        log.warning("diet: %d variables stay float32: %s", sum(map(len, unexpected.values())),
                    "; ".join(f"{', '.join(v[:4])}{' ...' if len(v) > 4 else ''} ({r})"
                              for r, v in unexpected.items()))
    if not diet.dieted and not diet.read_only:
        note = "diet: no variable with a supported optimizer update was rewritten"
        calls = sorted({graph.op(n) for n in graph.nodes()} & FUNCTIONAL_OPS)
        if not unexpected and calls:  # a LossScaleOptimizer's updates run in an If's branch
            note += (f": no update in the step itself, and diet does not read updates inside "
                     f"{' or '.join(calls)} (a LossScaleOptimizer applies its gradients in a "
                     "cond; a SavedModel's signature calls its step, whose save and restore "
                     "functions read the variables too)")
        return DietResult(graph, False, note=note, kept_float=kept)
    diet.finish()
    graph, choice = choose_reads(graph, {r: f for r, f in diet.forward_reads.items()
                                         if f in graph}, analysis, model, options.reads)
    return DietResult(graph, True, choice.shapes, dieted=diet.dieted,
                      read_only=diet.read_only,
                      slots_removed=sorted(diet.removed), slots_added=diet.slots_added,
                      kept_float=kept, bytes_saved=diet.bytes_saved,
                      forward_reads=choice.kept, read_peaks=choice.peaks)


def _store_written(graph: Graph, diet: Diet, names: list[str], split, kept: dict) -> None:
    """Diet's generic form for `names`, variables written from the gradient by updates it does
    not read (`kept`: reason -> those that stay float32). A weight is one the loss is computed
    from; the others are the optimizer's state."""
    if not names:
        return
    loss_inputs = reachable(graph.nx, list(split.differentiated), upstream=True)
    for name in names:
        reason = diet.written_refusal(name, split.gradient_flow)
        if reason:  # written by an op diet knows (a sparse update): why it does not read it
            known = set(map(graph.op, writers(graph, name))) & set(reason.split())
            kept.setdefault(diet.unread.get(name) or why_not(graph, name) if known else reason,
                            []).append(name)
            continue
        weight = any(u in loss_inputs for u, slot in graph.consumers(TensorRef(name))
                     if slot == 0 and graph.op(u) in RESOURCE_READS)
        diet.store_written(name, weight, split.gradient_flow)


def read_only_variables(graph: Graph, fetches: list[str], skip: set[str]) -> list[str]:
    """Variables the fetched step reads and never writes (its writes are initializers or
    restores, which it does not run), outside `skip`."""
    stepped = reachable(graph.nx, fetches, upstream=True)
    out = []
    for name in parameters.variables(graph):
        if name in skip:
            continue
        users = {u: graph.op(u) for u, slot in graph.consumers(TensorRef(name))
                 if slot is not None and slot >= 0 and u in stepped}
        if users and not any(op.startswith(WRITE_PREFIXES) for op in users.values()):
            out.append(name)
    return out


def other_float_variables(graph: Graph, shapes, options: DietOptions, diet: Diet,
                           slots: set[str], flow) -> list[str]:
    """Float variables of at least min_size elements that the step writes from the gradient
    and the pass did not diet (and that are not optimizer slots): what the warning lists.
    Batch-norm statistics are written from forward values: not listed."""
    out = []
    done = set(diet.dieted) | diet.removed | set(diet.slots_added) | slots
    for name in parameters.variables(graph):
        if name in done:
            continue
        node = graph.node_def(name)
        if node.op in bind.PLACEHOLDERS:
            spec = placeholder_spec(graph, shapes, name)
            if spec is None:
                continue
            dtype, size = spec
        else:
            shape = known_shape(node)
            dtype = node.attr["dtype"].type
            size = None if shape is None else int(np.prod(shape))
        if dtypes.base(dtype) != types_pb2.DT_FLOAT or size is None or size < options.min_size:
            continue
        assigned = any(graph.op(u) == "AssignVariableOp" and slot == 0
                       and graph.data_inputs(u)[1].node in flow
                       for u, slot in graph.consumers(TensorRef(name)))  # Adamax's max
        if assigned or any(r.node in flow for w in writers(graph, name) for r in graph.inputs(w)):
            out.append(name)
    return out


def why_not(graph: Graph, var: str) -> str:
    ops_seen = sorted({graph.op(w) for w in writers(graph, var)})
    if not ops_seen:  # written whole from the gradient (Adamax's max, a hand-written update)
        return ("assigned a value from the gradient (an update of a form diet reads only with "
                "generic=true)")
    if any("SparseApply" in o for o in ops_seen):
        return ("updated by " + "/".join(ops_seen) + " (a sparse update of some rows: diet "
                "reads dense updates, and Adam's sparse one)")
    if any(o.startswith(("AssignAdd", "AssignSub")) for o in ops_seen):
        return ("updated by " + "/".join(ops_seen) + " (a decomposed update of a form not "
                "read as an optimizer's update: centered RMSprop, Nadam, a sparse momentum "
                "update, TF1 Adam's sparse update of a ref variable)")
    return "updated by " + "/".join(ops_seen) + " (not a supported optimizer update)"
