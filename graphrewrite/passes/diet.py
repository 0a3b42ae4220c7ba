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
  Adafactor's rank-1 estimate `r c / mean(c)`), full otherwise; the first moment is dropped
  (beta1 = 0; momentum optimizers then step with `lr / (1 - momentum)`, momentum's
  steady-state step) unless `momentum=keep`; the new value
  is quantized with stochastic rounding (a random op: unbiased, so updates smaller than one
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

Supported updates (`optimizers` reads them): `tf.compat.v1.train` Adam, Momentum and
GradientDescent on resource (`ResourceApply*`) and ref (`Apply*`) variables, and a TF2 step's
Keras Adam, SGD with momentum and SGD (decomposed into reads and `Assign*VariableOp`s of
resource placeholders: there the new slots are resource placeholders too, which `bind` and
`tf2` give variables, and `bind` gives a dieted one its initial value quantized). Anything else
(sparse updates other than Adam's, Nesterov, shared slots, unusual readers) stays float32, and
one warning lists those variables and why. A graph without variables (a frozen graph) has its
large float constants stored in 16 bits instead, dequantized where read.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import numpy as np
from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2, types_pb2, variable_pb2

from .. import analysis as analysis_mod, bind, dtypes, memory, optimizers, parameters
from .. import shapes as shapes_mod
from ..analysis import Analysis
from ..errors import GraphRewriteError
from ..graph import Graph
from ..metagraph import NEW_VARIABLE_ATTR
from ..saver import NewEntry, drop_control, edit as edit_saver
from ..split import reachable
from ..tensor_ref import TensorRef
from .base import PassOptions, PassResult

log = logging.getLogger(__name__)

INT16_MAX = bind.INT16_MAX
SMALL = "fewer than"  # the reason small variables stay float32
DEFAULT_SCALE = 10.0 / INT16_MAX  # the seed's: values in [-10, 10], quantum 3.05e-4
PREFIX = "graphrewrite_diet"
# Marks for readers of the rewritten graph (`state.py`, checkpoints): a dieted variable's
# format and scale, and an optimizer slot's variable.
DIET_ATTR = bind.DIET_ATTR  # "int16 0.000305..." or "bfloat16"
SLOT_OF_ATTR = "_graphrewrite_slot_of"  # the variable a (new or kept) slot serves
FORMATS = {"int16": types_pb2.DT_INT16, "bfloat16": types_pb2.DT_BFLOAT16}
APPLY_OPS = tuple(optimizers.APPLY_OPS)  # the fused updates (`optimizers` reads them)
RESOURCE_VARIABLE, REF_VARIABLES = "VarHandleOp", ("VariableV2", "Variable")
# What may touch a dieted variable besides its update: reads (rewritten to dequantize), writes
# of whole values (initializers, restores: rewritten to quantize) and harmless queries.
RESOURCE_READS = ("ReadVariableOp", "ResourceGather")
RESOURCE_QUERIES = ("VarIsInitializedOp", "VariableShape")
REF_READERS = ("Identity", "SaveV2", "IsVariableInitialized")
# What may touch a removed slot: its reads, initializer and restore, and queries.
# Ops that pass a read value on unchanged (a view): a backward reader behind one gets a copy of
# the view on its own late read.
VIEW_OPS = ("Identity", "Reshape", "ExpandDims", "Squeeze", "Transpose", "Snapshot")
SLOT_USERS = ("ReadVariableOp", "Identity", "AssignVariableOp", "Assign", "VarIsInitializedOp",
              "IsVariableInitialized", "SaveV2")


@dataclass(frozen=True)
class DietOptions(PassOptions):
    """format: int16 (fixed point, x scale) or bfloat16; scale: the int16 quantum; momentum:
    drop (beta1 = 0) or keep the first moment; factored: a row and a column second-moment
    accumulator for 2-D weights; rounding: stochastic or nearest when the update is written;
    min_size: variables (and frozen constants) with fewer elements stay float32."""

    format: str = "int16"
    scale: float = DEFAULT_SCALE
    momentum: str = "drop"
    factored: bool = True
    rounding: str = "stochastic"
    min_size: int = 1024

    def __post_init__(self):
        for key, allowed in (("format", tuple(FORMATS)), ("momentum", ("drop", "keep")),
                             ("rounding", ("stochastic", "nearest"))):
            if getattr(self, key) not in allowed:
                raise GraphRewriteError(f"pass 'diet': option '{key}' expects "
                                        f"{' or '.join(allowed)}, not '{getattr(self, key)}'")
        if not self.scale > 0:
            raise GraphRewriteError(f"pass 'diet': option 'scale' expects a positive number, "
                                    f"not '{self.scale}'")
        if self.min_size < 0:
            raise GraphRewriteError("pass 'diet': option 'min_size' expects a count >= 0")


@dataclass
class DietResult(PassResult):
    dieted: list[str] = field(default_factory=list)          # variables now 16-bit
    constants: list[str] = field(default_factory=list)       # frozen constants now 16-bit
    slots_removed: list[str] = field(default_factory=list)
    slots_added: list[str] = field(default_factory=list)
    kept_float: dict[str, list[str]] = field(default_factory=dict)  # reason -> variables
    bytes_saved: int = 0  # modelled persistent bytes, values and slots
    forward_reads: str = ""  # "gated" or "ungated": the order kept (`choose_reads`)
    read_peaks: list[int] = field(default_factory=list)  # as run: [gated, ungated] bytes


def run(graph: Graph, analysis: Analysis, options: DietOptions, model=None) -> DietResult:
    """Diet every supported variable; in a graph without variables, its large constants."""
    if not parameters.variables(graph):
        return _diet_constants(graph, options, analysis, model)
    graph = graph.copy()
    diet = _Diet(graph, options, analysis.split, analysis.shapes)
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
    for update in found:
        if update.var in slots:  # a Keras slot's own write, read as an update: not a weight
            continue
        reason = diet.refusal(update)
        if reason:
            kept.setdefault(reason, []).append(update.var)
            continue
        diet.rewrite(update)
    for name in _other_float_variables(graph, analysis.shapes, options, diet, slots,
                                       analysis.split.gradient_flow):
        kept.setdefault(diet.unread.get(name) or _why_not(graph, name), []).append(name)
    kept = {reason: sorted(set(names)) for reason, names in kept.items()}
    # Small variables stay float32 by design (min_size); the others are worth a warning.
    unexpected = {r: v for r, v in kept.items() if not r.startswith(SMALL)}
    if unexpected:
        log.warning("diet: %d variables stay float32: %s", sum(map(len, unexpected.values())),
                    "; ".join(f"{', '.join(v[:4])}{' ...' if len(v) > 4 else ''} ({r})"
                              for r, v in unexpected.items()))
    if not diet.dieted:
        return DietResult(graph, False, note="diet: no variable with a supported optimizer "
                                             "update was rewritten", kept_float=kept)
    diet.finish()
    graph, choice = choose_reads(graph, {r: f for r, f in diet.forward_reads.items()
                                         if f in graph}, analysis, model)
    return DietResult(graph, True, choice.shapes, dieted=diet.dieted,
                      slots_removed=sorted(diet.removed), slots_added=diet.slots_added,
                      kept_float=kept, bytes_saved=diet.bytes_saved,
                      forward_reads=choice.kept, read_peaks=choice.peaks)


# --------------------------------------------------------------------------- attributes

def _type(dtype: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype)


def _bool(value: bool) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(b=value)


def _int(value: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(i=value)


def _shape(dims) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in dims]))


