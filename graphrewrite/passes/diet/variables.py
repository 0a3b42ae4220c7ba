"""The diet rewrite of a graph's variables: each supported optimizer update, its readers and
its slots (see the package's docstring)."""

from __future__ import annotations

import numpy as np
from tensorflow.core.framework import attr_value_pb2, types_pb2, variable_pb2

from ...analysis import bind, optimizers
from ...analysis.split import reachable
from ...core.errors import GraphRewriteError
from ...core.graph import Graph
from ...core.metagraph import NEW_VARIABLE_ATTR
from ...core.names import DIET_ATTR, SLOT_OF_ATTR
from ...core.tensor_ref import TensorRef
from .build import (PREFIX, SEED, Builder, bool_attr, dequantize, dequantize_attrs, int_attr,
                    known_shape, quantize, shape_attr, type_attr)
from .facts import (initial_value, initializer_groups, matrix_shape, record_shape,
                    shapes_attr, through_identity_n)
from .options import (APPLY_OPS, FORMATS, REF_READERS, REF_VARIABLES, RESOURCE_QUERIES,
                      RESOURCE_READS, RESOURCE_VARIABLE, SLOT_USERS, SMALL, STEP_WRITES,
                      VIEW_OPS, DietOptions)
from .prune import prune, remove_variable
from .saver import NewEntry
from .saver import edit as edit_saver

__all__ = ["Diet", "momentum_for"]


