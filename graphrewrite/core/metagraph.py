"""A MetaGraphDef's collections kept true to a rewritten graph.

`import_meta_graph` rebuilds every variable from the `VariableDef`s of the variable collections
(`variables`, `trainable_variables`, ...) and fails on one naming a node the graph lacks; a
pass that removes variables (diet's dropped optimizer slots) would leave such entries, and one
that adds variables must list them, or `global_variables_initializer()` never initialises them.

So when a graph goes back into its container (`Model.with_graph`): entries naming nodes that the
original graph had and the new one does not are dropped (from node lists, variable collections
and v1 loop and cond contexts, whose values a v1 loop's rewrite may remove), and a new variable
node carrying a serialized `VariableDef` in the attribute NEW_VARIABLE_ATTR is added to
`variables`.
Collections of untouched graphs are left exactly as they were, except entries naming nodes the
graph never had (`dangling`: an optimizer applied inside a `cond_v2` branch lists its op, which
lives in the branch's function), which make `import_meta_graph` fail: `io.load` drops those.
"""

from __future__ import annotations

from tensorflow.core.framework import variable_pb2

__all__ = ["NEW_VARIABLE_ATTR", "VARIABLE_COLLECTIONS", "GLOBAL_VARIABLES", "sync", "dangling",
           "drop_dangling"]

NEW_VARIABLE_ATTR = "_graphrewrite_variable_def"
VARIABLE_COLLECTIONS = frozenset({
    "variables", "trainable_variables", "local_variables", "model_variables",
    "moving_average_variables", "global_step", "metric_variables"})
GLOBAL_VARIABLES = "variables"
# v1 control-flow contexts: collection -> message. Their values name the loop's and the cond's
# tensors; `import_meta_graph` looks each one up.
CONTEXTS = {"while_context": "WhileContextDef", "cond_context": "CondContextDef"}


def _node(name: str) -> str:
    return name.lstrip("^").split(":")[0]


def dangling(meta_graph, graph) -> dict[str, list[str]]:
    """The nodes each node-list or variable collection names that `graph` lacks: an op made
    inside a `cond_v2` branch or a `while_v2` body lives in that function, and a `train_op`
    collection naming it makes `import_meta_graph` fail (KeyError)."""
    found = {}
    for key, collection in sorted(meta_graph.collection_def.items()):
        names = _names(key, collection)
        missing = [n for n in names if _node(n) not in graph] if names is not None else []
        if missing:
            found[key] = missing
    return found


def drop_dangling(meta_graph, found: dict[str, list[str]]) -> None:
    """Drop the entries `dangling` found, and a collection left empty by it (so that what a
    step fetches is found from the graph, not from an empty `train_op`)."""
    _drop(meta_graph, {_node(n) for names in found.values() for n in names})
    for key in found:
        names = _names(key, meta_graph.collection_def[key])
        if not names:
            del meta_graph.collection_def[key]


def _names(key: str, collection) -> list[str] | None:
    if collection.HasField("node_list"):
        return list(collection.node_list.value)
    if collection.HasField("bytes_list") and key in VARIABLE_COLLECTIONS:
        return [_variable_def(v).variable_name for v in collection.bytes_list.value]
    return None


def _drop(meta_graph, gone: set[str]) -> None:
    """Drop every collection entry naming a node of `gone`."""
    for key, collection in meta_graph.collection_def.items():
        if collection.HasField("node_list"):
            kept = [v for v in collection.node_list.value if _node(v) not in gone]
            if len(kept) != len(collection.node_list.value):
                del collection.node_list.value[:]
                collection.node_list.value.extend(kept)
        elif collection.HasField("bytes_list") and key in VARIABLE_COLLECTIONS:
            kept = [v for v in collection.bytes_list.value
                    if _node(_variable_def(v).variable_name) not in gone]
            if len(kept) != len(collection.bytes_list.value):
                del collection.bytes_list.value[:]
                collection.bytes_list.value.extend(kept)
        elif collection.HasField("bytes_list") and key in CONTEXTS:
            collection.bytes_list.value[:] = [_context(CONTEXTS[key], v, gone)
                                              for v in collection.bytes_list.value]


def sync(meta_graph, old_graph, new_graph) -> None:
    """Drop entries of nodes `old_graph` had and `new_graph` lost; list new variables."""
    gone = {n for n in old_graph.nodes() if n not in new_graph}
    if gone:
        _drop(meta_graph, gone)
    listed = {_node(_variable_def(v).variable_name)
              for v in meta_graph.collection_def[GLOBAL_VARIABLES].bytes_list.value} \
        if GLOBAL_VARIABLES in meta_graph.collection_def else set()
    for name in new_graph.nodes():
        attr = new_graph.node_def(name).attr
        if NEW_VARIABLE_ATTR in attr and name not in listed and name not in old_graph:
            meta_graph.collection_def[GLOBAL_VARIABLES].bytes_list.value.append(
                attr[NEW_VARIABLE_ATTR].s)


def _context(kind: str, data: bytes, gone: set) -> bytes:
    """A serialized v1 loop or cond context without the values of nodes in `gone`."""
    from tensorflow.core.protobuf import control_flow_pb2

    context = getattr(control_flow_pb2, kind).FromString(data)
    _drop_values(context, gone)
    return context.SerializeToString()


def _drop_values(context, gone: set) -> None:
    values = context.values_def
    values.values[:] = [v for v in values.values if _node(v) not in gone]
    for key in [k for k, v in values.external_values.items()
                if _node(k) in gone or _node(v) in gone]:
        del values.external_values[key]
    for nested in getattr(context, "nested_contexts", []):
        _drop_values(nested.cond_ctxt if nested.HasField("cond_ctxt") else nested.while_ctxt,
                     gone)


def _variable_def(data: bytes) -> variable_pb2.VariableDef:
    out = variable_pb2.VariableDef()
    out.ParseFromString(data)
    return out
