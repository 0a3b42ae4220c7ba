"""Graph: the single owner of a GraphDef's nodes as a networkx MultiDiGraph.

Edges run producer -> consumer. Every input string of a NodeDef is one edge, keyed by its position
in the input list (so `Mul(x, x)` is two edges and the original order survives). Edge data:

- `port`: the producer's output port, or -1 (`CONTROL`) for a control dependency;
- `slot`: the consumer's data input index (None for control edges);
- `text`: the input string as the file spelled it (`a:0` and `a` name the same tensor), or None for
  edges a pass created, which print canonically.

Node data: `node_def` (the NodeDef with its inputs cleared: the edges hold those), `op` (its op,
read far more often than anything else), `order` (position in the file; new nodes append). A
producer named by an input but absent from the graph is kept as a node with `missing=True`, so
`check()` can report it and nothing is silently dropped.

All mutation goes through the methods below; there is no second index that could go stale.
Copies share networkx's per-node dicts until one of them changes a node (copy-on-write, see
`_own`), so copying a 10k-node graph to try a rewrite costs three dict copies, not a rebuild.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from operator import itemgetter
from typing import Iterable, Sequence

import networkx as nx
from tensorflow.core.framework import graph_pb2, node_def_pb2

from .errors import GraphError
from .tensor_ref import CONTROL, TensorRef

__all__ = ["LOOP_BACK_OPS", "neighbours", "Graph", "op_histogram"]

# Ops whose outgoing edge closes a v1 while-loop (NextIteration -> Merge); the only legal cycles.
LOOP_BACK_OPS = frozenset({"NextIteration", "RefNextIteration"})


def neighbours(graph: nx.DiGraph, upstream: bool = False) -> dict:
    """networkx's own adjacency dict of `graph` (node -> {neighbour: edge data}), for walks over
    every node: its public `succ`/`pred` build a view per access, a second each at 100k nodes.
    The one place outside networkx that reads its `_succ`/`_pred`; callers only read it."""
    return graph._pred if upstream else graph._succ


class Graph:
    """A GraphDef held as a DAG (plus legal loop back edges), with its non-node fields kept aside.

    >>> g = Graph.from_graph_def(graph_pb2.GraphDef())
    >>> x = g.add_node("x", "Placeholder")
    >>> y = g.add_node("y", "Neg", [TensorRef(x)])
    >>> [str(r) for r in g.inputs(y)]
    ['x']
    """

    def __init__(self, shell: graph_pb2.GraphDef | None = None):
        self.nx = nx.MultiDiGraph()
        # Everything of the GraphDef except its nodes: versions, library, debug_info.
        self.shell = shell if shell is not None else graph_pb2.GraphDef()
        self._load_problems: list[str] = []
        self._next_order = 0
        # Ordered in-edges per node (and the same as TensorRefs), caches dropped for every node
        # whose inputs a mutation touches (`_forget`); the edges stay the only truth.
        self._inputs_cache: dict[str, list[tuple[str, dict]]] = {}
        self._refs_cache: dict[str, tuple[list[TensorRef], list[TensorRef]]] = {}
        # Real node names in file order; new nodes append, removals drop it.
        self._nodes_cache: list[str] | None = None
        # `topological_order()` (by file order), dropped by every change of nodes or edges:
        # the split, the passes and the planner's context all ask for the same graph's.
        self._topo_cache: list[str] | None = None
        # Nodes whose networkx dicts (attributes, successors, predecessors) and (producer,
        # consumer) pairs whose edge-key dicts no copy shares: only those are edited in place.
        self._owned: set[str] = set()
        self._owned_pairs: set[tuple[str, str]] = set()

    # ----------------------------------------------------------------- conversion

    @classmethod
    def from_graph_def(cls, graph_def: graph_pb2.GraphDef) -> "Graph":
        shell = graph_pb2.GraphDef()
        shell.CopyFrom(graph_def)
        del shell.node[:]
        graph = cls(shell)
        pending: list[tuple[str, Sequence[str]]] = []
        for node in graph_def.node:
            if not node.name:
                graph._load_problems.append(f"a node of op '{node.op}' has no name")
                continue
            if graph._is_real(node.name):
                graph._load_problems.append(f"duplicate node name '{node.name}'")
                continue
            payload = node_def_pb2.NodeDef()
            payload.CopyFrom(node)
            del payload.input[:]
            graph._insert(payload)
            pending.append((node.name, node.input))
        for name, inputs in pending:
            slot = 0
            for pos, text in enumerate(inputs):
                try:
                    ref = TensorRef.parse(text)
                except ValueError:
                    graph._load_problems.append(f"node '{name}' has an empty input name")
                    continue
                if not graph.nx.has_node(ref.node):
                    graph.nx.add_node(ref.node, missing=True)
                canonical = str(ref) == text
                graph._add_edge(ref.node, name, pos, ref.port, None if ref.is_control else slot,
                                None if canonical else text)
                if not ref.is_control:
                    slot += 1
        return graph

    def to_graph_def(self) -> graph_pb2.GraphDef:
        """The GraphDef: original node order, new nodes appended, all other fields untouched."""
        out = graph_pb2.GraphDef()
        out.CopyFrom(self.shell)
        for name in self.nodes():
            node = out.node.add()
            node.CopyFrom(self.nx.nodes[name]["node_def"])
            node.input.extend(self._input_texts(name))
        return out

    def copy(self) -> "Graph":
        """A structural copy: new topology, NodeDefs shared (passes add nodes, they do not edit
        NodeDefs in place; use `set_attr` to change one)."""
        other = Graph(self.shell)
        other.nx = _share_nx(self.nx)
        self._owned, self._owned_pairs = set(), set()  # both now share every inner dict
        other._load_problems = list(self._load_problems)
        other._next_order = self._next_order
        # Edge data is never edited in place (edges are replaced, and the reader's entry
        # dropped), so the cached input lists stay true for the copy.
        other._inputs_cache = dict(self._inputs_cache)
        other._refs_cache = dict(self._refs_cache)
        other._nodes_cache = None if self._nodes_cache is None else list(self._nodes_cache)
        other._topo_cache = self._topo_cache  # never changed in place: shared
        return other

    def drop_views(self) -> None:
        """Forget the views networkx caches on its graph (`pred`, `in_edges`, ...). Each holds
        the graph, a cycle only Python's cyclic collector frees: a dropped rewrite of a 99k-node
        graph waited for a 1.4 s collection. Without them, dropping it frees it at once."""
        cached = self.nx.__dict__
        for key in [k for k, v in cached.items()
                    if type(v).__module__.startswith("networkx.classes.")]:
            del cached[key]

    def set_attr(self, name: str, key: str, value) -> None:
        """Set attribute `key` of node `name` on a private copy of its NodeDef."""
        payload = node_def_pb2.NodeDef()
        payload.CopyFrom(self.node_def(name))
        payload.attr[key].CopyFrom(value)
        self._own(name)
        self.nx._node[name]["node_def"] = payload

    # ----------------------------------------------------------------- queries

    def __contains__(self, name: str) -> bool:
        return self._is_real(name)

    def __len__(self) -> int:
        return sum(1 for _ in self.nodes())

    def nodes(self) -> list[str]:
        """Node names in file order (new nodes last)."""
        if self._nodes_cache is None:
            real = [(d["order"], n) for n, d in self.nx._node.items() if not d.get("missing")]
            self._nodes_cache = [n for _, n in sorted(real)]
        return list(self._nodes_cache)

    def devices(self) -> Counter:
        """How many nodes are placed on each device ('' for unplaced ones): the few devices to
        ask about, instead of every node's."""
        return Counter(d["node_def"].device for d in self.nx._node.values()
                       if not d.get("missing"))

    def node_def(self, name: str) -> node_def_pb2.NodeDef:
        """The node's NodeDef without inputs; read it, change it only through `set_attr`."""
        try:
            return self.nx._node[name]["node_def"]  # a missing node has none
        except KeyError:
            raise GraphError(f"no node named '{name}'") from None

    def op(self, name: str) -> str:
        """`node_def(name).op`, kept beside it: read millions of times."""
        try:
            return self.nx._node[name]["op"]  # a missing node has none
        except KeyError:
            raise GraphError(f"no node named '{name}'") from None

    def ops(self, names) -> dict[str, str]:
        """name -> op of each of `names` (a collection), at once: a simulation asks for every
        node's."""
        node = self.nx._node
        try:
            return {name: node[name]["op"] for name in names}
        except KeyError:
            for name in names:
                self.op(name)  # the error for the first missing node
            raise

    def inputs(self, name: str) -> list[TensorRef]:
        """All inputs in NodeDef order: data inputs, then control dependencies."""
        return list((self._refs_cache.get(name) or self._refs(name))[0])

    def data_inputs(self, name: str) -> list[TensorRef]:
        return list((self._refs_cache.get(name) or self._refs(name))[1])  # read millions of times

    def data_inputs_of(self, names) -> dict[str, list[TensorRef]]:
        """name -> `data_inputs(name)` of each of `names`, at once (a simulation asks for every
        node's); the lists are the graph's own cache: read them, never change them."""
        cached, refs = self._refs_cache, self._refs
        return {name: (cached.get(name) or refs(name))[1] for name in names}

    def data_ancestors(self, names) -> set[str]:
        """`names` and every node their values are computed from (data edges only)."""
        seen, stack = set(names), list(names)
        while stack:
            for ref in self._refs(stack.pop())[1]:
                if ref.node not in seen:
                    seen.add(ref.node)
                    stack.append(ref.node)
        return seen

    def control_inputs(self, name: str) -> list[str]:
        return [r.node for r in self._refs(name)[0] if r.is_control]

    def consumers(self, ref: TensorRef | str) -> list[tuple[str, int | None]]:
        """(consumer, slot) pairs reading `ref`; a node name means all of its outputs and controls."""
        readers = self.nx._succ.get(ref if isinstance(ref, str) else ref.node)
        if readers is None:  # not a node: networkx's view decides what that means
            return self._consumers_by_view(ref)
        if isinstance(ref, str):
            return sorted((v, d["slot"] if d["slot"] is not None else -1)
                          for v, keyed in readers.items() for d in keyed.values())
        return sorted((v, d["slot"]) for v, keyed in readers.items() for d in keyed.values()
                      if d["port"] == ref.port)

    def read_as(self, name: str, readers: dict[str, int | None],
                through: tuple[str, ...] = ("Identity", "Cast")) -> bool:
        """Whether an op of `readers` takes `name`'s values, directly or through `through`
        ops, at the input slot it names (None: any)."""
        todo, seen = [name], set()
        while todo:
            node = todo.pop()
            for user, slot in self.consumers(TensorRef(node)):
                if user in seen or slot is None or slot < 0:
                    continue
                seen.add(user)
                op = self.op(user)
                if op in readers and readers[op] in (None, slot):
                    return True
                if op in through:
                    todo.append(user)
        return False

    def _consumers_by_view(self, ref: TensorRef | str) -> list[tuple[str, int | None]]:
        if isinstance(ref, str):
            return sorted((v, d["slot"] if d["slot"] is not None else -1)
                          for _, v, d in self.nx.out_edges(ref, data=True))
        return sorted((v, d["slot"]) for _, v, d in self.nx.out_edges(ref.node, data=True)
                      if d["port"] == ref.port)

    @property
    def succ(self) -> dict:
        """node -> {reader: edges}, networkx's own dict (`neighbours`): read, never change."""
        return neighbours(self.nx)

    @property
    def pred(self) -> dict:
        """node -> {source: edges}, networkx's own dict (`neighbours`): read, never change."""
        return neighbours(self.nx, upstream=True)

    def successors(self, name: str) -> list[str]:
        readers = self.nx._succ.get(name)  # networkx's own dict (its keys are unique): no view
        if readers is None:
            return sorted(set(self.nx.successors(name)))  # networkx's error for a non-node
        return sorted(readers)

    def topological_order(self, tie_break: str = "order") -> list[str]:
        """Producers before consumers, loop back edges ignored; ties by file `order` or by `name`.

        Tie-breaking by name makes the order independent of how the file listed the nodes.
        """
        if tie_break != "name" and self._topo_cache is not None:
            return list(self._topo_cache)
        names = self.nodes()
        if tie_break == "name":
            key = str
        else:
            position = {n: i for i, n in enumerate(names)}  # file order: `order` ascending
            key = position.__getitem__
        order = self._kahn(names, key)
        order = order if order is not None else sorted(names, key=key)
        if tie_break != "name":
            self._topo_cache = order
            return list(order)
        return order

    def _kahn(self, names: list[str], key) -> list[str] | None:
        """Kahn's algorithm over the real nodes (loop back edges ignored), the smallest key
        among the ready nodes first, as networkx's lexicographical_topological_sort (the keys
        here are unique), or with `key` None in no particular order (to test for a cycle);
        None when a cycle is left."""
        succ, pred = self.nx._succ, self.nx._pred
        if len(names) == len(succ) and not self.loop_back_nodes(names):
            # Every node real, no loop back edge: each producer counts once per consumer.
            children = succ
            waiting = {v: len(pred[v]) for v in names}
        else:
            real = set(names)
            children = {}
            waiting = dict.fromkeys(names, 0)
            for u in names:
                if self.loops_back(u):
                    children[u] = ()
                    continue
                children[u] = kids = [v for v in succ[u] if v in real]
                for v in kids:
                    waiting[v] += 1
        if key is None:
            ready = [n for n in names if waiting[n] == 0]
            for name in ready:  # grows as it goes
                for v in children[name]:
                    waiting[v] -= 1
                    if waiting[v] == 0:
                        ready.append(v)
            return ready if len(ready) == len(names) else None
        ready = [(key(n), n) for n in names if waiting[n] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, name = heapq.heappop(ready)
            order.append(name)
            for v in children[name]:
                waiting[v] -= 1
                if waiting[v] == 0:
                    heapq.heappush(ready, (key(v), v))
        return order if len(order) == len(names) else None

    # ----------------------------------------------------------------- mutation

    def add_node(self, name: str, op: str, inputs: Iterable[TensorRef] = (),
                 attrs: dict | None = None, device: str = "") -> str:
        """Add a node; `inputs` may mix data refs and control refs (controls are placed last)."""
        if self._is_real(name) or self.nx.has_node(name):
            raise GraphError(f"node '{name}' already exists")
        payload = node_def_pb2.NodeDef(name=name, op=op, device=device)
        for key, value in (attrs or {}).items():
            payload.attr[key].CopyFrom(value)
        self._insert(payload)
        self._add_inputs(name, inputs)
        return name

    def redefine(self, name: str, op: str, inputs: Iterable[TensorRef], attrs: dict) -> None:
        """Give node `name` a new op, inputs and attributes in place (its name, device and
        place in the file stay): its readers now read the new computation."""
        payload = node_def_pb2.NodeDef(name=name, op=op, device=self.node_def(name).device)
        for key, value in attrs.items():
            payload.attr[key].CopyFrom(value)
        self._own(name)  # a node without inputs owns no pair: its dicts may still be shared
        for u in list(self.nx._pred[name]):
            self._own_pair(u, name)
        self.nx.remove_edges_from(list(self.nx.in_edges(name, keys=True)))
        self._topo_cache = None
        self.nx._node[name]["node_def"] = payload
        self.nx._node[name]["op"] = op
        self._forget(name)
        self._add_inputs(name, inputs)

    def _add_inputs(self, name: str, inputs: Iterable[TensorRef]) -> None:
        refs = list(inputs)
        ordered = [r for r in refs if not r.is_control] + [r for r in refs if r.is_control]
        for pos, ref in enumerate(ordered):
            self._require(ref.node)
            self._own_pair(ref.node, name)
            self._add_edge(ref.node, name, pos, ref.port, None if ref.is_control else pos)

    def copy_node(self, name: str, new_name: str, renamed: dict[str, str] | None = None) -> str:
        """Copy a node (attrs, device, inputs) under a new name; consumers are not touched.
        A data input from a node in `renamed` (node -> its copy) reads the copy instead: a
        chain of copies is made without moving each edge after."""
        payload = node_def_pb2.NodeDef()
        payload.CopyFrom(self.node_def(name))
        payload.name = new_name
        if self._is_real(new_name) or self.nx.has_node(new_name):
            raise GraphError(f"node '{new_name}' already exists")
        self._insert(payload)
        for key, (u, d) in enumerate(self._in_edges(name)):  # key: its in-edges so far
            if renamed and d["slot"] is not None and u in renamed:
                u = renamed[u]
                self._require(u)
            self._own_pair(u, new_name)
            self._add_edge(u, new_name, key, d["port"], d["slot"])
        return new_name

    def replace_uses(self, old: TensorRef, new: TensorRef,
                     consumers: Iterable[str] | None = None) -> int:
        """Make data consumers of `old` (all, or just `consumers`) read `new`; returns edges moved."""
        self._require(new.node)
        only = None if consumers is None else set(consumers)
        readers = self.nx._succ.get(old.node)  # in `out_edges`' order, without building a view
        if readers is None:
            readers = {v: {k: d} for _, v, k, d in self.nx.out_edges(old.node, keys=True,
                                                                       data=True)}
        moved = [(v, k, d) for v, keyed in readers.items() for k, d in keyed.items()
                 if d["port"] == old.port and (only is None or v in only)]
        for v, k, d in moved:
            self._own_pair(old.node, v)
            self._own_pair(new.node, v)
            self.nx.remove_edge(old.node, v, key=k)
            self._topo_cache = None
            self._add_edge(new.node, v, k, new.port, d["slot"])
            self._forget(v)
        return len(moved)

    def add_control(self, before: str, after: str) -> bool:
        """Make `after` wait for `before`; returns False if that dependency already existed."""
        self._require(before)
        self._require(after)
        if before in self.control_inputs(after):
            return False
        keys = [k for _, _, k in self.nx.in_edges(after, keys=True)]
        self._own_pair(before, after)
        self._add_edge(before, after, max(keys, default=-1) + 1, CONTROL, None)
        self._forget(after)
        return True

    def remove_node(self, name: str) -> None:
        """Remove a node nobody reads; removing a used node would leave consumers short an input."""
        self._require(name)
        users = self.successors(name)
        if users:
            raise GraphError(f"cannot remove '{name}': still read by {', '.join(users[:3])}")
        for u in list(self.nx._pred[name]):
            self._own(u)
        self.nx.remove_node(name)
        self._topo_cache = None
        self._forget(name)
        self._owned.discard(name)
        self._owned_pairs = {p for p in self._owned_pairs if name not in p}
        self._nodes_cache = None

    def unique_name(self, base: str) -> str:
        """`base` if free, else `base_1`, `base_2`, ... (deterministic)."""
        if not self.nx.has_node(base):
            return base
        for i in itertools.count(1):
            candidate = f"{base}_{i}"
            if not self.nx.has_node(candidate):
                return candidate
        raise AssertionError("unreachable")

    # ----------------------------------------------------------------- validation

    def check(self) -> list[str]:
        """Every structural problem, one sentence each; an empty list means the graph is sound."""
        problems = list(self._load_problems)
        for name in sorted(n for n, data in self.nx._node.items() if data.get("missing")):
            for _, v, _, d in sorted(self.nx.out_edges(name, keys=True, data=True),
                                     key=lambda e: (e[1], e[2])):
                text = d["text"] or str(TensorRef(name, d["port"]))
                problems.append(f"node '{v}' reads '{text}' but there is no node '{name}'")
        node = self.nx._node
        for name in self.nodes():
            edges = self._in_edges(name)
            seen_control = False
            for _, d in edges:
                if d["port"] == CONTROL:
                    seen_control = True
                elif seen_control:
                    problems.append(f"node '{name}' lists a control input before a data input")
                    break
            if "_swap_to_host" not in node[name]["node_def"].attr:  # `swap_hints`, quickly
                continue
            for index in self.swap_hints(name):
                inputs = sum(d["port"] != CONTROL for _, d in edges)
                if not 0 <= index < inputs:
                    problems.append(f"node '{name}': _swap_to_host names input {index}, but it "
                                    f"has {inputs} data inputs")
        problems.extend(self._cycle_problems())
        return problems

    def swap_hints(self, name: str) -> list[int]:
        """The input indices Grappler's `_swap_to_host` attribute on `name` asks to swap (one
        out of range crashes Grappler's memory optimizer: `check` refuses it)."""
        attr = self.node_def(name).attr.get("_swap_to_host")
        if attr is None:
            return []
        return list(attr.list.i) if attr.HasField("list") else [attr.i]

    def _cycle_problems(self) -> list[str]:
        names = self.nodes()
        if self._kahn(names, None) is not None:
            return []  # every node sorted: no cycle, no self-loop
        real = set(names)
        dag = nx.DiGraph()
        dag.add_edges_from((u, v) for u, v in self.nx.edges()
                           if u in real and v in real and not self.loops_back(u))
        problems = []
        for component in nx.strongly_connected_components(dag):
            if len(component) > 1 or any(dag.has_edge(n, n) for n in component):
                names = sorted(component)
                shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                problems.append(f"cycle outside a while-loop frame through {len(names)} "
                                f"node(s): {shown}")
        return sorted(problems)

    # ----------------------------------------------------------------- internals

    def _add_edge(self, u: str, v: str, key: int, port: int, slot: int | None,
                  text: str | None = None) -> None:
        """`nx.add_edge(u, v, key=key, port=..., slot=..., text=...)` between two nodes the
        graph has, for a key the pair does not have yet, without networkx's generic path (a
        rewrite adds hundreds of thousands of edges)."""
        graph = self.nx
        readers = graph._succ[u]
        keyed = readers.get(v)
        if keyed is None:
            keyed = readers[v] = graph._pred[v][u] = {}
        keyed[key] = {"port": port, "slot": slot, "text": text}
        if cache := getattr(graph, "__networkx_cache__", None):  # as networkx's add_edge does
            cache.clear()
        self._topo_cache = None

    def _insert(self, payload: node_def_pb2.NodeDef) -> None:
        self.nx.add_node(payload.name, node_def=payload, op=payload.op, order=self._next_order)
        self._owned.add(payload.name)  # new dicts, shared with no copy
        self._next_order += 1
        self._topo_cache = None
        if self._nodes_cache is not None:  # the largest order: last in file order
            self._nodes_cache.append(payload.name)

    def _own(self, name: str) -> None:
        """Give this graph private copies of node `name`'s networkx dicts (attributes,
        successors, predecessors) before editing them; copies may share them until then."""
        if name in self._owned:
            return
        graph = self.nx
        graph._node[name] = graph._node[name].copy()
        graph._succ[name] = graph._succ[name].copy()
        graph._pred[name] = graph._pred[name].copy()
        self._owned.add(name)

    def _own_pair(self, u: str, v: str) -> None:
        """Private dicts for an edge u -> v about to be added or removed: both ends' and the
        edge-key dict the pair shares (edge data dicts are never edited, only replaced)."""
        self._own(u)
        self._own(v)
        if (u, v) not in self._owned_pairs:
            keyed = self.nx._succ[u].get(v)
            if keyed is not None:
                self.nx._succ[u][v] = self.nx._pred[v][u] = keyed.copy()
            self._owned_pairs.add((u, v))

    def _forget(self, name: str) -> None:
        """Drop the cached inputs of `name` (its in-edges changed)."""
        self._inputs_cache.pop(name, None)
        self._refs_cache.pop(name, None)

    def _is_real(self, name: str) -> bool:
        data = self.nx._node.get(name)
        return data is not None and not data.get("missing")

    def _require(self, name: str) -> None:
        if not self._is_real(name):
            raise GraphError(f"no node named '{name}'")

    def loops_back(self, producer: str) -> bool:
        """Whether `producer`'s outgoing edges close a v1 while-loop (NextIteration -> Merge)."""
        return self.nx._node[producer].get("op") in LOOP_BACK_OPS  # a missing node has no op

    def loop_back_nodes(self, names) -> set[str]:
        """Those of `names` that `loops_back`, at once: a simulation asks about every node."""
        node = self.nx._node
        return {n for n in names if node[n].get("op") in LOOP_BACK_OPS}

    def _in_edges(self, name: str) -> list[tuple[str, dict]]:
        cached = self._inputs_cache.get(name)
        if cached is None:
            self._require(name)
            edges = [(k, u, d) for u, keyed in self.nx._pred[name].items()
                     for k, d in keyed.items()]
            if len(edges) > 1:  # keys are unique
                edges.sort(key=itemgetter(0))
            cached = self._inputs_cache[name] = [(u, d) for _, u, d in edges]
        return cached

    def _refs(self, name: str) -> tuple[list[TensorRef], list[TensorRef]]:
        """(all inputs, data inputs) as TensorRefs, cached with the in-edges; never hand these
        lists out (callers get copies)."""
        cached = self._refs_cache.get(name)
        if cached is None:
            refs = [TensorRef(u, d["port"]) for u, d in self._in_edges(name)]
            cached = self._refs_cache[name] = (refs, [r for r in refs if r.port != CONTROL])
        return cached

    def _input_texts(self, name: str) -> list[str]:
        return [d["text"] or str(TensorRef(u, d["port"])) for u, d in self._in_edges(name)]


def _share_nx(graph: nx.MultiDiGraph) -> nx.MultiDiGraph:
    """A networkx graph with the same nodes and edges whose outer dicts are new and whose
    per-node dicts are `graph`'s own: the owning `Graph`s copy those before changing them."""
    other = nx.MultiDiGraph()
    other.graph.update(graph.graph)
    other._node = dict(graph._node)
    other._adj = dict(graph._succ)  # also sets _succ
    other._pred = dict(graph._pred)
    return other


def op_histogram(graph: Graph) -> Counter:
    """How many nodes of each op type."""
    return Counter(graph.op(n) for n in graph.nodes())
