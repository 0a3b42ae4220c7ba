"""A topological order kept valid while a graph grows, for reachability questions that stay local.

The recompute pass adds one trigger per segment and must not make a cycle: a trigger may only
wait on nodes its segment's copies do not reach. Walking everything the copies reach for each
segment costs the whole backward pass per segment, quadratic in the graph. With a topological
order, a node can only be reached through nodes placed before it, so the walk stops at the
furthest node asked about (`reaching`), usually a few layers away.

Edges are added as Pearce and Kelly's dynamic topological sort adds them ("A dynamic
topological sort algorithm for directed acyclic graphs", JEA 2007): an edge against the order
reorders only the nodes between its two ends that depend on them. Positions are floats; a new
node takes the midpoint of a free gap and everything is renumbered on the rare occasion a gap is
used up. Loop back edges (NextIteration -> Merge) would break the order's premise: graphs with
v1 loops are answered by plain walks instead.
"""

from __future__ import annotations

from bisect import bisect_right, insort

from .graph import Graph

__all__ = ["TopoOrder"]


class TopoOrder:
    """Positions of a graph's nodes, producers before consumers, kept valid by `add_edge`."""

    def __init__(self, graph: Graph, position: dict[str, float]):
        self.succ, self.pred = graph.succ, graph.pred  # networkx's dicts: no views
        self.position = position
        self.slots = sorted(position.values())

    @classmethod
    def build(cls, graph: Graph, order: list[str], late: list[str]) -> "TopoOrder":
        """The order `order` (topological, of every node but `late`) with each node of `late`
        (given in a topological order of theirs) placed as late as its consumers allow: in
        the gap before the earliest of them, so what waits on it later reorders little. Not
        for graphs with loop back edges."""
        position = {n: float(i) for i, n in enumerate(order)}
        placed_late = set(late)
        position.update((n, -1.0) for n in graph.nx
                        if n not in position and n not in placed_late)
        succ = graph.succ
        # late node -> the position of the earliest placed node it must precede (after all)
        before: dict[str, float] = {}
        for name in reversed(late):
            before[name] = min((before[s] if s in before else position[s] for s in succ[name]),
                               default=float(len(order)))
        gaps: dict[float, list[str]] = {}
        for name in late:  # in their topological order: kept within each gap
            gaps.setdefault(before[name], []).append(name)
        for end, names in gaps.items():
            step = 1.0 / (len(names) + 1)
            for i, name in enumerate(names):
                position[name] = end - 1.0 + step * (i + 1)
        return cls(graph, position)

    def reaching(self, sources, asked) -> set[str]:
        """The nodes of `asked` that `sources` reach (a source reaches itself): a walk over
        the nodes placed no later than the last of `asked`."""
        if not asked:
            return set()
        position, succ = self.position, self.succ
        bound = max(position[n] for n in asked)
        seen = {s for s in sources if position[s] <= bound}
        stack = list(seen)
        while stack:
            for other in succ[stack.pop()]:
                if other not in seen and position[other] <= bound:
                    seen.add(other)
                    stack.append(other)
        return seen.intersection(asked)

    def place_after(self, name: str, before) -> None:
        """Place the new node `name` just after the last of `before`."""
        last = max((self.position[n] for n in before), default=self.slots[0] - 1.0)
        index = bisect_right(self.slots, last)
        following = self.slots[index] if index < len(self.slots) else last + 2.0
        middle = (last + following) / 2
        if not last < middle < following:
            self._renumber()
            return self.place_after(name, before)
        self.position[name] = middle
        insort(self.slots, middle)

    def add_edge(self, u: str, v: str) -> None:
        """Keep the order valid for a new edge u -> v (already in the graph): when v is placed
        before u, the nodes v reaches that are placed before u, and the nodes reaching u that
        are placed after v, swap places among their own positions."""
        position = self.position
        low, high = position[v], position[u]
        if low > high:
            return
        forward = self._walk(v, self.succ, lambda p: p < high)
        backward = self._walk(u, self.pred, lambda p: p > low)
        slots = sorted(position[n] for n in forward + backward)
        moved = sorted(backward, key=position.__getitem__) + sorted(forward,
                                                                     key=position.__getitem__)
        for name, slot in zip(moved, slots):
            position[name] = slot

    def _walk(self, start: str, adjacency, within) -> list[str]:
        seen, stack = {start}, [start]
        while stack:
            for other in adjacency[stack.pop()]:
                if other not in seen and within(self.position[other]):
                    seen.add(other)
                    stack.append(other)
        return list(seen)

    def _renumber(self) -> None:
        ranked = sorted(self.position, key=self.position.__getitem__)
        self.position.update((n, float(i)) for i, n in enumerate(ranked))
        self.slots = sorted(self.position.values())
