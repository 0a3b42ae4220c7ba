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

from .memory import SAVER_OPS
from .split import CALL_OPS, UPDATE_PREFIXES, VARIABLE_WRITES, backward_functions, xla_compiled

__all__ = ["CALL_OPS", "LOOP_OPS", "DEPTH", "inline_calls", "inline_gradient_calls",
           "inline_update_calls"]

log = logging.getLogger(__name__)

LOOP_OPS = frozenset({"While", "StatelessWhile"})  # only bodies with a loop are inlined
DEPTH = 4  # calls inside inlined bodies, inlined in turn


def inline_calls(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef | None:
    """A copy of `graph_def` with the calls of functions that run a loop, or call one that does
    (a Keras GRU in a nested `tf.function`: 1.9 MiB modelled, 11.1 measured), and of functions
    XLA compiles (`jit_compile=True`: a whole step in one, modelled as the executor would run
    it, is an estimate of XLA's own buffers; as one node, 7.1 MiB against 70.8 measured),
    inlined; None when it has none or a body cannot be read."""
    library = {f.signature.name: f for f in graph_def.library.function}
    looping = {name for name, f in library.items() if any(n.op in LOOP_OPS for n in f.node_def)}
    looping |= {n.attr["f"].func.name for n in graph_def.node if n.op in CALL_OPS
                and n.attr["f"].func.name in library and xla_compiled(n, library)}
    while True:  # the callers of those, in turn
        more = {name for name, f in library.items() if name not in looping and any(
            n.op in CALL_OPS and n.attr["f"].func.name in looping for n in f.node_def)}
        if not more:
            break
        looping |= more
    return _inlined(graph_def, {name: library[name] for name in looping})


def inline_gradient_calls(graph_def: graph_pb2.GraphDef
                          ) -> tuple[graph_pb2.GraphDef, list[str]] | None:
    """A copy of `graph_def` with the step's passes spliced in: a `tf.function` called inside
    a differentiated step is a call of its forward function (returning, besides its outputs,
    every activation its gradient reads) and a call of its backward function. Calls of
    functions holding gradient ops, and the calls whose results those read, are inlined, and
    their results read from the body directly (the `IdentityN` in between would be the one
    tensor every activation passes through, and hide every bottleneck); then the calls in
    their bodies, in turn (a SavedModel's signature calls the step, which may call its forward
    pass). Calls that name an implementation (`api_implements`: Keras RNNs, which Grappler
    swaps for cuDNN kernels on a GPU) or ask for XLA are left whole. Returns the graph and
    the calls inlined; None when there is nothing to inline."""
    result, names = None, []
    for _ in range(DEPTH):
        before = result or graph_def
        inlined = _inline_gradient_calls_once(before)
        if inlined is None:
            break
        names += sorted({n.name for n in before.node if n.op in CALL_OPS}
                        - {n.name for n in inlined.node if n.op in CALL_OPS})
        result = inlined
    return None if result is None else (result, names)


def inline_update_calls(graph_def: graph_pb2.GraphDef
                        ) -> tuple[graph_pb2.GraphDef, list[str]] | None:
    """A copy of `graph_def` with the calls of functions that write variables inlined, their
    arguments read from the call's inputs: a Keras optimizer on a machine with a GPU updates
    each variable in a call of an XLA-compiled function, where no rewrite of its variables
    sees the update. Inlined, an XLA-compiled update runs on TensorFlow's kernels, which may
    round otherwise: for rewrites that change the numbers anyway (diet). Returns the graph and
    the calls inlined; None when there is none."""
    library = {f.signature.name: f for f in graph_def.library.function}
    writing = {name for name, f in library.items() if any(
        n.op in VARIABLE_WRITES or n.op.startswith(UPDATE_PREFIXES) for n in f.node_def)
        and not any(n.op in SAVER_OPS for n in f.node_def)}  # a SavedModel's restore: kept
    calls = {n.name: n for n in graph_def.node
             if n.op in CALL_OPS and n.attr["f"].func.name in writing}
    if not calls:
        return None
    functions = {n.attr["f"].func.name: library[n.attr["f"].func.name] for n in calls.values()}
    argument_of = {f"{name}/{arg.name}": name for name, n in calls.items()
                   for arg in functions[n.attr["f"].func.name].signature.input_arg}
    inlined = _inlined(graph_def, functions, only=set(calls))
    if inlined is None:
        return None
    # what the call waited for (a variable's forward read), each reader of its arguments does
    waits = {name: [i for i in n.input if i.startswith("^")] for name, n in calls.items()}
    for node in inlined.node:
        if node.name not in argument_of:
            calls_read = {argument_of.get(i.split(":")[0]) for i in node.input} - {None}
            node.input.extend(dict.fromkeys(w for call in sorted(calls_read)
                                            for w in waits[call] if w not in node.input))
    read = {i.lstrip("^").split(":")[0] for n in graph_def.node for i in n.input}
    return _read_directly(inlined, set(calls) & read, set(argument_of)), sorted(calls)


def _inline_gradient_calls_once(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef | None:
    """`inline_gradient_calls`, one level of calls deep."""
    library = {f.signature.name: f for f in graph_def.library.function}
    backward = backward_functions(graph_def.library)

    def inlinable(node) -> bool:
        if node.op not in CALL_OPS:  # `attr[key]` of another node would add the key to it
            return False
        function = library.get(node.attr["f"].func.name)
        return (function is not None and "api_implements" not in function.attr
                and not xla_compiled(node, library))

    calls = {n.name: n for n in graph_def.node if inlinable(n)}
    chosen = {name for name, n in calls.items() if n.attr["f"].func.name in backward}
    chosen |= {i.lstrip("^").split(":")[0] for name in chosen for i in calls[name].input
               if i.lstrip("^").split(":")[0] in calls}
    if not chosen:
        return None
    read = {i.lstrip("^").split(":")[0] for n in graph_def.node for i in n.input}
    functions = {calls[name].attr["f"].func.name: library[calls[name].attr["f"].func.name]
                 for name in chosen}
    # A call without control inputs: its arguments' `Identity`s add nothing to wait for.
    arguments = {f"{name}/{arg.name}" for name in chosen
                 if not any(i.startswith("^") for i in calls[name].input)
                 for arg in functions[calls[name].attr["f"].func.name].signature.input_arg}
    inlined = _inlined(graph_def, functions, only=chosen)
    return None if inlined is None else _read_directly(inlined, chosen & read, arguments)


def _read_directly(graph_def: graph_pb2.GraphDef, calls: set,
                   arguments: set) -> graph_pb2.GraphDef:
    """Data readers of an inlined call's results (`IdentityN`) read the body's values, and the
    body's readers of an argument (`Identity`) read the call's input: an alias between an
    activation and its backward readers would keep it alive whatever is recomputed. Control
    dependants still wait on the call's name, now a `NoOp` waiting on the body's results and
    control outputs (an `IdentityN` would hold every activation until it ran); the arguments'
    `Identity`s go. A call nothing reads (a SavedModel signature's, which the signature names)
    keeps its `IdentityN`: `calls` are the others."""
    aliases = {n.name: [i for i in n.input if not i.startswith("^")] for n in graph_def.node
               if n.name in calls and n.op == "IdentityN" or n.name in arguments}

    def resolved(text: str) -> str:
        name, _, port = text.partition(":")
        while name in aliases:  # a result may be an argument passed straight through
            text = aliases[name][int(port or 0)]
            name, _, port = text.partition(":")
        return text

    for node in graph_def.node:
        if node.name in arguments:
            continue
        for k, text in enumerate(node.input):
            if not text.startswith("^") and (node.name not in calls or
                                             text.partition(":")[0] in arguments):
                node.input[k] = resolved(text)
    kept = [n for n in graph_def.node if n.name not in arguments]
    for node in kept:
        if node.name in calls and node.op == "IdentityN":  # read by control edges alone now
            waits = dict.fromkeys("^" + i.lstrip("^").split(":")[0] for i in node.input)
            node.op = "NoOp"
            node.ClearField("attr")
            del node.input[:]
            node.input.extend(waits)
    del graph_def.node[:]
    graph_def.node.extend(kept)
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
    nodes, names = [], {n.name for n in body.node}
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
        _with_default_attrs(copy)
        _recolocate(copy, prefix, names)
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


def _with_default_attrs(node) -> None:
    """Give `node` the attributes its op defaults that it lacks: a SavedModel's functions are
    stored without them (a `MatMul` without `grad_a`), and shape inference refuses such a node."""
    from tensorflow.python.framework import op_def_registry

    op_def = op_def_registry.get(node.op)
    for attr in op_def.attr if op_def is not None else ():
        if attr.name not in node.attr and attr.HasField("default_value"):
            node.attr[attr.name].CopyFrom(attr.default_value)


def _recolocate(node, prefix: str, names: set) -> None:
    """A body node's colocation (`_class: loc:@x`) follows `x` under the call's prefix; one
    naming no node of the body (a function argument's name outside it) is dropped: the
    importer refuses a colocation with a node that does not exist."""
    if "_class" not in node.attr:
        return
    kept = [v for v in node.attr["_class"].list.s if v.startswith(b"loc:@")
            and v[5:].decode() in names]
    if kept:
        del node.attr["_class"].list.s[:]
        node.attr["_class"].list.s.extend(b"loc:@" + prefix.encode() + v[5:] for v in kept)
    else:
        del node.attr["_class"]


def _renamed(text: str, prefix: str) -> str:
    return "^" + prefix + text[1:] if text.startswith("^") else prefix + text
