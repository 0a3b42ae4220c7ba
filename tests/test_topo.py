"""The kept topological order and the incremental ancestry of the triggers, against plain walks
on random graphs grown the way the recompute pass grows them."""

import random

import networkx as nx
import pytest

from graphrewrite.core.graph import Graph
from graphrewrite.core.names import TRIGGER_PREFIX
from graphrewrite.core.tensor_ref import CONTROL, TensorRef
from graphrewrite.core.topo import TopoOrder
from graphrewrite.passes.pads import can_gate
from graphrewrite.passes.triggers import Ancestry


def random_dag(seed: int, size: int = 60) -> Graph:
    """Nodes n0..n{size-1}, each reading up to three earlier ones (data edges); a third are
    Identities (a trigger never waits on those), the rest Relus."""
    rng = random.Random(seed)
    graph = Graph()
    for i in range(size):
        inputs = sorted(rng.sample(range(i), min(i, rng.randint(0, 3))))
        graph.add_node(f"n{i}", rng.choice(["Identity", "Relu", "Relu"]),
                       [TensorRef(f"n{j}") for j in inputs])
    return graph


def valid(order: TopoOrder, graph: Graph) -> bool:
    return all(order.position[u] < order.position[v] for u, v in graph.nx.edges()
               if u in order.position and order.position[u] >= 0)


@pytest.mark.parametrize("seed", range(8))
def test_order_stays_valid_and_answers_reachability_as_a_full_walk(seed):
    rng = random.Random(seed)
    graph = random_dag(seed)
    late = [f"n{i}" for i in range(40, 60)]  # placed as late as their readers allow
    order = TopoOrder.build(graph, [f"n{i}" for i in range(40)], late)
    assert valid(order, graph)
    for step in range(25):
        u, v = rng.sample(graph.nodes(), 2)
        if v in nx.ancestors(graph.nx, u) or v == u:
            u, v = v, u  # an edge that keeps the graph acyclic
        if rng.random() < 0.5:  # a new node after some, before others, as a trigger is added
            waits = rng.sample(sorted(nx.ancestors(graph.nx, v) | {u}), 1)
            name = f"t{step}"
            graph.add_node(name, "NoOp", [TensorRef(w, CONTROL) for w in waits])
            order.place_after(name, waits)
            u = name
        graph.add_control(u, v)
        order.add_edge(u, v)
        assert valid(order, graph)
        sources = rng.sample(graph.nodes(), 2)
        asked = rng.sample(graph.nodes(), 10)
        expected = {n for n in asked
                    if n in sources or any(n in nx.descendants(graph.nx, s) for s in sources)}
        assert order.reaching(sources, asked) == expected


@pytest.mark.parametrize("seed", range(8))
def test_ancestry_readers_match_a_full_walk(seed):
    """Triggers added one after another, each waiting on random nodes: the readers of the
    waits' ancestors, found incrementally, equal those of a walk over everything."""
    rng = random.Random(seed)
    graph = random_dag(seed, 80)
    flow = frozenset(graph.nodes())
    original = graph.copy()
    ancestry = Ancestry(graph, original, flow, set())

    def full(waits):
        ancestors = set(waits)
        for w in waits:
            ancestors |= {a for a in nx.ancestors(graph.nx, w)
                          if a in flow or a.startswith(TRIGGER_PREFIX)}
        return {v for a in ancestors if a in flow for v in graph.nx.successors(a)
                if v in flow and v not in ancestors and graph.op(v) != "Identity"
                and can_gate(original, v)}

    names = [f"n{i}" for i in range(80)]
    for step in range(12):
        at = min(79, 10 + step * 6)  # back-propagation moving on, with some jumps back
        waits = sorted(rng.sample(names[max(0, at - 15):at + 1], 2))
        assert ancestry.readers(waits) == full(waits)
        trigger = graph.add_node(f"{TRIGGER_PREFIX}{step}", "NoOp",
                                 [TensorRef(w, CONTROL) for w in waits])
        later = [n for n in names[at + 1:] if not nx.has_path(graph.nx, n, trigger)]
        if later:
            graph.add_control(trigger, rng.choice(later))
        ancestry.advance(trigger)
