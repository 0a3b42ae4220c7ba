"""The peak of a recompute plan estimated on the original step's schedule, without rewriting.

Applying a plan (copy the graph, add the copies and triggers) and simulating the result costs
about a second on a 10k-node graph; a planner that tries a hundred plans spends minutes. This
estimate takes the buffers the original's simulation allocated (`analysis.memory`) and changes
only what the plan changes:

- a buffer holding an output the plan recomputes lives from its node to its last reader that is
  not in the gradient flow (the forward pass), instead of to the last backward read;
- its copy lives from the step the gradients its segment's readers wait for are done (the
  copies of one connected segment run together then, as the recompute pass's trigger makes
  them) to the last gradient-flow read of the value, or of what the backward pass wrote into
  its buffer in place;
- a checkpoint recomputed ahead lives, as a copy, from the first read of the segments that read
  any checkpoint of its connected group (the recompute pass gates the group's copies on that
  segment's trigger) to its last read.

Intermediate copies that the gradient flow does not read (the MatMul before a recomputed ReLU)
live for a moment and are not counted, nor are the rewritten graph's small changes of order. The
estimate ranks plans; the recompute pass simulates the few best for real before choosing.
Cost per plan: a few passes of numpy over the recomputed nodes, the gradient flow's reads of
them and the schedule; no Python loop over nodes (a 99k-node graph: ~200 plans in seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..analysis import memory

__all__ = ["Estimate", "PlanEstimator"]


@dataclass
class Estimate:
    peak: int
    live_at_peak: set[str]  # owner nodes of the buffers live at the peak
    curve: np.ndarray       # bytes per schedule step (the exact planner adds these up)


class PlanEstimator:
    """Built once from the original's simulated step; `estimate` then prices each plan.

    Everything a plan's price depends on is held as arrays indexed by node (scheduled nodes by
    their step, the others after them) and by buffer, so a plan is priced by numpy alone: its
    segments' triggers (`_triggers`), then each buffer of a recomputed node (`_rows`)."""

    def __init__(self, graph, analysis):
        report = analysis.memory
        flow = analysis.split.gradient_flow
        self.backward = analysis.split.backward
        step_of = {name: i for i, name in enumerate(report.order)}
        self.steps = len(report.order)
        self.buffers = [b for b in report.buffers if b.place == memory.DEVICE]
        index = {id(b): i for i, b in enumerate(self.buffers)}
        self.size = np.array([b.size for b in self.buffers], dtype=np.int64)
        self.start = np.array([b.start for b in self.buffers], dtype=np.int64)
        self.end = np.array([self.steps - 1 if b.end is None or b.pinned else b.end
                             for b in self.buffers], dtype=np.int64)
        self.pinned = np.array([b.pinned for b in self.buffers], dtype=bool)
        self.owner = np.array([b.owner.node for b in self.buffers] or [""], dtype=object)
        # node -> id: its step when scheduled, else after the schedule
        names = list(report.order) + [n for n in graph.nodes() if n not in step_of]
        self.index = {n: i for i, n in enumerate(names)}
        self.nodes = len(names)
        # buffer -> its reads as (step, reader in the flow, tensor's node)
        reads: dict[int, list[tuple[int, bool, str]]] = {}
        for name in report.order:
            for ref in graph.data_inputs(name):
                buffer = report.buffer_of.get(ref)
                if buffer is not None and id(buffer) in index:
                    reads.setdefault(index[id(buffer)], []).append(
                        (step_of[name], name in flow, ref.node))
        self.flow_readers: dict[str, set[str]] = {}  # forward node -> its flow readers
        for buffer_reads in reads.values():
            for step, in_flow, node in buffer_reads:
                if in_flow:
                    self.flow_readers.setdefault(node, set()).add(report.order[step])
        self.step_of = step_of
        # Each buffer: held until without copies (its start, or its last read outside the
        # gradient flow by a forward node), and written in place by the backward pass until;
        # and its gradient-flow reads, flat: (buffer, step, tensor's node, backward node).
        self.kept_to = self.start.copy()
        self.later = np.full(len(self.buffers), -1, dtype=np.int64)
        flat = []
        for i, buffer_reads in reads.items():
            for step, in_flow, node in buffer_reads:
                if in_flow:
                    flat.append((i, step, self.index[node], node in self.backward))
                elif node in self.backward:
                    self.later[i] = max(self.later[i], step)
                else:
                    self.kept_to[i] = max(self.kept_to[i], step)
        table = np.array(flat, dtype=np.int64).reshape(-1, 4)
        self.read_buffer, self.read_step, self.read_node = table[:, 0], table[:, 1], table[:, 2]
        self.read_backward = table[:, 3].astype(bool)
        # (forward node, flow reader) pairs, and for each the reader's gradient-flow inputs:
        # (pair, input's step); a segment's trigger is found from these (`_triggers`)
        pairs = [(self.index[n], step_of[t]) for n, readers in self.flow_readers.items()
                 for t in readers]
        table = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        self.pair_node, self.pair_reader = table[:, 0], table[:, 1]
        inputs = {t: [step_of[r.node] for r in graph.data_inputs(t) if r.node in flow
                      and r.node in step_of]
                  for readers in self.flow_readers.values() for t in readers}
        waits = [(p, r) for p, (_, t) in enumerate(pairs) for r in inputs[report.order[t]]]
        table = np.array(waits, dtype=np.int64).reshape(-1, 2)
        self.wait_pair, self.wait_step = table[:, 0], table[:, 1]
        # data edges, for the segments of a set of recomputed nodes (`estimate_recomputed`)
        edges = [(self.index[r.node], self.index[v]) for v in graph.nodes()
                 for r in graph.data_inputs(v) if r.node in self.index]
        table = np.array(edges, dtype=np.int64).reshape(-1, 2)
        self.edge_from, self.edge_to = table[:, 0], table[:, 1]
        self._everything: tuple = (None, None)  # `estimate_recomputed`'s last set, as a mask
        self.delta = np.zeros(self.steps + 1, dtype=np.int64)
        np.add.at(self.delta, self.start, self.size)
        np.add.at(self.delta, self.end + 1, -self.size)

    def _flow_readers_of(self, nodes) -> set[str]:
        return {t for n in nodes for t in self.flow_readers.get(n, ())}

    def _first_step(self, readers) -> int:
        """The step at which the first of `readers` runs (the schedule's length for none)."""
        return min((self.step_of[t] for t in readers), default=self.steps)

    def _triggers(self, label: np.ndarray, count: int) -> np.ndarray:
        """Per segment (`label`: node id -> its segment, -1 for none; `count` segments), the
        step after which its copies run: when the gradients its readers wait for are done
        (what the recompute pass's trigger waits on; the executor then runs the copies at
        once), at the latest its first gradient-flow read (the schedule's length for none).
        The inputs of a segment's readers that are readers of that segment themselves are not
        waited for."""
        segment = label[self.pair_node]
        active = segment >= 0
        first = np.full(count, self.steps, dtype=np.int64)
        np.minimum.at(first, segment[active], self.pair_reader[active])
        span = self.steps + 1
        readers = np.unique(segment[active] * span + self.pair_reader[active])
        waiting = segment[self.wait_pair]
        keep = waiting >= 0
        waiting, step = waiting[keep], self.wait_step[keep]
        keys = waiting * span + step
        if len(readers):
            found = readers[np.minimum(np.searchsorted(readers, keys), len(readers) - 1)]
            outside = found != keys
            waiting, step = waiting[outside], step[outside]
        last = np.full(count, -1, dtype=np.int64)
        np.maximum.at(last, waiting, step)
        return np.where(last >= 0, np.minimum(last, first), first)

    def _rows(self, trigger: np.ndarray) -> np.ndarray:
        """(buffer, held until, copy from, copy until) for each buffer that the gradient flow
        reads from a copy, the nodes with a `trigger` step (node id -> step, -1: not
        recomputed) being recomputed then."""
        at = trigger[self.read_node]
        copied = at >= 0
        count = len(self.buffers)
        copy_to = np.full(count, -1, dtype=np.int64)
        copy_from = np.full(count, self.steps, dtype=np.int64)
        np.maximum.at(copy_to, self.read_buffer[copied], self.read_step[copied])
        np.minimum.at(copy_from, self.read_buffer[copied], at[copied])
        changed = np.flatnonzero(copy_to >= 0)
        if not len(changed):
            return np.zeros((0, 4), dtype=np.int64)
        later, kept_to = self.later.copy(), self.kept_to.copy()
        held = ~copied & self.read_backward  # written in place by the backward pass
        np.maximum.at(later, self.read_buffer[held], self.read_step[held])
        held = ~copied & ~self.read_backward
        np.maximum.at(kept_to, self.read_buffer[held], self.read_step[held])
        copy_to = np.maximum(copy_to[changed], later[changed])  # the backward pass writes
        # into the copy instead; a fetched buffer is held to the end anyway
        kept_to = np.where(self.pinned[changed], self.end[changed], kept_to[changed])
        return np.stack([changed, kept_to, np.minimum(copy_from[changed], copy_to), copy_to],
                        axis=1)

    def estimate(self, segments: list[set[str]],
                 ahead: list[tuple[set[str], set[str]]] = ()) -> Estimate:
        """The estimated peak when `segments` (connected groups of recomputed nodes) are
        recomputed and the checkpoints of each `ahead` group (connected by what lies between
        them) are recomputed ahead, together, when the first segment of their readers (the
        group's second set) runs."""
        label = np.full(self.nodes, -1, dtype=np.int64)
        for k, segment in enumerate(segments):
            label[[self.index[n] for n in segment]] = k
        return self._price(label, len(segments), ahead)

    def estimate_recomputed(self, everything: frozenset, removed: set[str],
                            ahead: list[tuple[set[str], set[str]]] = ()) -> Estimate:
        """`estimate` for the segments of the nodes of `everything` less those of `removed`:
        the groups of them connected by data edges (as the recompute pass finds them), found
        here with numpy. The planner prices many plans cut from one `everything`: its nodes'
        ids are found once."""
        held, mask = self._everything
        if held is not everything:
            mask = np.zeros(self.nodes, dtype=bool)
            mask[[self.index[n] for n in everything]] = True
            self._everything = (everything, mask)
        mask = mask.copy()
        mask[[self.index[n] for n in removed]] = False
        ids = np.flatnonzero(mask)
        local = np.full(self.nodes, -1, dtype=np.int64)
        local[ids] = np.arange(len(ids))
        label = np.full(self.nodes, -1, dtype=np.int64)
        label[ids] = _components(len(ids), local[self.edge_from], local[self.edge_to])
        return self._price(label, len(ids), ahead)

    def _price(self, label: np.ndarray, count: int, ahead) -> Estimate:
        recomputed = np.flatnonzero(label >= 0)
        trigger = np.full(self.nodes, -1, dtype=np.int64)
        trigger[recomputed] = self._triggers(label, count)[label[recomputed]]
        for group, readers in ahead:
            steps = [int(trigger[self.index[r]]) for r in readers]
            at = min([s if s >= 0 else self.steps for s in steps]
                     + [self._first_step(self._flow_readers_of(group))])
            trigger[[self.index[n] for n in group]] = at
        rows = self._rows(trigger)
        delta = self.delta.copy()
        if len(rows):  # each changed buffer: its original lifetime out, the held and copied
            changed, size = rows[:, 0], self.size[rows[:, 0]]  # ones in
            np.add.at(delta, self.start[changed], -size)
            np.add.at(delta, self.end[changed] + 1, size)
            for first, last in ((self.start[changed], rows[:, 1]), (rows[:, 2], rows[:, 3])):
                np.add.at(delta, first, size)
                np.add.at(delta, last + 1, -size)
        curve = np.cumsum(delta[:-1])
        at = int(np.argmax(curve))
        live = (self.start <= at) & (self.end >= at)
        live[rows[:, 0]] = False
        held = rows[((self.start[rows[:, 0]] <= at) & (at <= rows[:, 1]))
                    | ((rows[:, 2] <= at) & (at <= rows[:, 3])), 0]
        owners = set(self.owner[np.flatnonzero(live)].tolist())
        owners.update(self.owner[held].tolist())
        return Estimate(int(curve[at]), owners, curve)


def _components(count: int, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """The connected component of each of `count` vertices given the edges (first[k],
    second[k]) (an edge with an end of -1 is ignored), as the smallest vertex of its
    component's tree: roots hook onto the smallest root they share an edge with, then every
    vertex jumps to its root, until no edge joins two roots."""
    keep = (first >= 0) & (second >= 0)
    first, second = first[keep], second[keep]
    parent = np.arange(count, dtype=np.int64)
    while True:
        a, b = parent[first], parent[second]
        apart = a != b
        if not apart.any():
            return parent
        first, second, a, b = first[apart], second[apart], a[apart], b[apart]
        np.minimum.at(parent, np.maximum(a, b), np.minimum(a, b))
        while True:
            grand = parent[parent]
            if np.array_equal(grand, parent):
                break
            parent = grand