def _tensor(value: np.ndarray) -> attr_value_pb2.AttrValue:
    from tensorflow.python.framework import tensor_util

    return attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(value))


def _known_shape(node) -> tuple | None:
    shape = node.attr["shape"].shape
    if shape.unknown_rank or any(d.size < 0 for d in shape.dim):
        return None
    return tuple(d.size for d in shape.dim)


# --------------------------------------------------------------------------- building

class _Builder:
    """Adds nodes under one name prefix, on one device, and hands back their outputs."""

    def __init__(self, graph: Graph, prefix: str, device: str = ""):
        self.graph, self.prefix, self.device = graph, prefix, device
        self.gate: TensorRef | None = None  # a control input for nodes reading no tensor

    def gated(self, name: str, op: str, inputs, **attrs) -> TensorRef:
        """`op` waiting for `gate` (when set): for reads and random draws."""
        return self.op(name, op, [*inputs, *([self.gate] if self.gate else [])], **attrs)

    def op(self, name: str, op: str, inputs, **attrs) -> TensorRef:
        node = self.graph.unique_name(f"{self.prefix}/{name}")
        self.graph.add_node(node, op, inputs, attrs, self.device)
        return TensorRef(node)

    def const(self, name: str, value, dtype=np.float32) -> TensorRef:
        array = np.asarray(value, dtype)
        return self.op(name, "Const", [], dtype=_type(_dtype_enum(array.dtype)),
                       value=_tensor(array))

    def binary(self, op: str, a: TensorRef, b: TensorRef, name: str | None = None) -> TensorRef:
        return self.op(name or op.lower(), op, [a, b], T=_type(types_pb2.DT_FLOAT))

    def unary(self, op: str, a: TensorRef, name: str | None = None) -> TensorRef:
        return self.op(name or op.lower(), op, [a], T=_type(types_pb2.DT_FLOAT))

    def cast(self, value: TensorRef, src: int, dst: int, name: str = "cast") -> TensorRef:
        return self.op(name, "Cast", [value], SrcT=_type(src), DstT=_type(dst),
                       Truncate=_bool(False))


def _dtype_enum(dtype) -> int:
    import tensorflow as tf

    return tf.dtypes.as_dtype(dtype).as_datatype_enum


def dequantize(b: _Builder, raw: TensorRef, fmt: int, scale: float) -> tuple[str, list]:
    """(op, inputs) of the node that turns 16-bit `raw` into float32, so a caller can give
    that node a name of its choice (`Graph.redefine`): Cast for bfloat16, Cast x scale for
    int16."""
    if fmt == types_pb2.DT_BFLOAT16:
        return "Cast", [raw]
    cast = b.cast(raw, fmt, types_pb2.DT_FLOAT, "dequantize")
    return "Mul", [cast, b.const("scale", scale)]


def _dequantize_attrs(fmt: int) -> dict:
    if fmt == types_pb2.DT_BFLOAT16:
        return {"SrcT": _type(fmt), "DstT": _type(types_pb2.DT_FLOAT), "Truncate": _bool(False)}
    return {"T": _type(types_pb2.DT_FLOAT)}


def quantize(b: _Builder, value: TensorRef, shape: tuple, fmt: int, scale: float,
             stochastic: bool, seed: int) -> TensorRef:
    """`value` (float32 of `shape`) as 16 bits. Stochastic rounding rounds up with probability
    equal to the fraction it drops, so its mean is the value: for int16, floor(x / scale + u)
    with u ~ U[0, 1); for bfloat16, a uniform integer below 2^16 added to the float's bits
    before the low 16 bits are cut (rounding the magnitude, so both signs are unbiased)."""
    float_type = types_pb2.DT_FLOAT
    if fmt == types_pb2.DT_BFLOAT16:
        if stochastic:
            bits = b.op("bits", "Bitcast", [value], T=_type(float_type),
                        type=_type(types_pb2.DT_INT32))
            noise = b.gated("noise", "RandomUniformInt",
                         [b.const("shape", shape, np.int32), b.const("low", 0, np.int32),
                          b.const("high", 1 << 16, np.int32)],
                         T=_type(types_pb2.DT_INT32), Tout=_type(types_pb2.DT_INT32),
                         seed=_int(seed), seed2=_int(_seed2(b.prefix)))
            added = b.op("add_noise", "AddV2", [bits, noise], T=_type(types_pb2.DT_INT32))
            cut = b.op("cut", "BitwiseAnd", [added, b.const("mask", -(1 << 16), np.int32)],
                       T=_type(types_pb2.DT_INT32))
            value = b.op("rounded", "Bitcast", [cut], T=_type(types_pb2.DT_INT32),
                         type=_type(float_type))
        return b.cast(value, float_type, fmt, "quantize")
    scaled = b.binary("Mul", value, b.const("inverse_scale", 1.0 / scale), "scaled")
    if stochastic:
        noise = b.gated("noise", "RandomUniform", [b.const("shape", shape, np.int32)],
                     T=_type(types_pb2.DT_INT32), dtype=_type(float_type), seed=_int(seed),
                     seed2=_int(_seed2(b.prefix)))
        rounded = b.unary("Floor", b.binary("AddV2", scaled, noise, "add_noise"), "rounded")
    else:
        rounded = b.unary("Round", scaled, "rounded")
    clipped = b.op("clip", "ClipByValue", [rounded, b.const("low", -INT16_MAX),
                                           b.const("high", INT16_MAX)], T=_type(float_type))
    return b.cast(clipped, float_type, fmt, "quantize")


