"""`loop_copy` for v1 loops: a step's values computed again in the gradient loop's frame.

A v1 while loop (control flow v2 off: `Enter`/`Merge`/`Switch`/`NextIteration`/`Exit` frames in
the graph itself) keeps each value its gradient loop reads on a stack: the forward frame pushes
it every iteration (`StackPushV2`), the gradient frame pops it (`StackPopV2`). As with
`loop_copy`'s lists, a popped value the forward frame computes by stateless kernels from other
popped values is computed again in the gradient frame instead, and its push and pop go; a leaf
no kept stack holds rides on a freed stack of its type. Constants copied into the gradient frame
take a control input from a pop there (a frame's constants must be entered like its values),
and the copies wait for the gradients the previous iteration carries (`Identity` of each float
loop variable), as `loop_copy`'s do.

A freed pop stays, under its name, a `PlaceholderWithDefault` of its copy: a kernel that passes
its input on, whose shape Grappler does not infer through it. A pop's shape is unknown to
Grappler; a copy's is not, and read directly, its readers' sums and products became shapes
Grappler's arithmetic optimizer regroups (`AddOpsRewrite` summed an attention decoder's
gradients of its encoded sequence in another order: a TF1 seq2seq built outside the repo,
weights 6e-8 apart). Nothing feeds it.
"""

from __future__ import annotations

from tensorflow.core.framework import graph_pb2, node_def_pb2

from ..analysis.loops import ENTER, MERGE, frame_of
from ..core.graph import Graph
from ..core.names import LOOP_GATE
from ..core.names import LOOP_PREFIX as PREFIX
from .loop_copy import (CHAINS, FLOATS, NOTHING, Pair, broadcasts, choose, copy_names,
                        copyable_op, one_iteration_at_a_time, output_type, pad, reader_counts,
                        recorded_shape, short_of_readers)

__all__ = ["pairs", "recompute"]

PUSH, POP, STACK = "StackPushV2", "StackPopV2", "StackV2"


class _Frame:
    """A forward frame's nodes, answering what `loop_copy.choose` asks of a body."""

    def __init__(self, nodes: dict, frames: dict, frame: str):
        self.nodes, self.frames, self.frame = nodes, frames, frame
        self.container = [n for name, n in nodes.items() if frames.get(name) == frame]
        self.invariants: dict[str, bool] = {}  # `invariant`'s answers: a frame's paths rejoin

    def _node(self, text: str):
        name = text.lstrip("^").split(":")[0]
        return self.nodes.get(name) if self.frames.get(name) == self.frame else None

    def copyable(self, text: str) -> bool:
        """A stateless kernel of the forward frame, not its loop variables' `Identity`s."""
        node = self._node(text)
        return node is not None and copyable_op(node) \
            and not (node.op == "Identity"
                     and self.nodes[node.input[0].split(":")[0]].op == "Switch")

    def shape(self, text: str):
        name, _, port = text.partition(":")
        return recorded_shape(self.nodes.get(name), int(port or 0))

    def invariant(self, text: str) -> bool:
        node = self._node(text)
        if node is None:
            return False
        if node.op in ENTER:
            return node.attr["is_constant"].b
        if text not in self.invariants:
            self.invariants[text] = copyable_op(node) and all(
                self.invariant(t) for t in _data(node))
        return self.invariants[text]

    def dtype(self, text: str) -> int:
        name, _, port = text.partition(":")
        return output_type(self.nodes[name], None, int(port or 0))


def pairs(graph_def: graph_pb2.GraphDef) -> list[Pair]:
    """Each gradient frame whose stacks one forward frame pushes: Pair((None, forward frame),
    (None, gradient frame), [(pop, push)])."""
    nodes = {n.name: n for n in graph_def.node}
    if not any(n.op == POP for n in nodes.values()):
        return []
    frames = frame_of(Graph.from_graph_def(graph_def))
    pushes, pops = {}, {}
    for node in nodes.values():
        if node.op in (PUSH, POP):
            stack = _stack(nodes, node.input[0])
            (pushes if node.op == PUSH else pops).setdefault(stack, []).append(node.name)
    by_frame: dict[str, Pair] = {}
    for stack, popped in sorted(pops.items()):
        pushed = pushes.get(stack, [])
        if stack is None or len(popped) != 1 or len(pushed) != 1:
            continue
        forward, gradient = frames.get(pushed[0], ""), frames.get(popped[0], "")
        pair = by_frame.setdefault(gradient, Pair((None, forward), (None, gradient), v1=True))
        if pair.forward == (None, forward) and forward and gradient:
            pair.lists.append((popped[0], pushed[0]))
    return [p for _, p in sorted(by_frame.items()) if p.lists]


