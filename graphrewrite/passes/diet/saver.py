"""A TF1 Saver's entries in the graph: drop some, add others, so a checkpoint follows the variables.

A Saver writes with `SaveV2(prefix, tensor_names, shape_and_slices, tensors...)` and reads back
with `RestoreV2(prefix, tensor_names, shape_and_slices)`, whose output k goes (through an
`Identity`, or directly for a ref variable) to the `Assign`/`AssignVariableOp` of the variable
named by entry k; a NoOp (`save/restore_all`, or a shard's) waits for every such assign. A pass
that removes variables or adds new ones edits these lists here, in one place: the names are
`Const` string vectors, the dtypes an attribute, RestoreV2's outputs renumbered.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import attr_value_pb2

from ...core.graph import Graph
from ...core.tensor_ref import TensorRef

__all__ = ["SAVE_OPS", "RESTORE_OPS", "READ_OPS", "ASSIGN_OPS", "NewEntry", "entry_variable",
           "edit", "drop_control"]

SAVE_OPS = ("SaveV2",)
RESTORE_OPS = ("RestoreV2",)
READ_OPS = ("ReadVariableOp", "Identity")
ASSIGN_OPS = ("Assign", "AssignVariableOp")


@dataclass(frozen=True)
class NewEntry:
    """A variable to save and restore: its checkpoint name, the tensor holding its value, the
    variable node, its dtype enum, and whether it is a resource variable."""

    key: str
    value: TensorRef
    variable: str
    dtype: int
    resource: bool


def entry_variable(graph: Graph, ref: TensorRef) -> str:
    """The variable a SaveV2 input reads: the node itself (a ref variable) or a read's input."""
    if graph.op(ref.node) in READ_OPS and graph.data_inputs(ref.node):
        return graph.data_inputs(ref.node)[0].node
    return ref.node


def edit(graph: Graph, removed: set[str], added: list[NewEntry]) -> int:
    """Drop every entry of a variable in `removed` and append `added` to every SaveV2/RestoreV2
    pair; the restore assigns of removed variables are left for the caller to remove with the
    variables. Returns how many savers were edited."""
    edited = 0
    for name in graph.nodes():
        if name not in graph:  # removed with an entry of an earlier saver op
            continue
        op = graph.op(name)
        if op in SAVE_OPS:
            edited += _edit_save(graph, name, removed, added)
        elif op in RESTORE_OPS:
            edited += _edit_restore(graph, name, removed, added)
    return edited


def _strings(graph: Graph, ref: TensorRef) -> list[bytes] | None:
    from tensorflow.python.framework import tensor_util

    node = graph.node_def(ref.node)
    if node.op != "Const":
        return None
    return [bytes(v) for v in tensor_util.MakeNdarray(node.attr["value"].tensor).ravel()]


def _set_strings(graph: Graph, ref: TensorRef, values: list[bytes]) -> None:
    from tensorflow.python.framework import tensor_util

    proto = tensor_util.make_tensor_proto(np.array(values, dtype=object), shape=[len(values)])
    graph.set_attr(ref.node, "value", attr_value_pb2.AttrValue(tensor=proto))
    shapes = attr_value_pb2.AttrValue()
    shapes.list.shape.add().dim.add(size=len(values))
    if "_output_shapes" in graph.node_def(ref.node).attr:
        graph.set_attr(ref.node, "_output_shapes", shapes)


def _dtypes(values: list[int]) -> attr_value_pb2.AttrValue:
    out = attr_value_pb2.AttrValue()
    out.list.type.extend(values)
    return out


def _attrs(graph: Graph, name: str) -> dict:
    return {k: v for k, v in graph.node_def(name).attr.items()}


def _edit_save(graph: Graph, name: str, removed: set[str], added: list[NewEntry]) -> bool:
    prefix, names_ref, slices_ref, *tensors = graph.data_inputs(name)
    names, slices = _strings(graph, names_ref), _strings(graph, slices_ref)
    dtypes = list(graph.node_def(name).attr["dtypes"].list.type)
    if names is None or slices is None or len(names) != len(tensors):
        return False
    keep = [i for i, t in enumerate(tensors) if entry_variable(graph, t) not in removed]
    if len(keep) == len(tensors) and not added:
        return False
    names = [names[i] for i in keep] + [e.key.encode() for e in added]
    slices = [slices[i] for i in keep] + [b""] * len(added)
    tensors = [tensors[i] for i in keep] + [e.value for e in added]
    attrs = _attrs(graph, name)
    attrs["dtypes"] = _dtypes([dtypes[i] for i in keep] + [e.dtype for e in added])
    _set_strings(graph, names_ref, names)
    _set_strings(graph, slices_ref, slices)
    controls = [TensorRef(c, -1) for c in graph.control_inputs(name)]
    graph.redefine(name, graph.op(name), [prefix, names_ref, slices_ref, *tensors, *controls],
                   attrs)
    return True


