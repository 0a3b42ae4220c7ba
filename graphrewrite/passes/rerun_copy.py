"""A recurrent layer's forward pass run again right before its backward pass.

A Keras RNN keeps every step's values for its gradient: traced in a TF2 step, its forward pass
stays one call of its forward function (it names an implementation, `api_implements`, which
Grappler may swap for a cuDNN kernel, so it is not inlined) whose results include those values,
which a call of its backward function reads; built in a TF1 graph, it is a `While` whose
accumulated lists a gradient `While` reads. Every layer's lists are live from its forward pass
to its backward pass, so the first layer's are held while every later layer computes its
forward and backward passes. Run again once the backward pass's other inputs exist, the same
forward pass makes the same values bitwise, and the first run's lists die as soon as their
forward readers have run. The cost is one more forward pass of that layer.

It must compute the same values: no stateful op in it but reads of variables, and none of
those variables written before the backward pass has run (the optimizer's updates of a layer
wait on its gradient; any other write disqualifies the pair).
"""

from __future__ import annotations

from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2

from ..analysis.inline import CALL_OPS, LOOP_OPS
from ..analysis.split import reachable
from ..core import dtypes, ops
from ..core.graph import Graph
from ..core.names import COPY_SUFFIX
from ..core.tensor_ref import TensorRef

__all__ = ["FUNCTIONAL", "FUNCTION_ATTRS", "READ", "candidates", "functions", "rerun"]

FUNCTIONAL = CALL_OPS | LOOP_OPS
FUNCTION_ATTRS = ("f", "body", "cond", "then_branch", "else_branch", "branches")
READ = "ReadVariableOp"


def candidates(graph: Graph, backward: set[str], fetches: list[str]) -> list[tuple[str, str]]:
    """(forward pass, backward pass) pairs in graph order: a call or loop running no function
    of `backward` (those holding gradient ops) whose results a call or loop running one reads,
    that computes the same values when run again later in the step `fetches` run (see the
    module's docstring)."""
    step = reachable(graph.nx, [f.split(":")[0] for f in fetches], upstream=True)
    library = {f.signature.name: f for f in graph.shell.library.function}
    pairs = []
    for name in graph.nodes():
        if graph.op(name) not in FUNCTIONAL or \
                not functions(graph.node_def(name)) & backward:
            continue
        for source in dict.fromkeys(ref.node for ref in graph.data_inputs(name)):
            node = graph.node_def(source)
            if node.op in FUNCTIONAL and not functions(node) & backward \
                    and _repeatable(graph, library, source, name, step):
                pairs.append((source, name))
    order = {n: k for k, n in enumerate(graph.nodes())}
    return sorted(pairs, key=lambda pair: order[pair[0]])


def rerun(graph_def: graph_pb2.GraphDef, forward: str, backward: str) -> graph_pb2.GraphDef:
    """A copy of `graph_def` where `backward` reads a second run of `forward`, which waits on
    every other input of `backward` (so it runs when the backward pass could)."""
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {n.name: n for n in result.node}
    copy = node_def_pb2.NodeDef()
    copy.CopyFrom(nodes[forward])
    copy.name = forward + COPY_SUFFIX
    reader = nodes[backward]
    for k, text in enumerate(dict.fromkeys(i for i in reader.input if _source(i) != forward)):
        source = _source(text)
        if text.startswith("^") or nodes[source].op not in FUNCTIONAL:
            copy.input.append("^" + source)
            continue
        # Inlined or lowered, a call's or loop's control edge waits on its stateful ops alone,
        # so the copy waits on the value itself, through an Identity.
        wait = result.node.add(name=f"{copy.name}/wait_{k}", op="Identity", input=[text])
        wait.attr["T"].CopyFrom(_output_type(nodes[source], text))
        copy.input.append("^" + wait.name)
    for k, text in enumerate(reader.input):
        if _source(text) == forward:
            reader.input[k] = text.replace(forward, copy.name, 1)
    result.node.append(copy)
    return result


def _repeatable(graph: Graph, library: dict, forward: str, backward: str, step: set) -> bool:
    """Whether `forward` run again before `backward` computes what it computed the first time
    in the step that runs the nodes `step` (an initialiser's or a saver's writes run in other
    steps)."""
    stateful = _stateful_ops(library, functions(graph.node_def(forward)))
    if stateful is None or stateful - {READ}:
        return False
    if not stateful:
        return True
    after = reachable(graph.nx, [backward])
    node = graph.node_def(forward)
    types = node.attr["Tin" if node.op in CALL_OPS else "T"].list.type
    handles = [ref for ref, kind in zip(graph.data_inputs(forward), types)
               if kind == dtypes.RESOURCE]
    while handles:  # every op on a handle it reads, through Identities, waits on `backward`
        for user, _ in graph.consumers(handles.pop()):
            if graph.op(user) == "Identity":
                handles.append(TensorRef(user))
            elif user in step and user not in after and user != forward \
                    and graph.op(user) != READ:
                return False  # a write that may come before the backward pass
    return True


def _stateful_ops(library: dict, names: set[str]) -> set[str] | None:
    """The stateful op types the functions `names` run, through the functions they call;
    None when one of them is not in the library."""
    found, todo, seen = set(), list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        function = library.get(name)
        if function is None:
            return None
        for node in function.node_def:
            if node.op not in library and ops.is_stateful(node.op) \
                    and node.op not in FUNCTIONAL:
                found.add(node.op)
            todo.extend(functions(node) | ({node.op} if node.op in library else set()))
    return found


def functions(node) -> set[str]:
    """The functions a node calls through its attributes."""
    names = set()
    for key in FUNCTION_ATTRS:
        if key in node.attr:
            value = node.attr[key]
            names |= {value.func.name} if value.HasField("func") else \
                {f.name for f in value.list.func}
    return names - {""}


def _output_type(node, text: str) -> attr_value_pb2.AttrValue:
    """The type of the result of call or loop `node` that `text` names."""
    port = int(text.split(":")[1]) if ":" in text else 0
    types = node.attr["Tout"].list.type if node.op in CALL_OPS else node.attr["T"].list.type
    return attr_value_pb2.AttrValue(type=types[port])


def _source(text: str) -> str:
    return text.lstrip("^").split(":")[0]