class Diet:
    """The rewrite of one graph's variables, one update op at a time, then the slots."""

    def __init__(self, graph: Graph, options: DietOptions, split=None, shapes=None):
        self.graph, self.options, self.split, self.shapes = graph, options, split, shapes
        self.late_reads: list[str] = []      # backward reads of the variable being rewritten
        self.fmt = FORMATS[options.format]
        self.dieted: list[str] = []
        self.read_only: list[str] = []       # variables the step only reads, now 16-bit
        self.removed: set[str] = set()       # slot variables to remove
        self.removed_shapes: dict[str, tuple] = {}  # their shapes (a placeholder has none)
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
        return node.attr["dtype"].type, known_shape(node)

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
        ours = {apply, update.decay_write}
        others = sorted({graph.op(u) for u, s in graph.consumers(TensorRef(var))
                         if u not in ours and s == 0
                         and graph.op(u) in APPLY_OPS + optimizers.DECOMPOSED_WRITES})
        if others:  # a second optimizer, or SAM's perturbation of the weights and its undoing
            return f"written by {' and '.join(others)} besides its update ({op})"
        if graph.consumers(TensorRef(apply)):
            return "the update's output is read"
        unread = self._other_users(var, ours)
        if unread:
            return unread
        for slot in update.slots.values():
            if captured != bind.is_resource_placeholder(graph.node_def(slot)) or (
                    not captured and graph.op(slot) not in (RESOURCE_VARIABLE, *REF_VARIABLES)):
                return f"its optimizer slot {slot} is a {graph.op(slot)}"
            if slot in self.slots_seen:
                return f"its optimizer slot {slot} is shared"
            if update.kind == "adagrad" and update.form == "tf1" and \
                    initial_value(graph, slot, apply) is None:
                return f"its accumulator {slot} does not start at one constant value"
            if update.form == "tf1":
                users = {u for u, _ in graph.consumers(TensorRef(slot))} - {apply}
                if any(graph.op(u) not in SLOT_USERS for u in users) or any(
                        graph.op(u) in APPLY_OPS for u in users):
                    return f"its optimizer slot {slot} is shared or read elsewhere"
        return None

    def _other_users(self, var: str, ours: set) -> str | None:
        """Why a user of `var` besides `ours` (its update) keeps it float32: one that is not a
        read, a whole write (an initializer, a restore) or a query; else None."""
        graph = self.graph
        resource = bind.is_resource_placeholder(graph.node_def(var)) or \
            graph.op(var) == RESOURCE_VARIABLE
        for user, slot in graph.consumers(TensorRef(var)):
            user_op = graph.op(user)
            if user in ours or slot is None or slot < 0:
                continue
            if resource and not (user_op in RESOURCE_READS + RESOURCE_QUERIES
                                 or (user_op == "AssignVariableOp" and slot == 0)):
                return f"its handle is also used by {user_op}"
            if not resource and not (user_op in REF_READERS
                                     or (user_op == "Assign" and slot == 0)):
                return f"also used by {user_op}"
        return None

    def written_refusal(self, var: str, flow: frozenset) -> str | None:
        """Why `var`, which an update of a form diet does not read writes (`store_written`),
        must stay float32, or None: a resource variable whose users are reads, queries, whole
        writes, and increments from the gradient `flow`."""
        graph = self.graph
        node = graph.node_def(var)
        if node.op != RESOURCE_VARIABLE and not bind.is_resource_placeholder(node):
            return f"a {node.op}: diet reads only the updates of its optimizers there"
        for user, slot in graph.consumers(TensorRef(var)):
            user_op = graph.op(user)
            if slot is None or slot < 0 or user_op in RESOURCE_READS + RESOURCE_QUERIES:
                continue
            if slot != 0 or user_op not in STEP_WRITES:
                return f"its handle is also used by {user_op}"
            if optimizers.moving_average(graph, user):
                return optimizers.MOVING_AVERAGE
            if user_op != "AssignVariableOp" and graph.data_inputs(user)[1].node not in flow:
                return f"an {user_op} of a value not from the gradient"
        return None

    def read_only_refusal(self, var: str) -> str | None:
        """Why `var`, which the step reads and never writes, must stay float32, or None."""
        node = self.graph.node_def(var)
        if node.op not in (RESOURCE_VARIABLE, *REF_VARIABLES) and \
                not bind.is_resource_placeholder(node):
            return f"a {node.op}, not a variable"
        dtype, shape = self._spec(var)
        if dtype != types_pb2.DT_FLOAT or shape is None or \
                int(np.prod(shape)) < self.options.min_size:
            return "not float32 of a known shape of min_size elements or more"
        return self._other_users(var, set())

    # ---------------------------------------------------------------- rewriting

    def store_read_only(self, var: str) -> None:
        """Store `var`, which the step reads and never writes (a LoRA step's frozen base, a
        distillation's teacher), in 16 bits, dequantized where read as an updated weight is.
        Its initializer and restore round to nearest; nothing else writes it."""
        graph = self.graph
        node = graph.node_def(var)
        captured = bind.is_resource_placeholder(node)
        _, shape = self._spec(var)
        self.late_reads, self.shape, self.apply = [], shape, None
        self._mark(var, captured)
        if captured or node.op == RESOURCE_VARIABLE:
            self._rewrite_resource_users(var, set(), shape)
        else:
            self._rewrite_ref_users(var, None, shape)
        self.late_reads = []  # no update to order after them
        self.read_only.append(var)
        self.bytes_saved += int(np.prod(shape)) * 2

    def store_written(self, var: str, weight: bool, flow: frozenset) -> None:
        """Store `var`, written by an update of a form diet does not read (Keras's Nadam and
        Adamax, a hand-written LAMB), in 16 bits: read dequantized as a dieted weight is, each
        of the step's writes (those of a value from the gradient `flow`) worked out as the
        optimizer does, in float32, and rounded as `rounding` says (an increment, `AssignAdd`
        or `AssignSub`, becomes a read, the sum and a whole write). Its optimizer state (not a
        `weight`) is kept as bfloat16 whatever the format, rounded stochastically: a second
        moment lies far below int16's quantum, and its steps of 0.1% below bfloat16's."""
        graph = self.graph
        captured = bind.is_resource_placeholder(graph.node_def(var))
        _, shape = self._spec(var)
        steps = [u for u, slot in graph.consumers(TensorRef(var)) if slot == 0
                 and graph.op(u) in STEP_WRITES and graph.data_inputs(u)[1].node in flow]
        fmt = self.options.format if weight else "bfloat16"
        kept, self.fmt = self.fmt, FORMATS[fmt]
        self.late_reads, self.shape, self.apply = [], shape, None
        self._mark(var, captured, fmt)
        self._rewrite_resource_users(var, set(steps), shape)
        late = self.late_reads
        stochastic = self.options.rounding == "stochastic" or not weight
        for write in steps:
            handle, value = graph.data_inputs(write)[:2]
            controls = [TensorRef(c, -1) for c in graph.control_inputs(write)]
            b = Builder(graph, f"{write}/{PREFIX}", graph.node_def(write).device)
            if graph.op(write) != "AssignVariableOp":  # the increment on the value read now
                b.gate = TensorRef(value.node, -1)
                current = self._read(b, var, True, shape)
                for control in controls:  # after what the increment waited for
                    graph.add_control(control.node, current.node)
                value = b.binary("AddV2" if graph.op(write) == "AssignAddVariableOp" else "Sub",
                                 current, value, "new_value")
            b.gate = TensorRef(value.node, -1)
            rounded = quantize(b, value, shape, self.fmt, self.options.scale, stochastic, SEED)
            graph.redefine(write, "AssignVariableOp", [handle, rounded, *controls],
                           {"dtype": type_attr(self.fmt)})
            self.late_reads = list(late)
            self._order_after_late_reads(write)
        self.fmt = kept
        self.dieted.append(var)
        self.bytes_saved += int(np.prod(shape)) * 2

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
        if update.decay_write:  # folded into the new value below; its readers wait as before
            value = graph.data_inputs(update.decay_write)[1]
            own = reachable(graph.nx, [value.node], upstream=True)  # the decay's own read
            self.orphans.add(value.node)
            graph.redefine(update.decay_write, "NoOp", [
                TensorRef(c, -1) for c in graph.control_inputs(update.decay_write)
                if c not in own], {})
        self.late_reads = []
        self.shape, self.apply = shape, apply
        self.momentum = momentum_for(graph, update, options.momentum)
        self._mark(var, captured)
        for slot in update.slots.values():
            graph.set_attr(slot, SLOT_OF_ATTR, attr_value_pb2.AttrValue(s=var.encode()))
            self.slots_seen.add(slot)
        if resource:
            self._rewrite_resource_users(var, {apply}, shape)
        else:
            self._rewrite_ref_users(var, apply, shape)
        b = Builder(graph, f"{apply}/{PREFIX}", graph.node_def(apply).device)
        # Reads and random draws have no input from the step: gated on the gradient, they run
        # when the update can, instead of at the step's start holding a float32 copy of
        # every weight (and its noise) through the forward and backward passes.
        b.gate = TensorRef(through_identity_n(graph, update.terms["grad"]), -1)
        if "grad_indices" in update.terms:
            update.terms["grad"] = self._dense_gradient(b, update.terms, shape)
        step, slot_writes = getattr(self, "_" + update.kind)(b, update, shape, resource, var)
        # The weight is read once the step exists, and the rounding noise drawn once the new
        # value does: each update then holds two or three float32 tensors of the weight's size
        # at a time, not five, while back-propagation goes on beside it.
        b.gate = TensorRef(step.node, -1)
        current = self._read(b, var, resource, shape)
        if update.decay:  # decoupled weight decay first: var - var * wd * lr, as Keras does
            decay = current
            for i, factor in enumerate(update.decay):
                decay = b.binary("Mul", decay, factor, f"decay_{i}")
            current = b.binary("Sub", current, decay, "decayed")
        new = b.binary("Sub", current, step, "new_value")
        b.gate = TensorRef(new.node, -1)
        stochastic = options.rounding == "stochastic"
        value = quantize(b, new, shape, self.fmt, options.scale, stochastic, SEED)
        writes = [TensorRef(w, -1) for w in slot_writes]
        handle = graph.data_inputs(apply)[0]
        if resource:
            graph.redefine(apply, "AssignVariableOp", [handle, value, *controls, *writes],
                           {"dtype": type_attr(self.fmt)})
        else:
            graph.redefine(apply, "Assign", [handle, value, *controls, *writes],
                           {"T": type_attr(self.fmt), "use_locking": attrs.get("use_locking",
                                                                           bool_attr(False)),
                            "validate_shape": bool_attr(True)})
        self._order_after_late_reads(apply)
        self.dieted.append(var)
        self.bytes_saved += int(np.prod(shape)) * 2

    def _mark(self, var: str, captured: bool, fmt: str | None = None) -> None:
        """The variable's 16-bit dtype and the diet mark (its format, the options' unless
        `fmt`, and scale), which whoever binds or saves it reads."""
        if not captured:  # a captured variable's placeholder is a handle: its readers say int16
            self.graph.set_attr(var, "dtype", type_attr(self.fmt))
        options = self.options
        fmt = fmt or options.format
        mark = fmt + (f" {options.scale!r}" if fmt == "int16" else "")
        self.graph.set_attr(var, DIET_ATTR, attr_value_pb2.AttrValue(s=mark.encode()))

    def _dense_gradient(self, b: Builder, terms: dict, shape: tuple) -> TensorRef:
        """A sparse gradient's rows summed into a dense one (zero where no row is): the diet
        update writes the whole variable, and its factored second moment's column means
        need every row's. A float32 transient of the variable's size, as a dense weight's
        gradient is."""
        indices = terms["grad_indices"]
        info = self.shapes[indices] if self.shapes is not None else None
        index_type = info.dtype if info is not None and info.dtype else types_pb2.DT_INT32
        dense = b.op("dense_gradient", "UnsortedSegmentSum",
                     [terms["grad_values"], indices, b.const("rows", shape[0], np.int32)],
                     T=type_attr(types_pb2.DT_FLOAT), Tindices=type_attr(index_type),
                     Tnumsegments=type_attr(types_pb2.DT_INT32))
        record_shape(self.graph, dense.node, shape)
        return dense

    def _read(self, b: Builder, var: str, resource: bool, shape: tuple) -> TensorRef:
        """The variable's current value, dequantized, read where the update runs."""
        if resource:
            raw = b.gated("read", "ReadVariableOp", [TensorRef(var)], dtype=type_attr(self.fmt))
        else:
            raw = b.gated("read", "Identity", [TensorRef(var)], T=type_attr(self.fmt))
        record_shape(self.graph, raw.node, shape)
        op, args = dequantize(b, raw, self.fmt, self.options.scale)
        return b.op("current", op, args, **dequantize_attrs(self.fmt))

    def _rewrite_resource_users(self, var: str, updates: set[str], shape: tuple) -> None:
        """Reads dequantize, whole writes (initializers, restores) quantize; `updates` are
        rewritten by the caller."""
        graph = self.graph
        for user, slot in graph.consumers(TensorRef(var)):
            if user in updates or slot < 0:
                continue
            op = graph.op(user)
            node = graph.node_def(user)
            b = Builder(graph, f"{user}/{PREFIX}", node.device)
            inputs = graph.inputs(user)
            if op in RESOURCE_READS:
                attrs = dict(node.attr)  # `_output_shapes` stay: TF2 steps' reads need them
                attrs["dtype"] = type_attr(self.fmt)
                raw_name = graph.unique_name(f"{user}/{PREFIX}/raw")
                graph.add_node(raw_name, op, inputs, attrs, node.device)
                deq_op, args = dequantize(b, TensorRef(raw_name), self.fmt, self.options.scale)
                recorded = attrs.get("_output_shapes")
                graph.redefine(user, deq_op, args, dequantize_attrs(self.fmt))
                self.forward_reads[user] = user if len(args) == 1 else args[0].node
                if recorded is not None:  # a read's is the variable's, a gather's its rows'
                    graph.set_attr(user, "_output_shapes", recorded)
                self._shape_readers(user, TensorRef(raw_name))
                self._backward_read(var, user, raw_name)
            elif op == "AssignVariableOp":
                self._quantize_write(b, user, inputs, shape, {"dtype": type_attr(self.fmt),
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
                b = Builder(graph, f"{user}/{PREFIX}", node.device)
                self._quantize_write(b, user, graph.inputs(user), shape, {
                    "T": type_attr(self.fmt), "use_locking": node.attr["use_locking"],
                    "validate_shape": node.attr["validate_shape"]})
            elif op == "IsVariableInitialized":
                graph.set_attr(user, "dtype", type_attr(self.fmt))
            else:
                readers.append(user)
        b = Builder(graph, f"{var}/{PREFIX}", graph.node_def(var).device)
        savers = [u for u in readers if graph.op(u) == "SaveV2"]
        if savers:  # their own dequantization: the step's forward read may wait for the step
            op, args = dequantize(b, TensorRef(var), self.fmt, self.options.scale)
            graph.replace_uses(TensorRef(var), b.op("saved", op, args,
                                                    **dequantize_attrs(self.fmt)), savers)
            readers = [u for u in readers if u not in savers]
        if readers:
            op, args = dequantize(b, TensorRef(var), self.fmt, self.options.scale)
            value = b.op("value", op, args, **dequantize_attrs(self.fmt))
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
                    attrs["T"] = type_attr(self.fmt)
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
        b = Builder(graph, f"{user}/{PREFIX}", graph.node_def(user).device)
        out_type = attrs["out_type"].type if "out_type" in attrs else types_pb2.DT_INT32
        const = b.const(f"shape_{slot}", self.shape,
                        np.int64 if out_type == types_pb2.DT_INT64 else np.int32)
        graph.replace_uses(TensorRef(user, slot), const)
        controls = [TensorRef(c, -1) for c in graph.control_inputs(user)]
        attrs["N"] = int_attr(len(data) - 1)
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
                node = through_identity_n(graph, ref)
                if node in flow and node not in downstream and node not in parent:
                    gates.add(node)
        if not gates:
            return
        device = graph.node_def(read).device
        b = Builder(graph, f"{read}/{PREFIX}/backward", device)
        if raw_read is not None:
            node = graph.node_def(raw_read)
            raw = b.op("raw", node.op, graph.inputs(raw_read), **dict(node.attr))
            if "_output_shapes" not in node.attr:
                record_shape(graph, raw.node, self.shape)
        else:
            raw = TensorRef(var)
        deq_op, args = dequantize(b, raw, self.fmt, self.options.scale)
        first = raw.node if raw_read is not None else args[0].node
        for gate in sorted(gates):
            graph.add_control(gate, first)
        copies = {read: b.op("value", deq_op, args, **dequantize_attrs(self.fmt)).node}
        # The value's shape is its read's: a gather's rows, else the variable's.
        recorded = graph.node_def(raw.node).attr.get("_output_shapes") \
            if raw_read is not None else None
        if recorded is not None:
            graph.set_attr(copies[read], "_output_shapes", recorded)
        else:
            record_shape(graph, copies[read], self.shape)

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
        gradient a read waits on can come before the gradient the update waits on), unless a
        read comes after the update already: it reads the new value, as its forward read does
        (a GAN step's generator reading the discriminator it has just updated)."""
        later = reachable(self.graph.nx, [update]) if self.late_reads else set()
        for read in self.late_reads:
            if read not in later:
                self.graph.add_control(read, update)
        self.late_reads = []

    def _quantize_write(self, b: Builder, user: str, inputs: list[TensorRef], shape: tuple,
                        attrs: dict) -> None:
        """An initializer or restore writes its value quantized to nearest."""
        data = [r for r in inputs if not r.is_control]
        controls = [r for r in inputs if r.is_control]
        value = quantize(b, data[1], shape, self.fmt, self.options.scale, False, 0)
        self.graph.redefine(user, self.graph.op(user), [data[0], value, *controls], attrs)

    # ---------------------------------------------------------------- updates

    def _scalar(self, b: Builder, value: float, name: str) -> TensorRef:
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
        matrix = matrix_shape(shape)
        second, writes = self._second_moment(b, slots["v"], beta2, decay, squared, resource,
                                             var, shape, own=terms.get("v_new"))
        if keras:
            rate = terms["rate_drop" if self.momentum == "drop" else "rate_keep"]
        else:
            power2 = b.binary("Sub", one, terms["beta2_power"], "one_minus_beta2_power")
            rate = b.binary("Mul", terms["lr"], b.unary("Sqrt", power2, "correction"), "rate")
        momentum = self.momentum
        if momentum == "drop":
            first = grad
            self._remove(slots["m"], shape)
        elif momentum == "keep" and keras:  # Keras's own update of m stays; read after it
            first = terms["m_new"]
        else:  # updated here: in the optimizer's float32 slot, or in a new 16-bit one
            if matrix is not None and self.options.factored:
                # Read once the factored second moment is done: the executor would otherwise
                # run both moments at once, the gradient's square beside the old first moment
                # and its decay (a transformer's embedding: four float32 tensors of the
                # table's size at once, its measured peak). The Identity forwards the buffer.
                b.gate = TensorRef(second.node, -1)
                grad = b.gated("gradient_later", "Identity", [grad],
                               T=type_attr(types_pb2.DT_FLOAT))
                record_shape(self.graph, grad.node, shape)
            beta1 = b.binary("Sub", one, terms["decay1"], "beta1") if keras else terms["beta1"]
            take = terms["decay1"] if keras else b.binary("Sub", one, beta1, "one_minus_beta1")
            slot, stored = slots["m"], types_pb2.DT_FLOAT
            if momentum == "bfloat16":
                stored = types_pb2.DT_BFLOAT16
                slot = self._new_slot(var, "diet_first", shape, resource, stored)
                self._remove(slots["m"], shape)
            first, w = self._accumulate(b, slot, beta1, take, grad, resource, "first", shape,
                                        stored)
            writes.append(w)
            if not keras:
                power1 = b.binary("Sub", one, terms["beta1_power"], "one_minus_beta1_power")
                rate = b.binary("RealDiv", rate, power1, "rate_corrected")
        denominator = b.binary("AddV2", b.unary("Sqrt", second, "root"), terms["epsilon"],
                               "denominator")
        direction = b.binary("RealDiv", first, denominator, "direction")
        if momentum == "drop" and "lr" in terms:
            rate = self._clipped(b, rate, direction, terms["lr"], shape, one)
        return b.binary("Mul", rate, direction, "step"), writes

    def _clipped(self, b: Builder, rate: TensorRef, direction: TensorRef, lr: TensorRef,
                 shape: tuple, one: TensorRef) -> TensorRef:
        """`rate` for Adafactor's update clipping (threshold 1): the step over the learning
        rate is the gradient over the root of its bias-corrected second moment; where its
        root mean square is over 1, the rate is divided by it. Without a first moment to smooth
        it, a step is the gradient over a second moment that lags it (factored, an estimate
        besides), and a gradient that grows faster than its mean square steps far: a TF2 deep
        MLP built outside the repo (Keras Adam at 1e-3, batch 4096) went from a loss of 2.3 to
        1e11 after 37 steps without it. The scalars only: no tensor of the weight's size is
        added (L2Loss is half the sum of squares)."""
        size = float(np.prod(shape)) if shape else 1.0
        mean_square = b.binary("Mul", b.unary("L2Loss", direction, "direction_half_square_sum"),
                               self._scalar(b, 2.0 / size, "two_over_size"),
                               "direction_mean_square")
        # 0 where the rate is (a warmup's first step): 0/0 made the weights NaN, which the
        # 16-bit cast wrote as zeros (a BERT-like step built outside the repo)
        rms = b.binary("DivNoNan", b.binary("Mul", b.unary("Sqrt", mean_square, "direction_rms"),
                                            rate, "step_rms"), lr, "step_rms_over_rate")
        return b.binary("RealDiv", rate, b.binary("Maximum", rms, one, "over_one"),
                        "rate_clipped")

    def _second_moment(self, b, slot: str, keep: TensorRef, take: TensorRef,
                       squared: TensorRef, resource: bool, var: str, shape: tuple,
                       initial: float = 0.0, own: TensorRef | None = None):
        """slot = keep slot + take g^2, whole, or factored for matrices and kernels: SM3's
        cover (Anil et al., 2019), a row and a column accumulator in new slots starting at
        `initial` as the slot does, each holding the largest value of its row or column;
        `keep min(r, c) + take g^2` is this step's second moment, never below the one a whole
        slot would hold, so no entry steps further than the optimizer would step it.
        Adafactor's rank-1 estimate `r c / mean(c)`, which this replaces, is no bound: on a TF2
        deep MLP built outside the repo (10 x 1024, batch 4096, Keras Adam) it stepped 2% of the
        first step's entries 3-15 times the learning rate, and every diet that factored it
        stopped learning after a dozen steps (floored at `take g^2` too); with the cover each
        learned. It learns slower where a row's or column's largest entry is far above the
        rest (the tests' 3-layer MLP, a small embedding). Returns its value and the writes.
        `own`: a Keras slot read after Keras's own update of it, which stays where the moment
        is whole."""
        matrix = matrix_shape(shape)
        if not (self.options.factored and matrix is not None):
            if own is not None:
                return own, []
            second, write = self._accumulate(b, slot, keep, take, squared, resource, "second",
                                             shape)
            return second, [write]
        rows = self._new_slot(var, "diet_rows", (matrix[0], 1), resource, initial=initial)
        cols = self._new_slot(var, "diet_cols", (1, matrix[1]), resource, initial=initial)
        if len(shape) != 2:  # a convolution kernel: (kh*kw*cin, cout)
            squared = b.reshape("grad_squared_matrix", squared, matrix, "matrix_shape")
        cover = b.binary("Minimum", self._read_slot(b, rows, resource, "rows", (matrix[0], 1)),
                         self._read_slot(b, cols, resource, "cols", (1, matrix[1])), "cover")
        second = b.binary("AddV2", b.binary("Mul", keep, cover, "cover_kept"),
                          b.binary("Mul", take, squared, "squared_taken"), "second")
        writes = [self._write_slot(b, rows, b.max("rows_max", second, 1, "axis_1", True),
                                   resource, "rows"),
                  self._write_slot(b, cols, b.max("cols_max", second, 0, "axis_0", True),
                                   resource, "cols")]
        if len(shape) != 2:
            second = b.reshape("second_kernel", second, shape, "kernel_shape")
        self._remove(slot, shape)
        return second, writes

    def _rmsprop(self, b, update, shape, resource, var):
        """RMSProp (`ms = rho ms + (1 - rho) g^2`, `mom = momentum mom + lr g / sqrt(ms + eps)`,
        `var -= mom`) with its mean square as Adam's second moment; the momentum slot dropped
        (steps of lr / (1 - momentum): exact for tf1's default momentum 0, whose slot stays 0),
        kept, or 16-bit, as Momentum's. Keras's own update of its momentum reads the mean
        square this replaces: kept, it is a new float32 slot updated here."""
        terms, slots = update.terms, update.slots
        grad, lr, rho = terms["grad"], terms["lr"], terms["rho"]
        one = self._scalar(b, 1.0, "one")
        squared = b.unary("Square", grad, "grad_squared")
        keras = update.form == "keras"
        take = terms["decay"] if keras else b.binary("Sub", one, rho, "one_minus_rho")
        # tf.compat.v1's RMSPropOptimizer starts it at ones (`_create_slots`), Keras at 0
        second, writes = self._second_moment(b, slots["ms"], rho, take, squared, resource, var,
                                             shape, initial=0.0 if keras else 1.0,
                                             own=terms.get("v_new"))
        root = b.unary("Sqrt", b.binary("AddV2", second, terms["epsilon"], "shifted"), "root")
        direction = b.binary("RealDiv", grad, root, "direction")
        if "mom" not in slots:  # Keras's, without momentum
            return b.binary("Mul", lr, direction, "step"), writes
        momentum = terms["momentum"]
        if self.momentum == "drop":
            self._remove(slots["mom"], shape)
            rate = b.binary("RealDiv", lr, b.binary("Sub", one, momentum, "one_minus_momentum"),
                            "rate")
            return b.binary("Mul", rate, direction, "step"), writes
        slot, stored = slots["mom"], (types_pb2.DT_BFLOAT16 if self.momentum ==
                                      "bfloat16" else types_pb2.DT_FLOAT)
        if stored != types_pb2.DT_FLOAT or keras:
            slot = self._new_slot(var, "diet_momentum", shape, resource, stored)
            self._remove(slots["mom"], shape)
        accum, w = self._accumulate(b, slot, momentum, lr, direction, resource, "accum", shape,
                                    stored)
        return accum, writes + [w]

    def _adagrad(self, b, update, shape, resource, var):
        """Adagrad (`acc += g^2`, `var -= lr g / (sqrt(acc) + epsilon)`; Keras's
        `lr g / sqrt(acc + epsilon)`) with its sum factored as Adam's second moment, the new
        accumulators starting where the slot does. A TF2 step's Keras accumulator stays whole
        (float32): where it starts is not in the step."""
        terms = update.terms
        grad, lr = terms["grad"], terms["lr"]
        if update.form == "keras":
            second, writes = terms["v_new"], []
            root = b.unary("Sqrt", b.binary("AddV2", second, terms["epsilon"], "shifted"),
                           "root")
        else:
            one = self._scalar(b, 1.0, "one")
            slot = update.slots["accum"]
            second, writes = self._second_moment(
                b, slot, one, one, b.unary("Square", grad, "grad_squared"), resource, var,
                shape, initial=initial_value(self.graph, slot, update.node))
            root = b.unary("Sqrt", second, "root")
            if "epsilon" in terms:
                root = b.binary("AddV2", root, terms["epsilon"], "shifted_root")
        return b.binary("Mul", lr, b.binary("RealDiv", grad, root, "direction"), "step"), writes

    def _momentum(self, b, update, shape, resource, var):
        """Momentum SGD; with the momentum dropped, steps of lr / (1 - momentum) (momentum's
        steady state). Keras keeps `m = momentum m - lr g` and adds it; tf1 keeps
        `accum = momentum accum + g` and subtracts lr times it."""
        terms = update.terms
        grad, lr, momentum = terms["grad"], terms["lr"], terms["momentum"]
        negated = update.form == "keras" or update.negated  # Keras's form, fused or not
        if self.momentum == "keep" and update.form == "keras":  # Keras's own m stays
            return b.unary("Neg", terms["increment"], "step"), []
        if self.momentum != "drop":  # updated here: its float32 slot or a 16-bit one
            slot, stored = update.slots["accum"], types_pb2.DT_FLOAT
            if self.momentum == "bfloat16":
                stored = types_pb2.DT_BFLOAT16
                slot = self._new_slot(var, "diet_momentum", shape, resource, stored)
                self._remove(update.slots["accum"], shape)
            take = b.unary("Neg", lr, "minus_lr") if negated else self._scalar(b, 1.0, "one")
            accum, w = self._accumulate(b, slot, momentum, take, grad, resource, "accum", shape,
                                        stored)
            if negated and update.nesterov:  # m = momentum m - lr g; var += momentum m - lr g
                return b.binary("Sub", b.binary("Mul", lr, grad, "lr_grad"),
                                b.binary("Mul", momentum, accum, "ahead"), "step"), [w]
            if negated:  # m = momentum m - lr g; var += m
                return b.unary("Neg", accum, "step"), [w]
            if update.nesterov:
                direction = b.binary("AddV2", grad, b.binary("Mul", momentum, accum), "nesterov")
            else:
                direction = accum
            return b.binary("Mul", lr, direction, "step"), [w]
        self._remove(update.slots["accum"], shape)
        one = self._scalar(b, 1.0, "one")
        rate = b.binary("RealDiv", lr, b.binary("Sub", one, momentum, "one_minus_momentum"),
                        "rate")
        return b.binary("Mul", rate, grad, "step"), []

    def _lion(self, b, update, shape, resource, var):
        """Lion: steps of lr sign(beta1 m + (1 - beta1) g), then m = beta2 m + (1 - beta2) g.
        Its momentum is its only state: kept (Keras's own), kept as bfloat16, or dropped,
        which leaves steps of lr sign(g) (signSGD)."""
        terms = update.terms
        grad, lr = terms["grad"], terms["lr"]
        if self.momentum == "keep":  # Keras's own m and its write stay
            return terms["increment"], []
        self._remove(update.slots["m"], shape)
        if self.momentum == "drop":
            return b.binary("Mul", lr, b.unary("Sign", grad, "direction"), "step"), []
        stored = types_pb2.DT_BFLOAT16
        slot = self._new_slot(var, "diet_momentum", shape, resource, stored)
        old = b.cast(self._read_slot(b, slot, resource, "m", shape, stored), stored,
                     types_pb2.DT_FLOAT, "m_old_float")
        mixed = b.binary("AddV2", b.binary("Mul", terms["beta1"], old, "m_kept"),
                         b.binary("Mul", terms["decay1"], grad, "grad_taken"), "mixed")
        new = b.binary("AddV2", b.binary("Mul", terms["beta2"], old, "m_decayed"),
                       b.binary("Mul", terms["decay2"], grad, "grad_added"), "m_new")
        write = self._write_slot(b, slot, b.cast(new, types_pb2.DT_FLOAT, stored, "m_rounded"),
                                 resource, "m", stored)
        return b.binary("Mul", lr, b.unary("Sign", mixed, "direction"), "step"), [write]

    def _sgd(self, b, update, shape, resource, var):
        return b.binary("Mul", update.terms["lr"], update.terms["grad"], "step"), []

    def _accumulate(self, b, slot: str, keep: TensorRef, take: TensorRef, value: TensorRef,
                    resource: bool, name: str, shape: tuple,
                    stored: int = types_pb2.DT_FLOAT) -> tuple[TensorRef, str]:
        """slot = keep * slot + take * value; returns (the new value, the write). A bfloat16
        slot is read as float32 and written rounded to nearest, the step using the new value
        before its rounding: a moment moves by a tenth of the gradient each step, far more
        than bfloat16's 2^-8, so rounding to nearest biases it little, and stochastic rounding
        would hold three int32 tensors of the slot's size at each update (a transformer's
        embedding: 31 MiB measured at its peak)."""
        old = self._read_slot(b, slot, resource, name, shape, stored)
        if stored != types_pb2.DT_FLOAT:
            old = b.cast(old, stored, types_pb2.DT_FLOAT, f"{name}_old_float")
        new = b.binary("AddV2", b.binary("Mul", keep, old, f"{name}_kept"),
                       b.binary("Mul", take, value, f"{name}_taken"), f"{name}_new")
        written = new
        if stored != types_pb2.DT_FLOAT:
            written = b.cast(new, types_pb2.DT_FLOAT, stored, f"{name}_rounded")
        return new, self._write_slot(b, slot, written, resource, name, stored)

    def _read_slot(self, b: Builder, slot: str, resource: bool, name: str, shape: tuple,
                   stored: int = types_pb2.DT_FLOAT) -> TensorRef:
        """The slot's value before this step's write (gated: read when the update starts)."""
        if resource:
            old = b.gated(f"{name}_old", "ReadVariableOp", [TensorRef(slot)],
                          dtype=type_attr(stored))
        else:
            old = b.gated(f"{name}_old", "Identity", [TensorRef(slot)], T=type_attr(stored))
        record_shape(self.graph, old.node, shape)
        return old

    def _write_slot(self, b: Builder, slot: str, value: TensorRef, resource: bool, name: str,
                    stored: int = types_pb2.DT_FLOAT) -> str:
        """The write of `value` to the slot: its node."""
        if resource:
            write = b.op(f"{name}_write", "AssignVariableOp", [TensorRef(slot), value],
                         dtype=type_attr(stored))
        else:
            write = b.op(f"{name}_write", "Assign", [TensorRef(slot), value],
                         T=type_attr(stored), use_locking=bool_attr(False),
                         validate_shape=bool_attr(True))
        return write.node

    def _new_slot(self, var: str, suffix: str, shape: tuple, resource: bool,
                  dtype: int = types_pb2.DT_FLOAT, initial: float = 0.0) -> str:
        """A variable starting at `initial` (float32 unless `dtype`) beside `var`, with its
        initializer, a read for the Saver, and a VariableDef for the `variables` collection;
        beside a TF2 step's captured variable, a captured one (a resource placeholder: whoever
        runs the step binds it, see `bind`)."""
        graph = self.graph
        name = graph.unique_name(f"{var}/{suffix}")
        device = graph.node_def(var).device
        self.bytes_saved -= int(np.prod(shape)) * np.dtype(_numpy(dtype)).itemsize
        self.slots_added.append(name)
        if bind.is_resource_placeholder(graph.node_def(var)):
            graph.add_node(name, "Placeholder", [], {
                "dtype": type_attr(types_pb2.DT_RESOURCE), "shape": shape_attr(()),
                "_output_shapes": shapes_attr([()])}, device)
            graph.set_attr(name, SLOT_OF_ATTR, attr_value_pb2.AttrValue(s=var.encode()))
            return name
        b = Builder(graph, name, device)
        zeros = b.const("Initializer/zeros" if initial == 0 else "Initializer/fill",
                        np.full(shape, initial, np.float32), _numpy(dtype))
        kind = type_attr(dtype)
        if resource:
            graph.add_node(name, RESOURCE_VARIABLE, [], {
                "dtype": kind, "shape": shape_attr(shape),
                "container": attr_value_pb2.AttrValue(s=b""),
                "shared_name": attr_value_pb2.AttrValue(s=name.encode())}, device)
            init = b.op("Assign", "AssignVariableOp", [TensorRef(name), zeros], dtype=kind)
            read = b.op("Read/ReadVariableOp", "ReadVariableOp", [TensorRef(name)], dtype=kind)
        else:
            graph.add_node(name, "VariableV2", [], {
                "dtype": kind, "shape": shape_attr(shape),
                "container": attr_value_pb2.AttrValue(s=b""),
                "shared_name": attr_value_pb2.AttrValue(s=b"")}, device)
            init = b.op("Assign", "Assign", [TensorRef(name), zeros], T=kind,
                        use_locking=bool_attr(True), validate_shape=bool_attr(True))
            read = b.op("read", "Identity", [TensorRef(name)], T=kind)
        for group in initializer_groups(graph, var, self.apply):
            graph.add_control(init.node, group)
        definition = variable_pb2.VariableDef(
            variable_name=f"{name}:0", initial_value_name=f"{zeros.node}:0",
            initializer_name=init.node, snapshot_name=f"{read.node}:0", is_resource=resource,
            trainable=False)
        graph.set_attr(name, NEW_VARIABLE_ATTR,
                       attr_value_pb2.AttrValue(s=definition.SerializeToString()))
        graph.set_attr(name, SLOT_OF_ATTR, attr_value_pb2.AttrValue(s=var.encode()))
        self.added.append(NewEntry(name, read, name, dtype, resource))
        return name

    # ---------------------------------------------------------------- slots

    def _remove(self, slot: str, shape: tuple) -> None:
        """Mark a slot of the variable being rewritten (of its `shape`) for removal."""
        self.removed.add(slot)
        self.removed_shapes[slot] = shape

    def finish(self) -> None:
        """Saver entries follow the slots; removed slots go with everything that served only
        them (reads, initializers, restores); inputs of the old updates nothing reads go too."""
        graph = self.graph
        edit_saver(graph, self.removed, self.added)
        # A slot can be read by another's old update until that one goes (Keras's RMSprop
        # momentum reads the mean square): removed while any removal succeeds.
        pending, warn = sorted(self.removed), False
        while pending:
            left = [slot for slot in pending if not remove_variable(graph, slot, warn)]
            if warn:
                self.removed.difference_update(left)
                break
            warn = len(left) == len(pending)
            pending = left
        for slot in self.removed:
            self.bytes_saved += int(np.prod(self.removed_shapes[slot])) * 4
        prune(graph, self.orphans)


def momentum_for(graph: Graph, update: optimizers.Update, asked: str) -> str:
    """What becomes of `update`'s momentum: `asked`, or for "auto" Adam's first moment dropped
    and any other momentum (SGD's, RMSProp's other than 0, Lion's) kept as bfloat16: dropped,
    SGD momentum steps by lr / (1 - momentum) from the first step, and a TF1 ResNet-50 at lr
    0.01, momentum 0.9 (built outside the repo) went from a loss of 6.7 to 68 in two steps.
    Read before the update is rewritten."""
    if asked != "auto":
        return asked
    kept = optimizers.takes_sgd_momentum(graph, update) or update.kind == "lion"
    return "bfloat16" if kept else "drop"


def _numpy(dtype: int):
    import tensorflow as tf

    return tf.dtypes.as_dtype(dtype).as_numpy_dtype
