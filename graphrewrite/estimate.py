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
Cost per plan: linear in the recomputed nodes, plus one pass of numpy over the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import memory


@dataclass
class Estimate:
    peak: int
    live_at_peak: set[str]  # owner nodes of the buffers live at the peak
    curve: np.ndarray       # bytes per schedule step (the exact planner adds these up)


class PlanEstimator:
    """Built once from the original's simulated step; `estimate` then prices each plan."""

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
        self.owner = [b.owner.node for b in self.buffers]
        # node -> its buffers; buffer -> its reads as (step, reader in the flow, tensor's node)
        self.buffers_of: dict[str, set[int]] = {}
        for ref, buffer in report.buffer_of.items():
            if id(buffer) in index:
                self.buffers_of.setdefault(ref.node, set()).add(index[id(buffer)])
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
        self.flow_inputs = {t: [r.node for r in graph.data_inputs(t) if r.node in flow
                                and r.node in step_of]
                            for readers in self.flow_readers.values() for t in readers}
        self.nodes_of: dict[int, set[str]] = {}  # buffer -> the nodes whose outputs it holds
        for node, held in self.buffers_of.items():
            for i in held:
                self.nodes_of.setdefault(i, set()).add(node)
        # buffer -> (held until without copies, written in place by the backward pass until,
        # its gradient-flow reads as (step, tensor's node, whether that is a backward node)):
        # the reads outside the flow are the same for every plan
        self.read_summary: dict[int, tuple[int, int, list]] = {}
        for i, buffer_reads in reads.items():
            kept_to, later, in_flow_reads = int(self.start[i]), -1, []
            for step, in_flow, node in buffer_reads:
                if in_flow:
                    in_flow_reads.append((step, node, node in self.backward))
                elif node in self.backward:
                    later = max(later, step)
                else:
                    kept_to = max(kept_to, step)
            self.read_summary[i] = (kept_to, later, in_flow_reads)
        self._segments: dict[frozenset, tuple[int, list, frozenset]] = {}
        self.delta = np.zeros(self.steps + 1, dtype=np.int64)
        np.add.at(self.delta, self.start, self.size)
        np.add.at(self.delta, self.end + 1, -self.size)

    def _trigger(self, segment: set[str]) -> int:
        """The step after which a segment's copies run: when the gradients its readers wait
        for are done (what the recompute pass's trigger waits on; the executor then runs the
        copies at once), at the latest its first gradient-flow read."""
        targets = self._flow_readers_of(segment)
        first = self._first_step(targets)
        waits = [self.step_of[r] for t in targets for r in self.flow_inputs[t]
                 if r not in targets]
        return min(max(waits, default=first), first)

    def _flow_readers_of(self, nodes) -> set[str]:
        return {t for n in nodes for t in self.flow_readers.get(n, ())}

    def _first_step(self, readers) -> int:
        """The step at which the first of `readers` runs (the schedule's length for none)."""
        return min((self.step_of[t] for t in readers), default=self.steps)

    def _segment(self, segment: set[str]) -> tuple[int, list, frozenset]:
        """A segment's trigger step, its buffers' rows (`_rows`) when nothing else is
        recomputed, and the other nodes sharing those buffers: cached, as the planner prices
        the same segments in many plans. A plan may take the rows as they are when it
        recomputes none of those other nodes (segments are connected by data edges, so a
        buffer is shared between two only through in-place writes by kept nodes)."""
        key = frozenset(segment)
        found = self._segments.get(key)
        if found is None:
            at = self._trigger(segment)
            buffers = {i for n in segment for i in self.buffers_of.get(n, ())}
            others = frozenset().union(*(self.nodes_of[i] for i in buffers)) - key
            found = self._segments[key] = (at, self._rows(segment, dict.fromkeys(segment, at)),
                                           others)
        return found

    def _rows(self, nodes, trigger_of: dict[str, int]) -> list[tuple[int, int, int, int]]:
        """(buffer, held until, copy from, copy until) for each buffer of `nodes` that the
        gradient flow reads from a copy, the nodes of `trigger_of` being recomputed then."""
        rows = []
        for i in {i for n in nodes for i in self.buffers_of.get(n, ())}:
            if i not in self.read_summary:
                continue
            kept_to, later, in_flow_reads = self.read_summary[i]
            copy_to, copy_from = -1, self.steps
            for step, node, backward in in_flow_reads:
                if node in trigger_of:
                    copy_to, copy_from = max(copy_to, step), min(copy_from, trigger_of[node])
                elif backward:
                    later = max(later, step)  # written in place by the backward pass
                else:
                    kept_to = max(kept_to, step)
            if copy_to < 0:
                continue  # nothing reads it from a copy
            copy_to = max(copy_to, later)  # the backward pass writes into the copy instead
            if self.buffers[i].pinned:
                kept_to = int(self.end[i])  # fetched: held to the end anyway
            rows.append((i, kept_to, min(copy_from, copy_to), copy_to))
        return rows

    def estimate(self, segments: list[set[str]],
                 ahead: list[tuple[set[str], set[str]]] = ()) -> Estimate:
        """The estimated peak when `segments` (connected groups of recomputed nodes) are
        recomputed and the checkpoints of each `ahead` group (connected by what lies between
        them) are recomputed ahead, together, when the first segment of their readers (the
        group's second set) runs."""
        trigger_of: dict[str, int] = {}
        priced = []
        for segment in segments:
            at, rows, others = self._segment(segment)
            trigger_of.update(dict.fromkeys(segment, at))
            priced.append((segment, rows, others))
        grouped: set[str] = set()
        for group, readers in ahead:
            at = min([trigger_of.get(r, self.steps) for r in readers]
                     + [self._first_step(self._flow_readers_of(group))])
            trigger_of.update(dict.fromkeys(group, at))
            grouped |= group
        rows, direct = [], set(grouped)
        for segment, segment_rows, others in priced:
            if trigger_of.keys().isdisjoint(others) and grouped.isdisjoint(segment):
                rows += segment_rows
            else:
                direct |= segment
        rows += self._rows(direct, trigger_of)
        delta = self.delta.copy()
        if rows:  # each changed buffer: its original lifetime out, the held and copied ones in
            table = np.array(rows, dtype=np.int64)
            changed, size = table[:, 0], self.size[table[:, 0]]
            np.add.at(delta, self.start[changed], -size)
            np.add.at(delta, self.end[changed] + 1, size)
            for first, last in ((self.start[changed], table[:, 1]), (table[:, 2], table[:, 3])):
                np.add.at(delta, first, size)
                np.add.at(delta, last + 1, -size)
        curve = np.cumsum(delta[:-1])
        at = int(np.argmax(curve))
        moved = {i for i, _, _, _ in rows}
        live = {self.owner[i] for i in np.flatnonzero((self.start <= at) & (self.end >= at))
                if i not in moved}
        live |= {self.owner[i] for i, kept_to, copy_from, copy_to in rows
                 if self.start[i] <= at <= kept_to or copy_from <= at <= copy_to}
        return Estimate(int(curve[at]), live, curve)
