"""Canonical text dump: one line per node, the format golden files and CI diffs use.

Nodes come in topological order with ties broken by name, so the same graph with its nodes listed
in another order dumps identically (file order cannot be the tie-break: it is what a shuffle
changes). Attributes are sorted; tensor payloads print as dtype, shape and a short content hash;
inputs print canonically (`a:0` and `a` are the same tensor). Functions of the library follow the
graph, and a MetaGraphDef's collections and signatures close the dump.

    mul = Mul(x, y:1, ^init) T=float @/device:CPU:0
"""

from __future__ import annotations

import hashlib
import json

import networkx as nx
from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2, types_pb2

from .graph import Graph

__all__ = ["dump", "node_line", "format_attr", "dtype_name", "format_shape", "format_tensor",
           "dump_function", "function_lines"]


def dump(graph: Graph, meta_graph=None) -> str:
    """The canonical text of `graph` (and of a MetaGraphDef's collections and signatures)."""
    shell = graph.shell
    lines = [f"# graphrewrite dump: {len(graph)} nodes, {len(shell.library.function)} functions, "
             f"versions producer={shell.versions.producer} "
             f"min_consumer={shell.versions.min_consumer}"]
    for name in graph.topological_order(tie_break="name"):
        node = graph.node_def(name)
        lines.append(node_line(name, node.op, [str(r) for r in graph.inputs(name)], node.attr,
                               node.device))
    for function in sorted(shell.library.function, key=lambda f: f.signature.name):
        lines.extend(function_lines(function))
    for gradient in sorted(shell.library.gradient, key=lambda g: g.function_name):
        lines.append(f"gradient {gradient.function_name} = {gradient.gradient_func}")
    if meta_graph is not None:
        lines.extend(_meta_graph_lines(meta_graph))
    return "\n".join(lines) + "\n"


def node_line(name: str, op: str, inputs, attrs, device: str = "") -> str:
    parts = [f"{name} = {op}({', '.join(inputs)})"]
    parts.extend(f"{key}={format_attr(attrs[key])}" for key in sorted(attrs))
    if device:
        parts.append(f"@{device}")
    return " ".join(parts)


def format_attr(value: attr_value_pb2.AttrValue) -> str:
    kind = value.WhichOneof("value")
    if kind == "list":
        return "[" + ", ".join(_format_list(value.list)) + "]"
    if kind is None:
        return "<unset>"
    return _format_scalar(kind, getattr(value, kind))


def _format_scalar(kind: str, item) -> str:
    if kind == "s":
        return json.dumps(item.decode("utf-8", errors="backslashreplace"))
    if kind == "b":
        return "true" if item else "false"
    if kind in ("i", "f"):
        return repr(item)
    if kind == "type":
        return dtype_name(item)
    if kind == "shape":
        return format_shape(item)
    if kind == "tensor":
        return format_tensor(item)
    if kind == "func":
        attrs = ",".join(f"{k}={format_attr(item.attr[k])}" for k in sorted(item.attr))
        return f"@{item.name}" + (f"{{{attrs}}}" if attrs else "")
    if kind == "placeholder":
        return f"${item}"
    return str(item)


def _format_list(values: attr_value_pb2.AttrValue.ListValue) -> list[str]:
    for kind in ("s", "i", "f", "b", "type", "shape", "tensor", "func"):
        items = getattr(values, kind)
        if len(items):
            return [_format_scalar(kind, item) for item in items]
    return []


def dtype_name(dtype: int) -> str:
    """`DT_FLOAT` -> `float`, `DT_RESOURCE` -> `resource`; unknown numbers print as `dtype7000`."""
    try:
        return types_pb2.DataType.Name(dtype)[3:].lower()
    except ValueError:
        return f"dtype{dtype}"


def format_shape(shape: tensor_shape_pb2.TensorShapeProto) -> str:
    if shape.unknown_rank:
        return "<?>"
    return "[" + ",".join("?" if d.size < 0 else str(d.size) for d in shape.dim) + "]"


def format_tensor(tensor) -> str:
    """`tensor<float[3,3]>#1a2b3c4d`: dtype, shape, and a hash of the serialized payload."""
    digest = hashlib.sha256(tensor.SerializeToString(deterministic=True)).hexdigest()[:8]
    return f"tensor<{dtype_name(tensor.dtype)}{format_shape(tensor.tensor_shape)}>#{digest}"


def dump_function(function) -> str:
    """The canonical text of one library function."""
    return "\n".join(function_lines(function))


def function_lines(function) -> list[str]:
    sig = function.signature
    args = ", ".join(f"{a.name}: {_arg_type(a)}" for a in sig.input_arg)
    outs = ", ".join(f"{a.name}: {_arg_type(a)}" for a in sig.output_arg)
    header = f"function {sig.name}({args}) -> ({outs})"
    if function.attr:
        header += " " + " ".join(f"{k}={format_attr(function.attr[k])}"
                                 for k in sorted(function.attr))
    lines = [header]
    by_name = {n.name: n for n in function.node_def}
    order = nx.DiGraph()
    order.add_nodes_from(by_name)
    for node in function.node_def:
        for text in node.input:
            producer = text.lstrip("^").split(":")[0]
            if producer in by_name and producer != node.name:
                order.add_edge(producer, node.name)
    try:
        names = list(nx.lexicographical_topological_sort(order))
    except nx.NetworkXUnfeasible:
        names = sorted(by_name)
    for name in names:
        node = by_name[name]
        lines.append("  " + node_line(name, node.op, node.input, node.attr, node.device))
    for key in sorted(function.ret):
        lines.append(f"  return {key} = {function.ret[key]}")
    for key in sorted(function.control_ret):
        lines.append(f"  return ^{key} = {function.control_ret[key]}")
    return lines


def _arg_type(arg) -> str:
    if arg.type_attr:
        return "$" + arg.type_attr
    if arg.type_list_attr:
        return "$" + arg.type_list_attr
    return dtype_name(arg.type)


def _meta_graph_lines(meta_graph) -> list[str]:
    lines = [f"collection {key} = {_collection_values(meta_graph.collection_def[key])}"
             for key in sorted(meta_graph.collection_def)]
    for key in sorted(meta_graph.signature_def):
        signature = meta_graph.signature_def[key]
        ins = ", ".join(f"{k}={signature.inputs[k].name}" for k in sorted(signature.inputs))
        outs = ", ".join(f"{k}={signature.outputs[k].name}" for k in sorted(signature.outputs))
        lines.append(f"signature {key} {signature.method_name}: ({ins}) -> ({outs})")
    return lines


def _collection_values(collection) -> str:
    """Names and numbers as JSON; serialized protos (variables, savers) as a count and a hash."""
    kind = collection.WhichOneof("kind")
    if kind is None:
        return "[]"
    values = list(getattr(collection, kind).value)
    if kind == "node_list" or kind in ("int64_list", "float_list"):
        return json.dumps(values)
    blobs = [v if isinstance(v, bytes) else v.SerializeToString(deterministic=True)
             for v in values]
    digest = hashlib.sha256(b"\0".join(blobs)).hexdigest()[:8]
    return f"<{len(values)} {kind} entries>#{digest}"