SEED = 1729  # op-level seeds make the rounding noise repeatable from run to run


def _seed2(prefix: str) -> int:
    return zlib.crc32(prefix.encode()) & 0x7FFFFFFF


# --------------------------------------------------------------------------- variables

class _Diet:
    """The rewrite of one graph's variables, one update op at a time, then the slots."""

    def __init__(self, graph: Graph, options: DietOptions, split=None, shapes=None):
        self.graph, self.options, self.split, self.shapes = graph, options, split, shapes
        self.late_reads: list[str] = []      # backward reads of the variable being rewritten
        self.fmt = FORMATS[options.format]
        self.dieted: list[str] = []
        self.removed: set[str] = set()       # slot variables to remove
        self.added: list[NewEntry] = []      # new slot variables a Saver keeps
        self.slots_added: list[str] = []     # every new slot (variables and placeholders)
        self.slots_seen: set[str] = set()    # slots of rewritten updates, kept or not
        self.unread: dict[str, str] = {}     # variable -> why its writes are not an update
        self.orphans: set[str] = set()       # inputs of rewritten updates, maybe unused now
        self.forward_reads: dict[str, str] = {}  # dequantized read -> its first op (to gate)
        self.bytes_saved = 0

    # ---------------------------------------------------------------- eligibility

    def _spec(self, var: str) -> tuple[int | None, tuple | None]:
        """(dtype, shape) of a variable or of a TF2 step's captured one."""
        node = self.graph.node_def(var)
        if node.op in bind.PLACEHOLDERS:
            try:
                spec = bind.value_spec(self.graph, self.shapes, var)
            except GraphRewriteError:
                return None, None
            return spec.dtype, spec.shape
        return node.attr["dtype"].type, _known_shape(node)

    def refusal(self, update: optimizers.Update) -> str | None:
        """Why the variable `update` writes must stay float32, or None."""
        graph, apply, var = self.graph, update.node, update.var
        op = graph.op(apply)
        node = graph.node_def(var)
        captured = bind.is_resource_placeholder(node)
        if node.op not in (RESOURCE_VARIABLE, *REF_VARIABLES) and not captured:
            return f"{op} updates a {node.op}, not a variable"
        dtype, shape = self._spec(var)
        if dtype != types_pb2.DT_FLOAT:
            return "not float32"
        if shape is None:
            return "unknown shape"
        if int(np.prod(shape)) < self.options.min_size:
            return f"{SMALL} min_size={self.options.min_size} elements"
        if any(graph.op(u) in APPLY_OPS + optimizers.DECOMPOSED_WRITES
               for u, s in graph.consumers(TensorRef(var)) if u != apply and s == 0):
            return "updated by more than one optimizer op"
        if graph.consumers(TensorRef(apply)):
            return "the update's output is read"
        resource = captured or node.op == RESOURCE_VARIABLE
        for user, slot in graph.consumers(TensorRef(var)):
            user_op = graph.op(user)
            if user == apply or slot is None or slot < 0:
                continue
            if resource and not (user_op in RESOURCE_READS + RESOURCE_QUERIES
                                 or (user_op == "AssignVariableOp" and slot == 0)):
                return f"its handle is also used by {user_op}"
            if not resource and not (user_op in REF_READERS
                                     or (user_op == "Assign" and slot == 0)):
                return f"also used by {user_op}"
        for slot in update.slots.values():
            if captured != bind.is_resource_placeholder(graph.node_def(slot)) or (
                    not captured and graph.op(slot) not in (RESOURCE_VARIABLE, *REF_VARIABLES)):
                return f"its optimizer slot {slot} is a {graph.op(slot)}"
            if slot in self.slots_seen:
                return f"its optimizer slot {slot} is shared"
            if update.form == "tf1":
                users = {u for u, _ in graph.consumers(TensorRef(slot))} - {apply}
                if any(graph.op(u) not in SLOT_USERS for u in users) or any(
                        graph.op(u) in APPLY_OPS for u in users):
                    return f"its optimizer slot {slot} is shared or read elsewhere"
        return None

    # ---------------------------------------------------------------- rewriting

    def rewrite(self, update: optimizers.Update) -> None:
        graph, options = self.graph, self.options
        apply, var = update.node, update.var
        node = graph.node_def(var)
        captured = bind.is_resource_placeholder(node)
        resource = captured or node.op == RESOURCE_VARIABLE
        _, shape = self._spec(var)
        attrs = dict(graph.node_def(apply).attr)
        controls = [TensorRef(c, -1) for c in graph.control_inputs(apply)]
        self.orphans.update(r.node for r in graph.data_inputs(apply)[1:])
        self.late_reads = []
        self.shape, self.apply = shape, apply
        if not captured:  # a captured variable's placeholder is a handle: its readers say int16
            graph.set_attr(var, "dtype", _type(self.fmt))
        mark = options.format + (f" {options.scale!r}" if options.format == "int16" else "")
        graph.set_attr(var, DIET_ATTR, attr_value_pb2.AttrValue(s=mark.encode()))
        for slot in update.slots.values():
            graph.set_attr(slot, SLOT_OF_ATTR, attr_value_pb2.AttrValue(s=var.encode()))
            self.slots_seen.add(slot)
        if resource:
            self._rewrite_resource_users(var, apply, shape)
        else:
            self._rewrite_ref_users(var, apply, shape)
        b = _Builder(graph, f"{apply}/{PREFIX}", graph.node_def(apply).device)
        # Reads and random draws have no input from the step: gated on the gradient, they run
        # when the update can, instead of at the step's start holding a float32 copy of
        # every weight (and its noise) through the forward and backward passes.
        b.gate = TensorRef(_through_identity_n(graph, update.terms["grad"]), -1)
        if "grad_indices" in update.terms:
            update.terms["grad"] = self._dense_gradient(b, update.terms, shape)
        step, slot_writes = getattr(self, "_" + update.kind)(b, update, shape, resource, var)
        # The weight is read once the step exists, and the rounding noise drawn once the new
        # value does: each update then holds two or three float32 tensors of the weight's size
        # at a time, not five, while back-propagation goes on beside it.
        b.gate = TensorRef(step.node, -1)
        current = self._read(b, var, resource, shape)
        new = b.binary("Sub", current, step, "new_value")
        b.gate = TensorRef(new.node, -1)
        stochastic = options.rounding == "stochastic"
        value = quantize(b, new, shape, self.fmt, options.scale, stochastic, SEED)
        writes = [TensorRef(w, -1) for w in slot_writes]
        handle = graph.data_inputs(apply)[0]
        if resource:
            graph.redefine(apply, "AssignVariableOp", [handle, value, *controls, *writes],
                           {"dtype": _type(self.fmt)})
        else:
            graph.redefine(apply, "Assign", [handle, value, *controls, *writes],
                           {"T": _type(self.fmt), "use_locking": attrs.get("use_locking",
                                                                           _bool(False)),
                            "validate_shape": _bool(True)})
        self._order_after_late_reads(apply)
        self.dieted.append(var)
        self.bytes_saved += int(np.prod(shape)) * 2

    def _dense_gradient(self, b: _Builder, terms: dict, shape: tuple) -> TensorRef:
        """A sparse gradient's rows summed into a dense one (zero where no row is): the diet
        update writes the whole variable, and its factored second moment's column means
        need every row's. A float32 transient of the variable's size, as a dense weight's
        gradient is."""
        indices = terms["grad_indices"]
        info = self.shapes[indices] if self.shapes is not None else None
        index_type = info.dtype if info is not None and info.dtype else types_pb2.DT_INT32
        dense = b.op("dense_gradient", "UnsortedSegmentSum",
                     [terms["grad_values"], indices, b.const("rows", shape[0], np.int32)],
                     T=_type(types_pb2.DT_FLOAT), Tindices=_type(index_type),
                     Tnumsegments=_type(types_pb2.DT_INT32))
        _record_shape(self.graph, dense.node, shape)
        return dense

    def _read(self, b: _Builder, var: str, resource: bool, shape: tuple) -> TensorRef:
        """The variable's current value, dequantized, read where the update runs."""
        if resource:
            raw = b.gated("read", "ReadVariableOp", [TensorRef(var)], dtype=_type(self.fmt))
        else:
            raw = b.gated("read", "Identity", [TensorRef(var)], T=_type(self.fmt))
        _record_shape(self.graph, raw.node, shape)
        op, args = dequantize(b, raw, self.fmt, self.options.scale)
        return b.op("current", op, args, **_dequantize_attrs(self.fmt))

    def _rewrite_resource_users(self, var: str, apply: str, shape: tuple) -> None:
        graph = self.graph
        for user, slot in graph.consumers(TensorRef(var)):
            if user == apply or slot < 0:
                continue
            op = graph.op(user)
            node = graph.node_def(user)
            b = _Builder(graph, f"{user}/{PREFIX}", node.device)
            inputs = graph.inputs(user)
            if op in RESOURCE_READS:
                attrs = dict(node.attr)  # `_output_shapes` stay: TF2 steps' reads need them
                attrs["dtype"] = _type(self.fmt)
                raw_name = graph.unique_name(f"{user}/{PREFIX}/raw")
                graph.add_node(raw_name, op, inputs, attrs, node.device)
                deq_op, args = dequantize(b, TensorRef(raw_name), self.fmt, self.options.scale)
                recorded = attrs.get("_output_shapes")
                graph.redefine(user, deq_op, args, _dequantize_attrs(self.fmt))
                self.forward_reads[user] = user if len(args) == 1 else args[0].node
                if recorded is not None:  # a read's is the variable's, a gather's its rows'
                    graph.set_attr(user, "_output_shapes", recorded)
                self._shape_readers(user, TensorRef(raw_name))
                self._backward_read(var, user, raw_name)
            elif op == "AssignVariableOp":
                self._quantize_write(b, user, inputs, shape, {"dtype": _type(self.fmt),
                                                              "validate_shape": node.attr[
                                                                  "validate_shape"]})

    def _rewrite_ref_users(self, var: str, apply: str, shape: tuple) -> None:
        graph = self.graph
        readers = []
        for user, slot in graph.consumers(TensorRef(var)):
            if user == apply or slot < 0:
                continue
            op = graph.op(user)
            node = graph.node_def(user)
            if op == "Assign" and slot == 0:
                b = _Builder(graph, f"{user}/{PREFIX}", node.device)
                self._quantize_write(b, user, graph.inputs(user), shape, {
                    "T": _type(self.fmt), "use_locking": node.attr["use_locking"],
                    "validate_shape": node.attr["validate_shape"]})
            elif op == "IsVariableInitialized":
                graph.set_attr(user, "dtype", _type(self.fmt))
            else:
                readers.append(user)
        if readers:
            b = _Builder(graph, f"{var}/{PREFIX}", graph.node_def(var).device)
            op, args = dequantize(b, TensorRef(var), self.fmt, self.options.scale)
            value = b.op("value", op, args, **_dequantize_attrs(self.fmt))
            self.forward_reads[value.node] = value.node if len(args) == 1 else args[0].node
            graph.replace_uses(TensorRef(var), value, readers)
            self._shape_readers(value.node, TensorRef(var))
            self._backward_read(var, value.node, None)

    def _shape_readers(self, read: str, raw: TensorRef) -> None:
        """Readers of the dequantized `read` (or of an Identity of it) that want only its shape
        read the 16-bit `raw` value instead (Shape, Size, Rank) or a constant (ShapeN's entry:
        its inputs share one dtype). A TF1 gradient's `ShapeN(input, kernel)` waits for every
        batch-norm update of the forward pass, and held a float32 copy of each kernel until the
        forward pass ended."""
        graph = self.graph
        same, todo = [], [read]
        while todo:
            node = todo.pop()
            same.append(node)
            todo.extend(u for u, slot in graph.consumers(TensorRef(node))
                        if slot == 0 and graph.op(u) in ("Identity", "Snapshot"))
        for node in same:
            for user, slot in graph.consumers(TensorRef(node)):
                op = graph.op(user)
                if slot is None or slot < 0:
                    continue
                attrs = {k: v for k, v in graph.node_def(user).attr.items()
                         if k != "_output_shapes"}
                if op in ("Shape", "Size", "Rank"):
                    attrs["T"] = _type(self.fmt)
                    graph.redefine(user, op, [raw if r.node == node and r.port == 0 and
                                              not r.is_control else r
                                              for r in graph.inputs(user)], attrs)
                elif op == "ShapeN" and self.shape is not None:
                    self._drop_shape_n_entry(user, slot, attrs)

    def _drop_shape_n_entry(self, user: str, slot: int, attrs: dict) -> None:
        graph = self.graph
        data = graph.data_inputs(user)
        if len(data) < 2:
            return
        b = _Builder(graph, f"{user}/{PREFIX}", graph.node_def(user).device)
        out_type = attrs["out_type"].type if "out_type" in attrs else types_pb2.DT_INT32
        const = b.const(f"shape_{slot}", self.shape,
                        np.int64 if out_type == types_pb2.DT_INT64 else np.int32)
        graph.replace_uses(TensorRef(user, slot), const)
        controls = [TensorRef(c, -1) for c in graph.control_inputs(user)]
        attrs["N"] = _int(len(data) - 1)
        graph.redefine(user, "ShapeN", [r for i, r in enumerate(data) if i != slot] + controls,
                       attrs)
        for port in range(slot + 1, len(data)):
            graph.replace_uses(TensorRef(user, port), TensorRef(user, port - 1))

    def _backward_read(self, var: str, read: str, raw_read: str | None) -> None:
        """Give the gradient-flow readers of dequantized `read` (and of the forward views of it:
        Reshape, Identity, ...) a second dequantizing read of their own, made to wait for the
        gradients those readers read. The original's read aliases the variable; a dequantized
        one is a float32 copy, and shared by the forward and backward passes it would live
        from a weight's forward use to its backward use: a whole float32 copy of the model at
        the peak. The update must then wait for this read (`_order_after_late_reads`).
        `raw_read` is a resource variable's 16-bit read behind `read`, copied as it is: a
        `ResourceGather` (an embedding lookup) reads the same rows again, not the whole table
        (None: a ref variable, read directly)."""
        graph, split = self.graph, self.split
        if split is None or not split.gradient_flow:
            return
        flow = split.gradient_flow
        parent, order, moved = {read: None}, [read], []
        for view in order:
            for user, slot in graph.consumers(TensorRef(view)):
                if slot is None or slot < 0:
                    continue
                if user in flow:
                    moved.append((view, user))
                elif graph.op(user) in VIEW_OPS and slot == 0 and user not in parent:
                    parent[user] = view
                    order.append(user)
        if not moved:
            return
        readers = {u for _, u in moved}
        downstream = reachable(graph.nx, readers)
        gates = set()
        for user in readers:
            for ref in graph.data_inputs(user):
                node = _through_identity_n(graph, ref)
                if node in flow and node not in downstream and node not in parent:
                    gates.add(node)
        if not gates:
            return
        device = graph.node_def(read).device
        b = _Builder(graph, f"{read}/{PREFIX}/backward", device)
        if raw_read is not None:
            node = graph.node_def(raw_read)
            raw = b.op("raw", node.op, graph.inputs(raw_read), **dict(node.attr))
            if "_output_shapes" not in node.attr:
                _record_shape(graph, raw.node, self.shape)
        else:
            raw = TensorRef(var)
        deq_op, args = dequantize(b, raw, self.fmt, self.options.scale)
        first = raw.node if raw_read is not None else args[0].node
        for gate in sorted(gates):
            graph.add_control(gate, first)
        copies = {read: b.op("value", deq_op, args, **_dequantize_attrs(self.fmt)).node}
        # The value's shape is its read's: a gather's rows, else the variable's.
        recorded = graph.node_def(raw.node).attr.get("_output_shapes") \
            if raw_read is not None else None
        if recorded is not None:
            graph.set_attr(copies[read], "_output_shapes", recorded)
        else:
            _record_shape(graph, copies[read], self.shape)

        def copy(view: str) -> str:
            if view not in copies:
                source = copy(parent[view])
                node = graph.node_def(view)
                inputs = [TensorRef(source) if i == 0 else r
                          for i, r in enumerate(graph.inputs(view))]
                name = graph.unique_name(f"{view}/{PREFIX}/backward")
                attrs = {k: v for k, v in node.attr.items()}
                graph.add_node(name, node.op, inputs, attrs, node.device)
                copies[view] = name
            return copies[view]

        for view, user in moved:
            graph.replace_uses(TensorRef(view), TensorRef(copy(view)), [user])
        self.late_reads.append(first)
        self.orphans.update(order)

    def _order_after_late_reads(self, update: str) -> None:
        """The update writes the variable after its backward reads have read it (the weight
        gradient a read waits on can come before the gradient the update waits on)."""
        for read in self.late_reads:
            self.graph.add_control(read, update)
        self.late_reads = []

    def _quantize_write(self, b: _Builder, user: str, inputs: list[TensorRef], shape: tuple,
                        attrs: dict) -> None:
        """An initializer or restore writes its value quantized to nearest."""
        data = [r for r in inputs if not r.is_control]
        controls = [r for r in inputs if r.is_control]
        value = quantize(b, data[1], shape, self.fmt, self.options.scale, False, 0)
        self.graph.redefine(user, self.graph.op(user), [data[0], value, *controls], attrs)

    # ---------------------------------------------------------------- updates

    def _scalar(self, b: _Builder, value: float, name: str) -> TensorRef:
        return b.const(name, value)

    def _adam(self, b, update, shape, resource, var):
        """Adam without the first moment (unless kept) and with a factored second moment for
        matrices and kernels; the same bias corrections as the optimizer's own."""
        terms, slots = update.terms, update.slots
        keras = update.form != "tf1"  # keras or sparse: decomposed, slots read after
        grad = terms["grad"]
        one = self._scalar(b, 1.0, "one")
        squared = b.unary("Square", grad, "grad_squared")
        if keras:
            decay = terms["decay2"]
            beta2 = b.binary("Sub", one, decay, "beta2")
        else:
            beta2 = terms["beta2"]
            decay = b.binary("Sub", one, beta2, "one_minus_beta2")
        writes = []
        matrix = _matrix(shape)
        if self.options.factored and matrix is not None:
            rows = self._new_slot(var, "diet_rows", (matrix[0], 1), resource)
            cols = self._new_slot(var, "diet_cols", (1, matrix[1]), resource)
            if len(shape) != 2:  # a convolution kernel: (kh*kw*cin, cout)
                squared = b.op("grad_squared_matrix", "Reshape",
                               [squared, b.const("matrix_shape", matrix, np.int32)],
                               T=_type(types_pb2.DT_FLOAT), Tshape=_type(types_pb2.DT_INT32))
            row_mean = b.op("row_mean", "Mean", [squared, b.const("axis_1", 1, np.int32)],
                            T=_type(types_pb2.DT_FLOAT), Tidx=_type(types_pb2.DT_INT32),
                            keep_dims=_bool(True))
            col_mean = b.op("col_mean", "Mean", [squared, b.const("axis_0", 0, np.int32)],
                            T=_type(types_pb2.DT_FLOAT), Tidx=_type(types_pb2.DT_INT32),
                            keep_dims=_bool(True))
            r, w1 = self._accumulate(b, rows, beta2, decay, row_mean, resource, "rows",
                                     (matrix[0], 1))
            c, w2 = self._accumulate(b, cols, beta2, decay, col_mean, resource, "cols",
                                     (1, matrix[1]))
            writes += [w1, w2]
            c_mean = b.op("cols_mean", "Mean", [c, b.const("axes", [0, 1], np.int32)],
                          T=_type(types_pb2.DT_FLOAT), Tidx=_type(types_pb2.DT_INT32),
                          keep_dims=_bool(False))
            second = b.binary("RealDiv", b.binary("Mul", r, c, "outer"), c_mean, "second")
            if len(shape) != 2:
                second = b.op("second_kernel", "Reshape",
                              [second, b.const("kernel_shape", shape, np.int32)],
                              T=_type(types_pb2.DT_FLOAT), Tshape=_type(types_pb2.DT_INT32))
            self.removed.add(slots["v"])
        elif keras:  # Keras's own update of the full second moment stays; read after it
            second = terms["v_new"]
        else:
            second, w = self._accumulate(b, slots["v"], beta2, decay, squared, resource,
                                         "second", shape)
            writes.append(w)
        if keras:
            rate = terms["rate_keep" if self.options.momentum == "keep" else "rate_drop"]
        else:
            power2 = b.binary("Sub", one, terms["beta2_power"], "one_minus_beta2_power")
            rate = b.binary("Mul", terms["lr"], b.unary("Sqrt", power2, "correction"), "rate")
        if self.options.momentum == "keep":
            if keras:
                first = terms["m_new"]
            else:
                beta1 = terms["beta1"]
                first, w = self._accumulate(b, slots["m"], beta1,
                                            b.binary("Sub", one, beta1, "one_minus_beta1"),
                                            grad, resource, "first", shape)
                writes.append(w)
                power1 = b.binary("Sub", one, terms["beta1_power"], "one_minus_beta1_power")
                rate = b.binary("RealDiv", rate, power1, "rate_corrected")
        else:
            first = grad
            self.removed.add(slots["m"])
        denominator = b.binary("AddV2", b.unary("Sqrt", second, "root"), terms["epsilon"],
                               "denominator")
        step = b.binary("Mul", rate, b.binary("RealDiv", first, denominator, "direction"),
                        "step")
        return step, writes

    def _momentum(self, b, update, shape, resource, var):
        """Momentum SGD; with the momentum dropped, steps of lr / (1 - momentum) (momentum's
        steady state). Keras keeps `m = momentum m - lr g` and adds it; tf1 keeps
        `accum = momentum accum + g` and subtracts lr times it."""
        terms = update.terms
        grad, lr, momentum = terms["grad"], terms["lr"], terms["momentum"]
        if self.options.momentum == "keep":
            if update.form == "keras":  # Keras's own update of m stays; read after it
                return b.unary("Neg", terms["m_new"], "step"), []
            one = self._scalar(b, 1.0, "one")
            accum, w = self._accumulate(b, update.slots["accum"], momentum, one, grad, resource,
                                        "accum", shape)
            attr = self.graph.node_def(update.node).attr
            nesterov = "use_nesterov" in attr and attr["use_nesterov"].b
            if nesterov:
                direction = b.binary("AddV2", grad, b.binary("Mul", momentum, accum), "nesterov")
            else:
                direction = accum
            return b.binary("Mul", lr, direction, "step"), [w]
        self.removed.add(update.slots["accum"])
        one = self._scalar(b, 1.0, "one")
        rate = b.binary("RealDiv", lr, b.binary("Sub", one, momentum, "one_minus_momentum"),
                        "rate")
        return b.binary("Mul", rate, grad, "step"), []

    def _sgd(self, b, update, shape, resource, var):
        return b.binary("Mul", update.terms["lr"], update.terms["grad"], "step"), []

    def _accumulate(self, b, slot: str, keep: TensorRef, take: TensorRef, value: TensorRef,
                    resource: bool, name: str, shape: tuple) -> tuple[TensorRef, str]:
        """slot = keep * slot + take * value; returns (the new value, the write)."""
        if resource:
            old = b.gated(f"{name}_old", "ReadVariableOp", [TensorRef(slot)],
                          dtype=_type(types_pb2.DT_FLOAT))
        else:
            old = b.gated(f"{name}_old", "Identity", [TensorRef(slot)],
                          T=_type(types_pb2.DT_FLOAT))
        _record_shape(self.graph, old.node, shape)
        new = b.binary("AddV2", b.binary("Mul", keep, old, f"{name}_kept"),
                       b.binary("Mul", take, value, f"{name}_taken"), f"{name}_new")
        if resource:
            write = b.op(f"{name}_write", "AssignVariableOp", [TensorRef(slot), new],
                         dtype=_type(types_pb2.DT_FLOAT))
        else:
            write = b.op(f"{name}_write", "Assign", [TensorRef(slot), new],
                         T=_type(types_pb2.DT_FLOAT), use_locking=_bool(False),
                         validate_shape=_bool(True))
        return new, write.node

    def _new_slot(self, var: str, suffix: str, shape: tuple, resource: bool) -> str:
        """A zero-initialised float32 variable beside `var`, with its initializer, a read for
        the Saver, and a VariableDef for the `variables` collection; beside a TF2 step's
        captured variable, a captured one (a resource placeholder: whoever runs the step binds
        it, see `bind`)."""
        graph = self.graph
        name = graph.unique_name(f"{var}/{suffix}")
        device = graph.node_def(var).device
        self.bytes_saved -= int(np.prod(shape)) * 4
        self.slots_added.append(name)
        if bind.is_resource_placeholder(graph.node_def(var)):
            graph.add_node(name, "Placeholder", [], {
                "dtype": _type(types_pb2.DT_RESOURCE), "shape": _shape(()),
                "_output_shapes": _shapes([()])}, device)
            graph.set_attr(name, SLOT_OF_ATTR, attr_value_pb2.AttrValue(s=var.encode()))
            return name
        b = _Builder(graph, name, device)
        zeros = b.const("Initializer/zeros", np.zeros(shape, np.float32))
        flt = _type(types_pb2.DT_FLOAT)
        if resource:
            graph.add_node(name, RESOURCE_VARIABLE, [], {
                "dtype": flt, "shape": _shape(shape), "container": attr_value_pb2.AttrValue(s=b""),
                "shared_name": attr_value_pb2.AttrValue(s=name.encode())}, device)
            init = b.op("Assign", "AssignVariableOp", [TensorRef(name), zeros], dtype=flt)
            read = b.op("Read/ReadVariableOp", "ReadVariableOp", [TensorRef(name)], dtype=flt)
        else:
            graph.add_node(name, "VariableV2", [], {
                "dtype": flt, "shape": _shape(shape), "container": attr_value_pb2.AttrValue(s=b""),
                "shared_name": attr_value_pb2.AttrValue(s=b"")}, device)
            init = b.op("Assign", "Assign", [TensorRef(name), zeros], T=flt,
                        use_locking=_bool(True), validate_shape=_bool(True))
            read = b.op("read", "Identity", [TensorRef(name)], T=flt)
        for group in _initializer_groups(graph, var, self.apply):
            graph.add_control(init.node, group)
        definition = variable_pb2.VariableDef(
            variable_name=f"{name}:0", initial_value_name=f"{zeros.node}:0",
            initializer_name=init.node, snapshot_name=f"{read.node}:0", is_resource=resource,
            trainable=False)
        graph.set_attr(name, NEW_VARIABLE_ATTR,
                       attr_value_pb2.AttrValue(s=definition.SerializeToString()))
        graph.set_attr(name, SLOT_OF_ATTR, attr_value_pb2.AttrValue(s=var.encode()))
        self.added.append(NewEntry(name, read, name, types_pb2.DT_FLOAT, resource))
        return name

    # ---------------------------------------------------------------- slots

    def finish(self) -> None:
        """Saver entries follow the slots; removed slots go with everything that served only
        them (reads, initializers, restores); inputs of the old updates nothing reads go too."""
        graph = self.graph
        edit_saver(graph, self.removed, self.added)
        for slot in sorted(self.removed):
            node = graph.node_def(slot)
            shape = _known_shape(node)
            if shape is not None:
                self.bytes_saved += int(np.prod(shape)) * 4
            self._remove_variable(slot)
        self._prune(self.orphans)

    def _remove_variable(self, var: str) -> None:
        graph = self.graph
        doomed, todo = set(), [var]
        while todo:
            name = todo.pop()
            if name in doomed:
                continue
            doomed.add(name)
            todo.extend(u for u, slot in graph.consumers(name) if slot >= 0)
        strangers = sorted(n for n in doomed - {var} if _escapes(graph, n, doomed))
        if strangers:  # its value flows further than its own reads and writes: keep it
            log.warning("diet: slot %s is not removed: %s reads it", var, strangers[0])
            self.removed.discard(var)
            return
        producers = {r.node for n in doomed for r in graph.data_inputs(n)} - doomed
        for name in doomed:
            for user in graph.successors(name):
                if user not in doomed:
                    drop_control(graph, user, name)
        for name in sorted(doomed, key=lambda n: -len(_ancestors_in(graph, n, doomed))):
            graph.remove_node(name)
        self._prune(producers)

    def _prune(self, candidates) -> None:
        """Remove candidates nothing reads that compute a value (no variables, no feeds, no
        stateful ops other than reads), and then their inputs likewise."""
        graph, todo = self.graph, list(candidates)
        while todo:
            name = todo.pop()
            if name not in graph or graph.successors(name):
                continue
            op = graph.op(name)
            node = graph.node_def(name)
            if parameters.is_variable(graph, name) or bind.is_resource_placeholder(node) or \
                    op in ("Placeholder", "PlaceholderWithDefault", "NoOp") or (
                    op not in parameters.READ_OPS and _stateful(op)):
                continue
            inputs = [r.node for r in graph.inputs(name)]
            graph.remove_node(name)
            todo.extend(inputs)


