"""A recurrent step's values computed again inside its gradient loop, from the few it keeps.

A TF2 `While` differentiated by TensorFlow keeps, for each value its gradient loop reads, a
tensor list the forward body pushes to every iteration (`TensorListPushBack`) and the gradient
body pops from (`TensorListPopBack`). An LSTM's step pushes its four gates, `tanh(c)`, the
previous state and the input: eight `[batch, units]` tensors an iteration, held from the forward
loop to the gradient loop. Most are computed from a few others by stateless kernels; the
gradient body can compute them again from those (the previous `h` and `c`, the input, the
weights), in the iteration that needs them, with the same kernels on the same inputs (bitwise
equal), and the forward body stops pushing them: the loop's part of the peak falls to what the
kept lists hold, for one more forward step per iteration.

A value the copies need that no kept list holds (a bias the gradient loop never read) is carried
on one of the freed lists instead: the forward body pushes it there, the gradient body pops it,
the list's element shape left open. A weight pushed every iteration is one buffer referenced N
times, so carrying it costs next to nothing.

A rewritten forward loop runs one iteration at a time (`parallel_iterations` 1). Otherwise the
executor runs what an iteration computes without the recurrent state (a Keras LSTM with
recurrent dropout slices its weights and draws its masks every iteration) up to 32 iterations
ahead, and holds it until the state arrives: once those values are no longer pushed, that is
what the peak holds (the LSTM: 21.9 MiB measured against 8.6 modelled, 9.3 one iteration at a
time). It also draws a body's random numbers in iteration order, which otherwise race.

The two loops may sit in different function bodies (a Keras RNN in a TF2 step is a call of its
forward function and one of its backward function, each holding its loop): a list is followed
from the gradient loop's input through calls, arguments and `Identity`s to the forward loop's
output. Only bodies run by one loop, and functions called once, are rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2
from tensorflow.python.framework import tensor_util

from ..analysis.inline import CALL_OPS, LOOP_OPS
from ..analysis.loops import ENTER
from ..core import ops
from ..core.errors import GraphError
from ..core.names import LOOP_GATE, LOOP_SUFFIX
from ..core.names import LOOP_PREFIX as PREFIX
from .rerun_copy import FUNCTIONAL, functions

__all__ = ["MAX_COPIES", "REFUSED", "SHARED", "CHAINS", "NOTHING", "Pair", "pairs",
           "recompute", "one_iteration_at_a_time", "choose", "copyable_op", "output_type",
           "recorded_shape", "reader_counts", "pad", "copy_names", "broadcasts",
           "short_of_readers"]

MAX_COPIES = 200  # nodes copied into one gradient body at most
# Why a pair is left alone (`recompute`'s answer then).
SHARED = "its bodies or lists are shared with other loops or calls"
CHAINS = ("its body chains sums or products over operands of other shapes, which Grappler "
          "regroups by operand names: a copy, named otherwise, would round otherwise")
NOTHING = "no value it pops is made by stateless kernels from the others"
REFUSED = (SHARED, CHAINS, NOTHING)
PUSH, POP = "TensorListPushBack", "TensorListPopBack"
ASSOCIATIVE = ("Mul", "Add", "AddV2")
FLOATS = (types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_DOUBLE)


class _Scope:
    """The top-level graph (name None) or one function body, with its nodes by name."""

    def __init__(self, name, container, function=None):
        self.name, self.function, self.container = name, function, container
        self.nodes = {n.name: n for n in container}
        self.args = [a.name for a in function.signature.input_arg] if function else []
        self.invariants: dict[str, bool] = {}  # `invariant`'s answers: a body's paths rejoin

    def split(self, text: str) -> tuple[str, int]:
        """(node, port) of a data input; the port read from `node:output:k` in a body (a
        loop's or a call's outputs: one list argument)."""
        parts = text.split(":")
        return parts[0], int(parts[-1]) if len(parts) > 1 else 0

    def copyable(self, text: str) -> bool:
        """Whether the node making `text` may run again in another body."""
        if text in self.args:
            return False
        node = self.nodes.get(text.split(":")[0])
        return node is not None and copyable_op(node)

    def shape(self, text: str):
        """The recorded shape (`_output_shapes`) of value `text`, or None."""
        if text in self.args:
            recorded = self.function.arg_attr[self.args.index(text)].attr.get("_output_shapes")
            return _dims(recorded.list.shape[0]) if recorded and recorded.list.shape else None
        name, _, port = (text.split(":") + ["", "0"])[:3]
        return recorded_shape(self.nodes.get(name), int(port))

    def invariant(self, text: str) -> bool:
        """Whether `text` is the same in every iteration (made from arguments the body passes
        on unchanged and constants): a list of it holds one buffer N times, so keeping it is
        free."""
        if text in self.args:
            k = self.args.index(text)
            return self.function.ret[self.function.signature.output_arg[k].name] == text
        if text not in self.invariants:
            node = self.nodes.get(text.split(":")[0])
            self.invariants[text] = node is not None and self.copyable(text) and all(
                self.invariant(t) for t in node.input if not t.startswith("^"))
        return self.invariants[text]

    def dtype(self, text: str) -> int:
        """The type of value `text` (an argument or `node:output_arg:index`)."""
        if text in self.args:
            return self.function.signature.input_arg[self.args.index(text)].type
        name, arg, index = (text.split(":") + ["output", "0"])[:3]
        return output_type(self.nodes[name], arg, int(index))

    def readers(self, name: str, port: int) -> int:
        """How many inputs (and results, in a body) read output `port` of `name`."""
        texts = [i for n in self.nodes.values() for i in n.input if not i.startswith("^")]
        if self.function is not None:
            texts += list(self.function.ret.values())
        return sum(1 for t in texts if t.split(":")[0] == name and self.split(t)[1] == port)


class _View:
    """Every scope of a graph and, per function, the nodes that run it."""

    def __init__(self, graph_def: graph_pb2.GraphDef):
        self.scopes = {None: _Scope(None, graph_def.node)}
        for function in graph_def.library.function:
            self.scopes[function.signature.name] = _Scope(function.signature.name,
                                                          function.node_def, function)
        # Callers in the scopes the graph runs: a function the inline pass spliced in stays in
        # the library, its calls with it (a nested tf.function's GRU: called "twice").
        self.callers: dict[str, list[tuple[str | None, str]]] = {}
        live, seen = [None], {None}
        while live:
            scope = self.scopes[live.pop()]
            for node in scope.nodes.values():
                for name in functions(node) | ({node.op} & self.scopes.keys()):
                    self.callers.setdefault(name, []).append((scope.name, node.name))
                    if name not in seen and name in self.scopes:
                        seen.add(name)
                        live.append(name)

    def once(self, function: str) -> bool:
        return len(self.callers.get(function, [])) == 1

    def resolve(self, scope: _Scope, text: str):
        """(scope, node, port) making the value `text` names in `scope`, followed through
        Identities, call results and arguments of functions called once; None elsewhere."""
        for _ in range(64):
            if text in scope.args:
                if not self.once(scope.name):
                    return None
                outer, call = self.callers[scope.name][0]
                outer = self.scopes[outer]
                node = outer.nodes[call]
                if node.op not in CALL_OPS:
                    return None
                scope, text = outer, _data(node)[scope.args.index(text)]
                continue
            name, port = scope.split(text)
            node = scope.nodes.get(name)
            if node is None:
                return None
            if node.op == "Identity":
                text = node.input[0]
            elif node.op in CALL_OPS:
                inner = self.scopes.get(node.attr["f"].func.name)
                if inner is None or not self.once(inner.name):
                    return None
                signature = inner.function.signature
                scope, text = inner, inner.function.ret[signature.output_arg[port].name]
            else:
                return scope, name, port
        return None


@dataclass
class Pair:
    """A forward loop and the gradient loop popping its lists: (loop var of the gradient
    loop, loop var of the forward loop) per list."""

    forward: tuple[str | None, str]   # (scope, node); a v1 loop's: (None, frame)
    gradient: tuple[str | None, str]
    lists: list = field(default_factory=list)  # a v1 loop's: (pop, push)
    v1: bool = False  # stacks in v1 frames (`loop_copy_v1`), not lists of a functional While

    def name(self) -> str:
        scope, node = self.forward
        return node if scope is None else f"{scope}/{node}"


def pairs(graph_def: graph_pb2.GraphDef) -> list[Pair]:
    """Every forward loop whose lists one gradient loop pops, in a stable order."""
    view = _View(graph_def)
    found = []
    for scope in view.scopes.values():
        for node in scope.nodes.values():
            if node.op not in LOOP_OPS:
                continue
            body = view.scopes.get(node.attr["body"].func.name)
            if body is None:
                continue
            lists, forward = [], set()
            for j, arg in enumerate(body.args):
                if _pop_of(body, j) is None:
                    continue
                source = view.resolve(scope, _data(node)[j])
                if source is None or source[1] not in source[0].nodes \
                        or source[0].nodes[source[1]].op not in LOOP_OPS:
                    continue
                forward.add((source[0].name, source[1]))
                lists.append((j, source[2]))
            if len(forward) == 1 and lists:
                found.append(Pair(forward.pop(), (scope.name, node.name), lists))
    return sorted(found, key=lambda p: (p.forward[0] or "", p.forward[1]))


def _pop_of(body: _Scope, j: int):
    """The pop of loop var `j` in a gradient body: its only reader, whose list is what the
    body passes on."""
    arg = body.args[j]
    readers = [n for n in body.nodes.values() if arg in n.input]
    if len(readers) != 1 or readers[0].op != POP or readers[0].input[0] != arg:
        return None
    result = body.function.ret[body.function.signature.output_arg[j].name]
    return readers[0] if result == f"{readers[0].name}:output_handle:0" else None


def _push_of(body: _Scope, k: int):
    """The push that makes loop var `k` of a forward body, or None."""
    text = body.function.ret[body.function.signature.output_arg[k].name]
    node = body.nodes.get(text.split(":")[0])
    if node is None or node.op != PUSH or node.input[0] != body.args[k] \
            or body.readers(node.name, 0) != 1:
        return None
    return node


def recompute(graph_def: graph_pb2.GraphDef, pair: Pair):
    """A copy of `graph_def` whose gradient loop of `pair` computes again every value it pops
    that its forward body computes by stateless kernels from the values kept, and (count of
    lists freed, count of nodes copied); where nothing can be, the reason (one of `REFUSED`)."""
    result = graph_pb2.GraphDef()
    result.CopyFrom(graph_def)
    view = _View(result)
    w_scope, g_scope = view.scopes[pair.forward[0]], view.scopes[pair.gradient[0]]
    w_node, g_node = w_scope.nodes[pair.forward[1]], g_scope.nodes[pair.gradient[1]]
    fw, fg = view.scopes[w_node.attr["body"].func.name], view.scopes[g_node.attr["body"].func.name]
    if not (view.once(fw.name) and view.once(fg.name)):
        return SHARED
    if broadcasts(fw) or broadcasts(fg):
        return CHAINS
    entries = []  # ((j, k), pushed value in fw, its type, its push, its pop in fg)
    for j, k in pair.lists:
        push, pop = _push_of(fw, k), _pop_of(fg, j)
        if push is not None and pop is not None:
            entries.append(((j, k), push.input[1], push.attr["element_dtype"].type, push, pop))
    chosen = choose(fw, entries)
    if chosen is None:
        return NOTHING
    redo, carriers, cone = chosen
    kept = {value: f"{pop.name}:tensor:0" for key, value, _, push, pop in entries
            if key not in redo}
    # A carrier's pop gets a new name: the model would read its old element's shape by name.
    renamed = {entry[4].name: PREFIX + entry[4].name for entry in carriers.values()}
    carried = {leaf: f"{renamed[entry[4].name]}:tensor:0" for leaf, entry in carriers.items()}

    by_loop_var = {e[0]: e for e in entries}
    copy_of = copy_names(cone, [(by_loop_var[key][1], by_loop_var[key][4].name)
                                for key in sorted(redo)])

    def mapped(text: str) -> str:
        if text in kept:
            return kept[text]
        if text in carried:
            return carried[text]
        name, sep, rest = text.partition(":")
        return copy_of[name] + sep + rest

    before = reader_counts(fw.container, fw.function.ret.values())
    replaced = {f"{by_loop_var[key][4].name}:tensor:0": mapped(by_loop_var[key][1])
                for key in redo}
    for node in fg.nodes.values():
        for i, text in enumerate(node.input):
            if text in replaced:
                node.input[i] = replaced[text]
    ready = _gradient_ready(fg)
    computed = {copy_of[name] for name in cone if fw.nodes[name].op != "Const"}
    for name in cone:
        copy = node_def_pb2.NodeDef()
        copy.CopyFrom(fw.nodes[name])
        copy.name = copy_of[name]
        del copy.input[:]
        copy.input.extend(mapped(t) for t in fw.nodes[name].input if not t.startswith("^"))
        if ready and copy.op != "Const" and not any(  # the first copies on each path wait
                t.split(":")[0] in computed for t in copy.input):
            copy.input.append("^" + ready)
        fg.function.node_def.append(copy)
    carrier_keys = {e[0] for e in carriers.values()}
    orphans = set()
    for key in redo:
        (j, k), value, _, push, pop = by_loop_var[key]
        if key in carrier_keys:
            continue
        orphans.add(pop.input[1].split(":")[0])
        _remove(fg, pop.name)
        fg.function.ret[fg.function.signature.output_arg[j].name] = fg.args[j]
        _remove(fw, push.name)
        fw.function.ret[fw.function.signature.output_arg[k].name] = fw.args[k]
    for leaf, ((j, k), value, _, push, pop) in carriers.items():
        push.input[1] = leaf
        _record_element(fw, leaf, pop)
        orphans.add(pop.input[1].split(":")[0])
        if not (_open_shape(fg, pop) and _open_shape(w_scope, _list_of(w_scope, w_node, k))):
            return SHARED
    values = {by_loop_var[key][1] for key in redo}
    for k, value in enumerate(sorted(values)):  # each lost its push
        pad(fw.container, f"{PREFIX}pad/{k}", value, fw.dtype(value))
    after = reader_counts(fg.container, fg.function.ret.values())
    for name, value in short_of_readers(fw, cone, values, before, after, copy_of):
        pad(fg.container, f"{PREFIX}pad/{name}", mapped(value), fw.dtype(value))
    _rename(fg, renamed)
    fg.nodes = {n.name: n for n in fg.container}
    fw.nodes = {n.name: n for n in fw.container}
    _drop_unread(fg, orphans)
    for scope in (fw, fg):
        _check(scope)
    one_iteration_at_a_time(result, pair, pair.forward)
    return result, (len(redo), len(cone))


def one_iteration_at_a_time(graph_def: graph_pb2.GraphDef, pair: Pair, loop) -> bool:
    """Sets `parallel_iterations` of `loop` (`pair.forward` or `pair.gradient`: a While, or a
    v1 frame's Enters) to 1; whether it was more."""
    scope, name = loop
    if pair.v1:
        nodes = [n for n in graph_def.node
                 if n.op in ENTER and n.attr["frame_name"].s.decode() == name]
    else:
        body = graph_def.node if scope is None else next(
            f.node_def for f in graph_def.library.function if f.signature.name == scope)
        nodes = [n for n in body if n.name == name]
    more = any(n.attr["parallel_iterations"].i > 1 for n in nodes)
    for node in nodes:
        node.attr["parallel_iterations"].i = 1
    return more


def choose(body, entries):
    """(keys of the entries recomputed, leaf value -> the entry whose list carries it, the
    forward nodes to copy in order), or None. `entries` are (key, value pushed, its type, push,
    pop); `body` answers `copyable`, `invariant` and `dtype` of a value and holds `nodes`. A
    value is recomputed where its forward cone, down to kept values, holds only stateless
    kernels; a leaf of a cone no kept list holds needs a freed list of its type to carry it,
    else the values needing it are kept."""
    redo = {key for key, value, *_ in entries
            if body.copyable(value) and not body.invariant(value)}
    values = {key: value for key, value, *_ in entries}
    while redo:
        kept = {value for key, value, *_ in entries if key not in redo}
        cone, leaves = [], {}
        for key, value, *_ in entries:
            if key in redo:  # each entry's own cone: every leaf it needs is told
                own, needs = [], {}
                _cone(body, value, kept, own, needs, key)
                cone += [name for name in own if name not in cone]
                for leaf in needs:
                    leaves.setdefault(leaf, set()).add(key)
        if len(cone) > MAX_COPIES:
            return None
        free = [e for e in entries if e[0] in redo]
        carriers, short = {}, set()
        for leaf in sorted(leaves):
            kind = body.dtype(leaf)
            entry = next((e for e in free if e[2] == kind), None)
            if entry is None:
                short |= leaves[leaf]
                continue
            free.remove(entry)
            carriers[leaf] = entry
        if not short:
            return redo, carriers, cone
        # Keep the value nearest the leaf (its cone the smallest): the others may then stop
        # at it instead of reaching the leaf.
        redo.remove(min(short, key=lambda key: (_cone_size(body, values[key], kept), key)))
    return None


def _cone_size(body, value: str, kept: set) -> int:
    cone: list = []
    _cone(body, value, kept, cone, {}, None)
    return len(cone)


def _cone(body, text: str, kept: set, cone: list, leaves: dict, owner) -> None:
    """Adds to `cone` (in an order that runs) the nodes computing `text` from `kept` values,
    constants and leaves; `leaves` maps each leaf to the entries needing it."""
    if text in kept:
        return
    if not body.copyable(text):
        leaves.setdefault(text, set()).add(owner)
        return
    name = text.lstrip("^").split(":")[0]
    if name in cone:
        return
    for source in body.nodes[name].input:
        if not source.startswith("^"):
            _cone(body, source, kept, cone, leaves, owner)
    cone.append(name)  # after its inputs: the order runs


def copy_names(cone: list[str], roots: list[tuple[str, str]]) -> dict[str, str]:
    """Forward node -> the name of its copy in the gradient loop. A copy whose value replaces
    a pop is named after the pop plus `LOOP_SUFFIX`, so it sorts against the other operands of
    its readers as the pop did (Grappler orders a commutative chain's operands by name before it
    regroups it: issue 14); the others under `LOOP_PREFIX`."""
    names = {name: PREFIX + name for name in cone}
    for value, pop in roots:  # (value pushed, its pop)
        name = value.split(":")[0]
        if names.get(name, "").startswith(PREFIX):
            names[name] = pop + LOOP_SUFFIX
    return names


def broadcasts(body) -> bool:
    """Whether a body holds a chain of sums or of products (a link read only by the next, not
    counting pushes), one of operands of other or unknown shapes. Grappler regroups such chains
    by their operands' names and readers, which the rewrite changes on both sides of the loop:
    a peephole LSTM and a layer-norm LSTM rounded otherwise, even with their copies named and
    read as the originals. Such loops are left alone; a lone broadcast (LSTMCell's
    `f + forget_bias`) is no chain."""
    readers: dict = {}  # without pushes: the rewrite removes them
    for node in body.container:
        for text in node.input if node.op not in (PUSH, "StackPushV2") else ():
            if not text.startswith("^"):
                readers.setdefault(text.split(":")[0], []).append(node)

    def family(node):
        return "Add" if node.op in ("Add", "AddV2") else node.op

    def linked(a, b) -> bool:  # a's only reader is b, of its family
        return len(readers.get(a.name, [])) == 1 and readers[a.name][0].name == b.name \
            and family(a) == family(b)

    for node in body.container:
        if not _broadcasting(node, body.shape):
            continue
        sources = [body.nodes.get(t.split(":")[0]) for t in node.input if not t.startswith("^")]
        if any(s is not None and linked(s, node) for s in sources) or any(
                linked(node, r) for r in readers.get(node.name, [])):
            return True
    return False


def _broadcasting(node, shape_of) -> bool:
    """A sum or product of operands of other (or unknown) shapes: what Grappler's
    MinimizeBroadcasts regroups, by operand names, in a chain of them."""
    if node.op not in ASSOCIATIVE:
        return False
    shapes = [shape_of(t) for t in node.input if not t.startswith("^")]
    return None in shapes or len(set(shapes)) > 1


def recorded_shape(node, port: int):
    recorded = node.attr.get("_output_shapes") if node is not None else None
    if recorded is None or port >= len(recorded.list.shape):
        return None
    return _dims(recorded.list.shape[port])


def _dims(shape):
    return None if shape.unknown_rank else tuple(d.size for d in shape.dim)


def reader_counts(nodes, extra=()) -> dict:
    """Data inputs (and `extra` texts: a body's results) reading each node, by name."""
    counts: dict = {}
    for text in [t for n in nodes for t in n.input if not t.startswith("^")] + list(extra):
        name = text.split(":")[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def short_of_readers(body, cone, values, before: dict, after: dict, copy_of: dict):
    """(forward node, a value of it) for each copy with fewer readers than Grappler saw its
    original have (counting to 2): a copy replacing a pop (of `values`) needs 2, for its
    readers are the gradient's and its original's were a push and more."""
    for name in cone:
        roots = [v for v in values if v.split(":")[0] == name]
        want = 2 if roots else min(2, before.get(name, 0))
        if body.nodes[name].op != "Const" and after.get(copy_of[name], 0) < want:
            yield name, roots[0] if roots else next(
                t for n in cone for t in body.nodes[n].input if t.split(":")[0] == name)


def pad(container, name: str, text: str, dtype: int) -> None:
    """A reader of `text` nothing reads, which Grappler keeps (`_grappler_do_not_remove`): the
    readers Grappler counts stay as they were (a link of a sum or product chain it regroups
    must have one reader; a value whose push went would become one)."""
    node = container.add(name=name, op="IdentityN", input=[text])
    node.attr["T"].list.type.append(dtype)
    node.attr["_grappler_do_not_remove"].b = True


def copyable_op(node) -> bool:
    """Whether a node may run again elsewhere: a stateless kernel, no call, loop or list op,
    no `AddN` (Grappler orders its terms by name, and a copy's are named otherwise)."""
    return node.op not in FUNCTIONAL and not functions(node) and node.op != "AddN" \
        and not node.op.startswith(("TensorList", "TensorArray", "Stack")) \
        and not ops.is_stateful(node.op) and node.op not in ops.PLACEHOLDER_OPS \
        and node.op not in ops.V1_LOOP_OPS


def output_type(node, arg: str | None, index: int) -> int:
    """The type of a node's output: output `index` of its output argument `arg` (a body's
    naming), or its output `index` counted over every argument (a graph's: `arg` None)."""
    definition = ops.op_def(node.op)
    for output in definition.output_arg if definition else []:
        if output.type_list_attr:
            types = list(node.attr[output.type_list_attr].list.type)
        else:
            kind = output.type or node.attr[output.type_attr].type
            types = [kind] * (node.attr[output.number_attr].i if output.number_attr else 1)
        if arg is None and index >= len(types):
            index -= len(types)
            continue
        if arg is None or output.name == arg:
            return types[index] if index < len(types) else types_pb2.DT_INVALID
    return types_pb2.DT_INVALID


def _gradient_ready(fg: _Scope) -> str | None:
    """An `IdentityN` of the gradients a gradient body carries from one iteration to the next
    (its float loop vars it does not pass on unchanged), for the copies to wait on: otherwise
    the executor runs an iteration's pops and copies as soon as the previous pop is done, up
    to `parallel_iterations` ahead of the gradient, and holds all their values (a TF1 graph
    of three Keras GRUs: 15.6 MiB measured against 8.2 modelled, 8.2 with the copies
    waiting)."""
    signature = fg.function.signature
    carried = [(arg.name, arg.type) for k, arg in enumerate(signature.input_arg)
               if arg.type in FLOATS and fg.function.ret[signature.output_arg[k].name] != arg.name]
    if not carried:
        return None
    node = node_def_pb2.NodeDef(name=LOOP_GATE, op="IdentityN",
                                input=[name for name, _ in carried])
    node.attr["T"].list.type.extend(kind for _, kind in carried)
    fg.container.append(node)
    fg.nodes[node.name] = node
    return node.name


def _record_element(fw: _Scope, leaf: str, pop) -> None:
    """Gives a carrier's pop the recorded shape (`_output_shapes`) of the value it now
    carries, or none where that is not recorded: the old one would size the element wrongly."""
    if "_output_shapes" not in pop.attr:
        return
    if leaf in fw.args:
        recorded = fw.function.arg_attr[fw.args.index(leaf)].attr.get("_output_shapes")
        shape = recorded.list.shape[0] if recorded is not None and recorded.list.shape \
            else None
    else:
        name, _, index = (leaf.split(":") + ["output", "0"])[:3]
        recorded = fw.nodes[name].attr.get("_output_shapes")
        outputs = recorded.list.shape if recorded is not None else []
        shape = outputs[int(index)] if len(outputs) == 1 or int(index) < len(outputs) \
            and _single_output_arg(fw.nodes[name]) else None
    if shape is None:
        del pop.attr["_output_shapes"]
    else:
        pop.attr["_output_shapes"].list.shape[1].CopyFrom(shape)


def _single_output_arg(node) -> bool:
    """Whether `node`'s outputs are one argument's (so `name:arg:k` is output k)."""
    definition = ops.op_def(node.op)
    return definition is not None and len(definition.output_arg) == 1


def _list_of(scope: _Scope, loop, k: int):
    """The `EmptyTensorList` that starts loop var `k` of `loop`, when only the loop reads it."""
    name, port = scope.split(_data(loop)[k])
    node = scope.nodes.get(name)
    if node is None or node.op != "EmptyTensorList" or scope.readers(name, port) != 1:
        return None
    return node


def _open_shape(scope: _Scope, node) -> bool:
    """Points `node`'s element shape (input 0 of an empty list, 1 of a pop) at an unknown
    shape, so the list takes any element; False where `node` is None."""
    if node is None:
        return False
    index = 1 if node.op == POP else 0
    name = f"{PREFIX}{node.name}/element_shape"
    const = node_def_pb2.NodeDef(name=name, op="Const")
    const.attr["dtype"].type = types_pb2.DT_INT32
    const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(-1, types_pb2.DT_INT32))
    scope.container.append(const)
    scope.nodes[name] = const
    node.input[index] = name if scope.function is None else f"{name}:output:0"
    return True


def _remove(scope: _Scope, name: str) -> None:
    nodes = scope.container
    for i, node in enumerate(nodes):
        if node.name == name:
            del nodes[i]
            break
    del scope.nodes[name]


def _rename(scope: _Scope, renamed: dict[str, str]) -> None:
    """Renames nodes of a body, and every input and result naming them."""
    def new(text: str) -> str:
        name, sep, rest = text.lstrip("^").partition(":")
        return "^" * text.startswith("^") + renamed.get(name, name) + sep + rest

    for node in scope.container:
        node.input[:] = [new(t) for t in node.input]
        node.name = renamed.get(node.name, node.name)
    for key, value in list(scope.function.ret.items()):  # not while writing to the map
        scope.function.ret[key] = new(value)
    scope.nodes = {n.name: n for n in scope.container}


def _check(scope: _Scope) -> None:
    """Raises GraphError (a bug of this module) where an input or result of a rewritten body
    names no node or argument: TensorFlow would refuse the body, and the model would only
    warn that Grappler could not run it."""
    for text in [t for n in scope.container for t in n.input] + list(scope.function.ret.values()):
        name = text.lstrip("^").split(":")[0]
        if name not in scope.nodes and name not in scope.args:
            raise GraphError(f"loop_copy left {text!r} in {scope.name} naming nothing")


def _drop_unread(scope: _Scope, names: set[str]) -> None:
    """Removes the constants of `names` nothing reads any more (a removed pop's shape)."""
    read = {t.lstrip("^").split(":")[0] for n in scope.container for t in n.input}
    read |= {t.split(":")[0] for t in scope.function.ret.values()}
    for name in sorted(names - read):
        if name in scope.nodes and scope.nodes[name].op == "Const":
            _remove(scope, name)


def _data(node) -> list[str]:
    return [i for i in node.input if not i.startswith("^")]