def _restore_target(graph: Graph, ref: TensorRef) -> tuple[str, str] | None:
    """(assign node, variable) that output `ref` of a RestoreV2 goes to, through an Identity."""
    for user, slot in graph.consumers(ref):
        if graph.op(user) in ASSIGN_OPS and slot == 1:
            return user, graph.data_inputs(user)[0].node
        if graph.op(user) == "Identity":
            found = _restore_target(graph, TensorRef(user))
            if found:
                return found
    return None


def _edit_restore(graph: Graph, name: str, removed: set[str], added: list[NewEntry]) -> bool:
    prefix, names_ref, slices_ref = graph.data_inputs(name)[:3]
    names, slices = _strings(graph, names_ref), _strings(graph, slices_ref)
    dtypes = list(graph.node_def(name).attr["dtypes"].list.type)
    if names is None or slices is None or len(names) != len(dtypes):
        return False
    targets = [_restore_target(graph, TensorRef(name, k)) for k in range(len(names))]
    gone = [k for k, t in enumerate(targets) if t is not None and t[1] in removed]
    if not gone and not added:
        return False
    keep = [k for k in range(len(names)) if k not in gone]
    group = _restore_group(graph, [t[0] for t in targets if t is not None])
    # Entries of removed variables lose their restore assigns and the Identity before them,
    # then the others move down in order.
    for k in gone:
        assign = targets[k][0]
        for user in graph.successors(assign):
            drop_control(graph, user, assign)
        chain = [r.node for r in graph.data_inputs(assign)[1:]]
        graph.remove_node(assign)
        for node in chain:
            if node != name and graph.op(node) == "Identity" and not graph.successors(node):
                graph.remove_node(node)
    for new_port, old_port in enumerate(keep):
        if new_port != old_port:
            graph.replace_uses(TensorRef(name, old_port), TensorRef(name, new_port))
    attrs = _attrs(graph, name)
    attrs["dtypes"] = _dtypes([dtypes[k] for k in keep] + [e.dtype for e in added])
    _set_strings(graph, names_ref, [names[k] for k in keep] + [e.key.encode() for e in added])
    _set_strings(graph, slices_ref, [slices[k] for k in keep] + [b""] * len(added))
    graph.set_attr(name, "dtypes", attrs["dtypes"])
    if "_output_shapes" in graph.node_def(name).attr:  # one per entry: stale now
        graph.redefine(name, graph.op(name), graph.inputs(name),
                       {k: v for k, v in _attrs(graph, name).items() if k != "_output_shapes"})
    for index, entry in enumerate(added, len(keep)):
        out = TensorRef(name, index)
        base = entry.variable + "/graphrewrite_restore"
        dtype = attr_value_pb2.AttrValue(type=entry.dtype)
        value = TensorRef(graph.add_node(graph.unique_name(base + "/Identity"), "Identity",
                                         [out], {"T": dtype}))
        if entry.resource:
            assign = graph.add_node(graph.unique_name(base), "AssignVariableOp",
                                    [TensorRef(entry.variable), value], {"dtype": dtype})
        else:
            assign = graph.add_node(graph.unique_name(base), "Assign",
                                    [TensorRef(entry.variable), value],
                                    {"T": dtype, "use_locking": attr_value_pb2.AttrValue(b=True),
                                     "validate_shape": attr_value_pb2.AttrValue(b=True)})
        if group:
            graph.add_control(assign, group)
    return True


def drop_control(graph: Graph, node: str, before: str) -> None:
    """Remove the control dependency of `node` on `before` (its op, inputs and attributes
    otherwise unchanged)."""
    inputs = [r for r in graph.inputs(node) if not (r.is_control and r.node == before)]
    graph.redefine(node, graph.op(node), inputs, _attrs(graph, node))


def _restore_group(graph: Graph, assigns: list[str]) -> str | None:
    """The NoOp every restore assign of one RestoreV2 is a control input of."""
    for assign in assigns:
        for user, slot in graph.consumers(assign):
            if slot == -1 and graph.op(user) == "NoOp":
                return user
    return None