def _shapes(shapes) -> attr_value_pb2.AttrValue:
    value = attr_value_pb2.AttrValue()
    for dims in shapes:
        value.list.shape.add().CopyFrom(_shape(dims).shape)
    return value


def _record_shape(graph: Graph, name: str, shape: tuple | None) -> None:
    """Give a new node's one output its `_output_shapes`: TensorFlow's shape inference cannot
    see through a TF2 step's resource placeholders, and a captured variable's shape is known
    to `bind` and the memory model only from what its reads record."""
    if shape is not None:
        graph.set_attr(name, "_output_shapes", _shapes([shape]))


def _matrix(shape: tuple) -> tuple | None:
    """The (rows, columns) a second moment of `shape` is factored over: a matrix as it is, a
    convolution kernel (kh, kw, cin, cout) as (kh*kw*cin, cout); None for vectors and for
    shapes where one side is 1 (nothing to save)."""
    if len(shape) < 2:
        return None
    rows = int(np.prod(shape[:-1]))
    if rows == 1 or shape[-1] == 1:
        return None
    return rows, int(shape[-1])


def _initializer_groups(graph: Graph, var: str, update: str) -> list[str]:
    """The NoOps that wait for `var`'s initializer (`global_variables_initializer()`'s `init`,
    a Scaffold's or a user's group of initializers, whatever its name): a new slot's
    initializer joins them, so the graph's own init op still initialises every variable.
    Restores (their value read from a RestoreV2) and the update are not initializers."""
    groups = set()
    for user, slot in graph.consumers(TensorRef(var)):
        if slot != 0 or user == update or graph.op(user) not in ("Assign", "AssignVariableOp"):
            continue
        if "RestoreV2" in {graph.op(n) for n in graph.data_ancestors([user])}:
            continue
        groups.update(n for n, s in graph.consumers(user)
                      if s == -1 and graph.op(n) == "NoOp")
    return sorted(groups)