def recompute(graph_def: graph_pb2.GraphDef, pair: Pair):
    """`loop_copy.recompute` for a v1 pair: a copy of `graph_def` and (stacks freed, nodes
    copied), or the reason it is left alone."""
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    nodes = {n.name: n for n in result.node}
    frames = frame_of(Graph.from_graph_def(result))
    body = _Frame(nodes, frames, pair.forward[1])
    if any(broadcasts(_Frame(nodes, frames, frame)) for frame in (pair.forward[1],
                                                                  pair.gradient[1])):
        return CHAINS
    before = reader_counts(result.node)
    entries = []
    for pop, push in pair.lists:
        stack = nodes[_stack(nodes, nodes[push].input[0])]
        if not before.get(push):  # nothing reads what it pushed
            entries.append((pop, nodes[push].input[1], stack.attr["elem_type"].type,
                            nodes[push], nodes[pop]))
    chosen = choose(body, entries)
    if chosen is None:
        return NOTHING
    redo, carriers, cone = chosen
    kept = {value: pop.name for key, value, _, push, pop in entries if key not in redo}
    # A carrier's push and pop get new names: the model would read the old shapes by name.
    renamed = {node.name: PREFIX + node.name for entry in carriers.values()
               for node in entry[3:5]}
    carried = {leaf: renamed[entry[4].name] for leaf, entry in carriers.items()}
    anchor = next(iter(kept.values()), None) or next(iter(carried.values()), None)
    if anchor is None:
        return NOTHING

    by_pop = {e[0]: e for e in entries}
    copy_of = copy_names(cone, [(by_pop[key][1], key) for key in sorted(redo)])

    def mapped(text: str) -> str:
        name, sep, rest = text.partition(":")
        return kept.get(text) or carried.get(text) or copy_of[name] + sep + rest

    carrier_keys = {e[0] for e in carriers.values()}
    replaced = {}
    for key in redo & carrier_keys:  # the pop carries another value now
        replaced[key] = replaced[key + ":0"] = mapped(by_pop[key][1])
    for node in result.node:
        for i, text in enumerate(node.input):
            if text in replaced:
                node.input[i] = replaced[text]
    for key in redo - carrier_keys:  # the pop passes the copy on, its shape unknown as before
        pop = nodes[key]
        kept_attrs = {k: pop.attr[k] for k in ("_output_shapes",) if k in pop.attr}
        passed = node_def_pb2.NodeDef(name=key, op="PlaceholderWithDefault",
                                      input=[mapped(by_pop[key][1])], attr=kept_attrs)
        passed.attr["dtype"].type = pop.attr["elem_type"].type
        passed.attr["shape"].shape.unknown_rank = True
        pop.CopyFrom(passed)
    ready = _gradient_ready(result, nodes, frames, pair.gradient[1])
    computed = {copy_of[name] for name in cone if nodes[name].op != "Const"}
    for name in cone:
        copy = node_def_pb2.NodeDef()
        copy.CopyFrom(nodes[name])
        copy.name = copy_of[name]
        del copy.input[:]
        copy.input.extend(mapped(t) for t in _data(nodes[name]))
        if copy.op == "Const":
            copy.input.append("^" + anchor)  # in the gradient frame
        elif not any(t.split(":")[0] in computed for t in copy.input):  # the first wait
            copy.input.extend(ready)
        result.node.append(copy)
    gone = set()
    for key in redo - carrier_keys:
        gone.add(by_pop[key][3].name)
    for leaf, (key, value, _, push, pop) in carriers.items():
        push.input[1] = leaf
        for node in (push, pop):  # their recorded element shape is the old value's
            node.attr.pop("_output_shapes", None)
    values = {by_pop[key][1] for key in redo}
    for k, value in enumerate(sorted(values)):  # each lost its push
        pad(result.node, f"{PREFIX}pad/{pair.forward[1]}/{k}", value, body.dtype(value))
    after = reader_counts(result.node)
    for name, value in short_of_readers(body, cone, values, before, after, copy_of):
        pad(result.node, f"{PREFIX}pad/{name}", mapped(value), body.dtype(value))
    for node in result.node:
        for i, text in enumerate(node.input):
            if text.lstrip("^") in renamed:
                node.input[i] = "^" * text.startswith("^") + renamed[text.lstrip("^")]
        node.name = renamed.get(node.name, node.name)
    _remove(result, gone)
    one_iteration_at_a_time(result, pair, pair.forward)  # as `loop_copy` says why
    return result, (len(redo), len(cone))


def _stack(nodes: dict, text: str) -> str | None:
    """The `StackV2` a handle comes from, through `Enter`s and `Identity`s."""
    name = text.lstrip("^").split(":")[0]
    for _ in range(16):
        node = nodes.get(name)
        if node is None:
            return None
        if node.op == STACK:
            return name
        if node.op not in ENTER + ("Identity",):
            return None
        name = node.input[0].split(":")[0]
    return None


def _gradient_ready(graph_def, nodes: dict, frames: dict, frame: str) -> list[str]:
    """A control input on an `IdentityN` of the float loop variables a gradient frame carries
    into this iteration (their `Switch`es' true outputs), or none where it has none."""
    merges = {n.name for n in nodes.values() if n.op in MERGE and frames.get(n.name) == frame
              and n.attr["T"].type in FLOATS}
    switches = sorted(n.name for n in nodes.values() if n.op == "Switch"
                      and n.input and n.input[0].split(":")[0] in merges)
    if not switches:
        return []
    node = graph_def.node.add(name=f"{LOOP_GATE}/{frame}", op="IdentityN",
                              input=[name + ":1" for name in switches])
    node.attr["T"].list.type.extend(nodes[name].attr["T"].type for name in switches)
    return ["^" + node.name]


def _remove(graph_def, names: set[str]) -> None:
    """Removes `names` and the control edges on them, then the `Enter`s and stacks only they
    read."""
    while names:
        for node in graph_def.node:
            kept = [i for i in node.input if i.lstrip("^").split(":")[0] not in names]
            if len(kept) != len(node.input):
                del node.input[:]
                node.input.extend(kept)
        feeding = {i.lstrip("^").split(":")[0] for n in graph_def.node if n.name in names
                   for i in n.input}
        for i in reversed(range(len(graph_def.node))):
            if graph_def.node[i].name in names:
                del graph_def.node[i]
        read = {i.lstrip("^").split(":")[0] for n in graph_def.node for i in n.input}
        names = {n.name for n in graph_def.node if n.name in feeding and n.name not in read
                 and n.op in ENTER + (STACK, "Const")}


def _data(node) -> list[str]:
    return [i for i in node.input if not i.startswith("^")]
