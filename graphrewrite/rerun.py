"""A recurrent layer's forward call run again right before its backward call.

A Keras RNN traced in a TF2 step stays one call of its forward function (it names an
implementation, `api_implements`, which Grappler may swap for a cuDNN kernel, so it is not
inlined) whose results include the per-iteration values its backward call reads: the layer's
activations, lists of `steps x batch x units`. Every layer's are live from its forward pass to
its backward pass, so the first layer's are held while every later layer computes its forward
and backward passes. Run again once the backward call's gradient inputs exist, a stateless
forward call (no random or stateful op in it: `PartitionedCall`, not the stateful kind) makes
the same values bitwise, and the first run's lists die as soon as their forward readers have
run. The cost is one more forward pass of that layer.
"""

from __future__ import annotations

from tensorflow.core.framework import graph_pb2, node_def_pb2

from .names import COPY_SUFFIX

STATELESS_CALL = "PartitionedCall"
CALL_OPS = (STATELESS_CALL, "StatefulPartitionedCall")


def candidates(graph_def: graph_pb2.GraphDef, backward: set[str]) -> list[tuple[str, str]]:
    """(forward call, backward call) pairs, in graph order: a stateless call whose results a
    call of a backward function (`backward`: the names of functions holding gradient ops)
    reads, neither of them a function of the other's body."""
    calls = {n.name: n for n in graph_def.node if n.op in CALL_OPS}
    pairs = []
    for node in graph_def.node:
        if node.name not in calls or node.attr["f"].func.name not in backward:
            continue
        for source in dict.fromkeys(_source(i) for i in node.input if not i.startswith("^")):
            forward = calls.get(source)
            if (forward is not None and forward.op == STATELESS_CALL
                    and forward.attr["f"].func.name not in backward):
                pairs.append((source, node.name))
    order = {n.name: k for k, n in enumerate(graph_def.node)}
    return sorted(pairs, key=lambda pair: order[pair[0]])


def rerun(graph_def: graph_pb2.GraphDef, forward: str, backward: str) -> graph_pb2.GraphDef:
    """A copy of `graph_def` where `backward` reads a second run of `forward`, which waits on
    every other input of `backward` (so it runs when the backward call could)."""
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {n.name: n for n in result.node}
    copy = node_def_pb2.NodeDef()
    copy.CopyFrom(nodes[forward])
    copy.name = forward + COPY_SUFFIX
    reader = nodes[backward]
    for k, text in enumerate(dict.fromkeys(i for i in reader.input if _source(i) != forward)):
        source = _source(text)
        if text.startswith("^") or nodes[source].op not in CALL_OPS:
            copy.input.append("^" + source)
            continue
        # Inlined, a call's control edge waits only on its body's stateful ops (none in a
        # gradient's), so the copy waits on the value itself, through an Identity.
        wait = result.node.add(name=f"{copy.name}/wait_{k}", op="Identity", input=[text])
        wait.attr["T"].CopyFrom(_output_type(nodes[source], text))
        copy.input.append("^" + wait.name)
    for k, text in enumerate(reader.input):
        if _source(text) == forward:
            reader.input[k] = text.replace(forward, copy.name, 1)
    result.node.append(copy)
    return result


def _output_type(call, text: str):
    """The `AttrValue` of the type of the call's result `text` names."""
    from tensorflow.core.framework import attr_value_pb2

    port = int(text.split(":")[1]) if ":" in text else 0
    return attr_value_pb2.AttrValue(type=call.attr["Tout"].list.type[port])


def _source(text: str) -> str:
    return text.lstrip("^").split(":")[0]