def _through_identity_n(graph: Graph, ref: TensorRef) -> str:
    """The node behind `ref`, seen through an IdentityN (a TF2 step's over every gradient,
    which Grappler removes): waiting on the IdentityN would wait on every gradient."""
    if graph.op(ref.node) == "IdentityN" and ref.port >= 0:
        inputs = graph.data_inputs(ref.node)
        if ref.port < len(inputs):
            return inputs[ref.port].node
    return ref.node


def _escapes(graph: Graph, name: str, doomed: set[str]) -> bool:
    """Whether `name`, downstream of a slot to remove, changes anything that stays: a write of
    another variable, or a stateful op (a tf1 slot's users are all in SLOT_USERS; a Keras
    slot's are its reads, its own write and the arithmetic between them)."""
    op = graph.op(name)
    if op in SLOT_USERS and op not in ("AssignVariableOp", "Assign"):
        return False
    if op in ("AssignVariableOp", "Assign", "ResourceScatterAdd",
              *optimizers.DECOMPOSED_WRITES):
        return graph.data_inputs(name)[0].node not in doomed
    return _stateful(op)


def _ancestors_in(graph: Graph, name: str, within: set[str]) -> set[str]:
    found, todo = set(), [name]
    while todo:
        for ref in graph.inputs(todo.pop()):
            if ref.node in within and ref.node not in found:
                found.add(ref.node)
                todo.append(ref.node)
    return found


