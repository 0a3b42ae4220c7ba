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
        self.reads: dict[int, list[tuple[int, bool, str]]] = {}
        for name in report.order:
            for ref in graph.data_inputs(name):
                buffer = report.buffer_of.get(ref)
                if buffer is not None and id(buffer) in index:
                    self.reads.setdefault(index[id(buffer)], []).append(
                        (step_of[name], name in flow, ref.node))
        self.flow_readers: dict[str, set[str]] = {}  # forward node -> its flow readers
        for reads in self.reads.values():
            for step, in_flow, node in reads:
                if in_flow:
                    self.flow_readers.setdefault(node, set()).add(report.order[step])
        self.step_of = step_of
        self.flow_inputs = {t: [r.node for r in graph.data_inputs(t) if r.node in flow
                                and r.node in step_of]
                            for readers in self.flow_readers.values() for t in readers}
        self.delta = np.zeros(self.steps + 1, dtype=np.int64)
        np.add.at(self.delta, self.start, self.size)
        np.add.at(self.delta, self.end + 1, -self.size)

    def _trigger(self, segment: set[str]) -> int:
        """The step after which a segment's copies run: when the gradients its readers wait
        for are done (what the recompute pass's trigger waits on; the executor then runs the
        copies at once), at the latest its first gradient-flow read."""
        targets = {t for n in segment for t in self.flow_readers.get(n, ())}
        first = self._first_read(segment)
        waits = [self.step_of[r] for t in targets for r in self.flow_inputs[t]
                 if r not in targets]
        return min(max(waits, default=first), first)

    def _first_read(self, nodes) -> int:
        """The step at which the gradient flow first reads any of `nodes` (the schedule's
        length when it reads none)."""
        return min((self.step_of[t] for n in nodes for t in self.flow_readers.get(n, ())),
                   default=self.steps)

    def estimate(self, segments: list[set[str]],
                 ahead: list[tuple[set[str], set[str]]] = ()) -> Estimate:
        """The estimated peak when `segments` (connected groups of recomputed nodes) are
        recomputed and the checkpoints of each `ahead` group (connected by what lies between
        them) are recomputed ahead, together, when the first segment of their readers (the
        group's second set) runs."""
        trigger_of: dict[str, int] = {}
        for segment in segments:
            trigger_of.update(dict.fromkeys(segment, self._trigger(segment)))
        for group, readers in ahead:
            at = min([trigger_of.get(r, self.steps) for r in readers]
                     + [self._first_read(group)])
            trigger_of.update(dict.fromkeys(group, at))
        changed, starts, ends, sizes = [], [], [], []
        for i in {i for n in trigger_of for i in self.buffers_of.get(n, ())}:
            kept_to, copy_to, copy_from, later = int(self.start[i]), -1, self.steps, -1
            for step, in_flow, node in self.reads.get(i, ()):
                if node in trigger_of and (in_flow or node in ahead):
                    copy_to, copy_from = max(copy_to, step), min(copy_from, trigger_of[node])
                elif node in self.backward:
                    later = max(later, step)  # written in place by the backward pass
                else:
                    kept_to = max(kept_to, step)
            if copy_to < 0:
                continue  # nothing reads it from a copy
            copy_to = max(copy_to, later)  # the backward pass writes into the copy instead
            if self.buffers[i].pinned:
                kept_to = int(self.end[i])  # fetched: held to the end anyway
            changed.append(i)
            starts += [int(self.start[i]), min(copy_from, copy_to)]
            ends += [kept_to, copy_to]
            sizes += [int(self.size[i])] * 2
        delta = self.delta.copy()
        if changed:
            rows = np.array(changed)
            np.add.at(delta, self.start[rows], -self.size[rows])
            np.add.at(delta, self.end[rows] + 1, self.size[rows])
            starts_a, ends_a, sizes_a = (np.array(v, dtype=np.int64) for v in (starts, ends,
                                                                               sizes))
            np.add.at(delta, starts_a, sizes_a)
            np.add.at(delta, ends_a + 1, -sizes_a)
        curve = np.cumsum(delta[:-1])
        at = int(np.argmax(curve))
        moved = set(changed)
        live = {self.owner[i] for i in np.flatnonzero((self.start <= at) & (self.end >= at))
                if i not in moved}
        live |= {self.owner[changed[k // 2]] for k in range(len(starts))
                 if starts[k] <= at <= ends[k]}
        return Estimate(int(curve[at]), live, curve)
