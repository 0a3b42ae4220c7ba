"""Function calls as the step runs them: a call's body inlined into the graph.

A TF2 Keras recurrent layer traced in a `tf.function` step is a `PartitionedCall` of its forward
function (which returns, besides its outputs, the per-iteration values its gradient needs) and
another of its backward function. Grappler keeps such calls (they carry `api_implements`, for
the implementation selector), and the runtime runs each body on the step's allocator, with its
while loop lowered. The memory model sees a call as one node with unknown outputs unless the
bodies are spliced in: each call node becomes the nodes of its body (named `<call>/<node>`),
its arguments `Identity`s of the call's inputs, and the call itself an `IdentityN` over the
body's results, so its readers and control dependants are unchanged.
"""

from __future__ import annotations

import logging

from tensorflow.core.framework import graph_pb2

log = logging.getLogger(__name__)

CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
LOOP_OPS = frozenset({"While", "StatelessWhile"})  # only bodies with a loop are inlined
DEPTH = 4  # calls inside inlined bodies, inlined in turn


def inline_calls(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef | None:
    """A copy of `graph_def` with the calls of functions that run a loop inlined; None when it
    has none or a body cannot be read."""
    functions = {f.signature.name: f for f in graph_def.library.function
                 if any(n.op in LOOP_OPS for n in f.node_def)}
    return _inlined(graph_def, functions)


def inline_gradient_calls(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef | None:
    """A copy of `graph_def` with the step's passes spliced in: a `tf.function` called inside
    a differentiated step is a call of its forward function (returning, besides its outputs,
    every activation its gradient reads) and a call of its backward function. Calls of
    functions holding gradient ops, and the calls whose results those read, are inlined, and
    their results read from the body directly (the `IdentityN` in between would be the one
    tensor every activation passes through, and hide every bottleneck). Calls that name an
    implementation (`api_implements`: Keras RNNs, which Grappler swaps for cuDNN kernels on a
    GPU) or ask for XLA are left whole. None when there is nothing to inline."""
    from .split import backward_functions

    library = {f.signature.name: f for f in graph_def.library.function}
    backward = backward_functions(graph_def.library)

    def inlinable(node) -> bool:
        function = library.get(node.attr["f"].func.name)
        return (node.op in CALL_OPS and function is not None
                and "api_implements" not in function.attr
                and not node.attr["_XlaMustCompile"].b
                and not function.attr["_XlaMustCompile"].b)

    calls = {n.name: n for n in graph_def.node if inlinable(n)}
    chosen = {name for name, n in calls.items() if n.attr["f"].func.name in backward}
    chosen |= {i.lstrip("^").split(":")[0] for name in chosen for i in calls[name].input
               if i.lstrip("^").split(":")[0] in calls}
    if not chosen:
        return None
    functions = {calls[name].attr["f"].func.name: library[calls[name].attr["f"].func.name]
                 for name in chosen}
    inlined = _inlined(graph_def, functions, only=chosen)
    return None if inlined is None else _read_results_directly(inlined, chosen)


def _read_results_directly(graph_def: graph_pb2.GraphDef, calls: set) -> graph_pb2.GraphDef:
    """Data readers of an inlined call's `IdentityN` read the body's result instead; control
    dependants still wait on the `IdentityN`, which waits on the body's control outputs."""
    results = {n.name: [i for i in n.input if not i.startswith("^")] for n in graph_def.node
               if n.name in calls and n.op == "IdentityN"}
    for node in graph_def.node:
        for k, text in enumerate(node.input):
            name, _, port = text.partition(":")
            if name in results and node.name not in results:
                node.input[k] = results[name][int(port or 0)]
    return graph_def


def _inlined(graph_def: graph_pb2.GraphDef, functions: dict,
             only: set | None = None) -> graph_pb2.GraphDef | None:
    """`graph_def` with the calls of `functions` (only the nodes named in `only`, when given)
    replaced by their bodies; None when there is no such call."""
    def called(node) -> bool:
        return node.op in CALL_OPS and node.attr["f"].func.name in functions and (
            only is None or node.name in only)

    if not any(called(n) for n in graph_def.node):
        return None
    import tensorflow as tf

    library = graph_pb2.GraphDef(library=graph_def.library, versions=graph_def.versions)
    holder = tf.Graph()  # the body's own calls (its loop's cond and body) must be known
    with holder.as_default():
        tf.graph_util.import_graph_def(library, name="")
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    for _ in range(DEPTH):
        calls = [n for n in result.node if called(n)]
        if not calls:
            break
        kept = [n for n in result.node if n not in calls]
        added = []
        for call in calls:
            with holder.as_default():
                body = _body(functions[call.attr["f"].func.name], call)
            if body is None:
                return None
            added.extend(body)
        del result.node[:]
        result.node.extend(kept + added)
    return result


def _body(function, call) -> list | None:
    """The nodes that replace `call`: its body renamed under the call's name, arguments
    `Identity`s of the call's inputs, results gathered by an `IdentityN` named like the call."""
    from tensorflow.core.framework import node_def_pb2
    from tensorflow.python.framework import function_def_to_graph

    try:
        body, flat = function_def_to_graph.function_def_to_graph_def(function)
    except (ValueError, KeyError, TypeError) as err:
        log.warning("cannot inline the body of %s (%s)", call.name, err)
        return None
    prefix = call.name + "/"
    data = [i for i in call.input if not i.startswith("^")]
    controls = [i for i in call.input if i.startswith("^")]
    args = {arg.name: i for i, arg in enumerate(function.signature.input_arg)}
    nodes = []
    for node in body.node:
        copy = node_def_pb2.NodeDef()
        copy.CopyFrom(node)
        copy.name = prefix + node.name
        if node.name in args and node.op == "Placeholder":
            copy.op = "Identity"
            copy.ClearField("attr")
            copy.attr["T"].type = node.attr["dtype"].type
            del copy.input[:]
            copy.input.extend([data[args[node.name]]] + controls)
        else:
            del copy.input[:]
            copy.input.extend(_renamed(i, prefix) for i in node.input)
        if call.device and not copy.device:
            copy.device = call.device
        nodes.append(copy)
    results = node_def_pb2.NodeDef(name=call.name, op="IdentityN", device=call.device)
    for arg in function.signature.output_arg:
        results.input.append(_renamed(flat[function.ret[arg.name]], prefix))
    results.input.extend("^" + prefix + function.control_ret[name]
                         for name in function.signature.control_output)
    results.attr["T"].list.type.extend(call.attr["Tout"].list.type)
    nodes.append(results)
    return nodes


def _renamed(text: str, prefix: str) -> str:
    return "^" + prefix + text[1:] if text.startswith("^") else prefix + text