def _stateful(op: str) -> bool:
    from .. import ops

    return ops.is_stateful(op)


def _other_float_variables(graph: Graph, shapes, options: DietOptions, diet: _Diet,
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
            spec = _placeholder_spec(graph, shapes, name)
            if spec is None:
                continue
            dtype, size = spec
        else:
            shape = _known_shape(node)
            dtype = node.attr["dtype"].type
            size = None if shape is None else int(np.prod(shape))
        if dtypes.base(dtype) != types_pb2.DT_FLOAT or size is None or size < options.min_size:
            continue
        if any(r.node in flow for w in _writers(graph, name) for r in graph.inputs(w)):
            out.append(name)
    return out


def _placeholder_spec(graph: Graph, shapes, name: str):
    try:
        spec = bind.value_spec(graph, shapes, name)
    except GraphRewriteError:  # no shape recorded: not listed
        return None
    return spec.dtype, int(np.prod(spec.shape))


def _writers(graph: Graph, var: str) -> list[str]:
    """Ops that change the variable in the step (not initializers, restores or reads)."""
    out = []
    for user, slot in graph.consumers(TensorRef(var)):
        op = graph.op(user)
        if slot == 0 and (op in APPLY_OPS or op.startswith(("ResourceApply", "Apply",
                                                            "AssignAdd", "AssignSub",
                                                            "ResourceScatter", "Scatter"))):
            out.append(user)
    return out


def _why_not(graph: Graph, var: str) -> str:
    ops_seen = sorted({graph.op(w) for w in _writers(graph, var)})
    if any(o.startswith(("AssignAdd", "AssignSub")) for o in ops_seen):
        return ("updated by " + "/".join(ops_seen) + " (a decomposed update of a form not "
                "read as Adam's or SGD's: Nesterov, weight decay, a sparse momentum update)")
    return "updated by " + "/".join(ops_seen) + " (not a supported optimizer update)"


# --------------------------------------------------------------------------- frozen graphs

FLOAT_CONST = types_pb2.DT_FLOAT


def _diet_constants(graph: Graph, options: DietOptions, analysis: Analysis | None = None,
                    model=None) -> DietResult:
    """Large float32 constants stored in 16 bits: int16 with a per-constant scale (its largest
    magnitude over 32767: no constant clips) or bfloat16, dequantized where read from a
    DeepCopy of the 16-bit constant (stateful, so no constant folding turns the dequantized
    value back into a float32 constant); the constant keeps its name, as the
    dequantization."""
    from tensorflow.python.framework import tensor_util

    graph = graph.copy()
    fmt = FORMATS[options.format]
    done, saved, firsts = [], 0, {}
    for name in list(graph.nodes()):
        node = graph.node_def(name)
        if node.op != "Const" or node.attr["dtype"].type != FLOAT_CONST:
            continue
        value = tensor_util.MakeNdarray(node.attr["value"].tensor)
        if value.size < max(options.min_size, 1) or not np.all(np.isfinite(value)):
            continue
        b = _Builder(graph, f"{name}/{PREFIX}", node.device)
        if fmt == types_pb2.DT_BFLOAT16:
            import tensorflow as tf

            raw = b.const("raw", value.astype(tf.bfloat16.as_numpy_dtype),
                          tf.bfloat16.as_numpy_dtype)
            scale = 1.0
        else:
            peak = float(np.max(np.abs(value))) or 1.0
            scale = peak / INT16_MAX
            raw = b.const("raw", np.clip(np.round(value / scale), -INT16_MAX, INT16_MAX),
                          np.int16)
        # Grappler and the session's own graph optimizer fold Cast(Const) * scale back into a
        # float32 constant when the session starts (the saving would vanish at run time);
        # neither folds a stateful op. (A PlaceholderWithDefault stops Grappler only: the
        # session's constant folding folded it, ResNet-50 measured as the original.)
        stored = b.op("stored", "DeepCopy", [raw], T=graph.node_def(raw.node).attr["dtype"])
        _record_shape(graph, stored.node, value.shape)
        op, args = dequantize(b, stored, fmt, scale)
        graph.redefine(name, op, args, _dequantize_attrs(fmt))
        done.append(name)
        firsts[name] = stored.node
        saved += value.size * 2
    if not done:
        return DietResult(graph, False, note=f"diet: no variables, and no float32 constant of "
                                             f"at least min_size={options.min_size} elements")
    graph, choice = choose_reads(graph, firsts, analysis, model)
    return DietResult(graph, True, choice.shapes, constants=done, bytes_saved=saved,
                      forward_reads=choice.kept, read_peaks=choice.peaks)


@dataclass
class ReadsChoice:
    kept: str                 # "gated" or "ungated"
    peaks: list[int]          # as run, [gated, ungated] allocator bytes; empty: not priced
    shapes: object = None     # the kept graph's Shapes, when inferred to price it


def choose_reads(graph: Graph, firsts: dict[str, str], analysis: Analysis | None,
                 model=None) -> tuple[Graph, ReadsChoice]:
    """`graph` with its forward dequantizing reads (`firsts`, see `_gate_reads`) gated or not,
    whichever step peaks lower as run: each order through Grappler, then simulated and
    replayed through the allocator model, as `optimize` reports the step (`analysis.as_run`;
    as written where Grappler fails). Gated wins ties, and is kept unpriced without a model
    to price with. Neither order changes a value, only when the copies are made."""
    gated = graph.copy()
    if not _gate_reads(gated, firsts):
        return graph, ReadsChoice("ungated", [])
    if model is None or analysis is None or analysis.memory is None:
        log.info("diet: forward reads gated (not priced: no model of the step)")
        return gated, ReadsChoice("gated", [])
    inputs = _input_shapes(graph, analysis.shapes, analysis.fetches)
    shapes = shapes_mod.infer(graph, inputs)  # the orders differ by control edges only
    device = _device(graph, analysis)
    found = Analysis(analysis.fetches, shapes, analysis.split, None, 0)  # what as_run reads
    reports = [analysis_mod.as_run(model, g, found, inputs, device) for g in (gated, graph)]
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
    for name in memory.needed_nodes(graph, fetches):
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
