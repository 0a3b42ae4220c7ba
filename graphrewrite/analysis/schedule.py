"""The order TensorFlow's executor runs a step in: what the fetches need, ready nodes first come
first served, and the IdentityN barriers Grappler removes first."""

from __future__ import annotations

import heapq
from collections import deque

from ..core.graph import Graph
from ..core.tensor_ref import CONTROL, TensorRef
from . import loops
from .split import reachable

__all__ = ["needed_nodes", "KEEP_ATTR", "bypassed_identities", "INLINE_OPS", "schedule"]

# Kernels whose `IsExpensive()` is false in TensorFlow 2.15 (shape_ops.h, reshape_op.h,
# identity_op.h, identity_n_op.h, no_op.h, constant_op.h, control_flow_ops.h): the executor runs
# them on the thread that made them ready, at once, before anything else it has (ScheduleReady).
INLINE_OPS = frozenset({
    "Const", "HostConst", "Identity", "RefIdentity", "StopGradient", "PreventGradient",
    "PlaceholderWithDefault", "IdentityN", "NoOp", "ControlTrigger", "Reshape", "Shape", "ShapeN",
    "Rank", "Size", "ExpandDims", "Squeeze", "Switch", "RefSwitch", "Merge", "RefMerge", "Enter",
    "RefEnter", "Exit", "RefExit", "NextIteration", "RefNextIteration"})


def needed_nodes(graph: Graph, fetches: list[str]) -> set[str]:
    """What TensorFlow runs for these fetches: their ancestors through data and control edges."""
    return reachable(graph.nx, fetches, upstream=True)


KEEP_ATTR = "_grappler_do_not_remove"


def bypassed_identities(graph: Graph, names, fetches) -> dict[str, list[TensorRef]]:
    """The IdentityN nodes Grappler removes before the step runs, with their inputs: their
    readers read those inputs directly. Modelled as written, a TF2 step's IdentityN over every
    gradient is a barrier no gradient passes until back-propagation ends, so each optimizer
    update would wait for all of them; as run, each starts when its own gradient is ready.
    Kept: fetched ones, ones marked `_grappler_do_not_remove`, ones with control inputs."""
    fetched = set(fetches)
    op_of = graph.ops(names)
    return {n: graph.data_inputs(n) for n in names
            if op_of[n] == "IdentityN" and n not in fetched
            and KEEP_ATTR not in graph.node_def(n).attr and not graph.control_inputs(n)}


def schedule(graph: Graph, fetches: list[str],
             bypassed: dict[str, list[TensorRef]] | None = None, workers: int = 1,
             seconds=None, times: dict | None = None) -> list[str]:
    """Executor-like order, sources in file order. One worker: ready nodes first come first
    served, as the executor runs inexpensive kernels (every GPU kernel) inline. More: the CPU
    executor's thread pool (`_pool`), a node taking `seconds(name)` there (default: one each);
    `times`, when given, gets each node's modelled (start, end) there.
    A reader of a `bypassed` IdentityN is ready when the IdentityN's input is."""
    needed = needed_nodes(graph, fetches)
    order_index = {n: i for i, n in enumerate(graph.nodes())}
    # networkx's adjacency dicts (producer -> consumer -> {key: edge data}), read directly.
    succ, pred = graph.succ, graph.pred
    if bypassed is None:
        bypassed = bypassed_identities(graph, needed, fetches)
    # producer -> readers it frees through a bypassed IdentityN (one entry per edge)
    through: dict[str, list[str]] = {}
    for identity, inputs in bypassed.items():
        for consumer, edges in succ[identity].items():
            for edge in edges.values():
                if edge["port"] != CONTROL and consumer in needed:
                    through.setdefault(inputs[edge["port"]].node, []).append(consumer)
    loops_back = graph.loop_back_nodes(needed)
    body_ends: dict[str, list[str]] = {}
    # `needed` holds every producer of its nodes, so only loop back edges are not counted.
    if loops_back:
        pending = {name: sum(len(edges) for u, edges in pred[name].items()
                             if u not in loops_back) for name in needed}
        # A loop's Exits wait for its whole body; they then join in file order (`needed` is a
        # set: its order changes from one process to the next).
        body_ends = {n: sorted(exits, key=order_index.get)
                     for n, exits in loops.body_ends(graph, needed).items()}
        for exits in body_ends.values():
            for name in exits:
                pending[name] += 1
    else:
        pending = {name: sum(map(len, pred[name].values())) for name in needed}

    def release(name: str) -> list[str]:
        """The nodes `name` makes ready, in file order (only those are sorted: a moving-average
        update can have a thousand control consumers)."""
        now_ready = []
        if name in loops_back:
            for exit_ in body_ends.get(name, ()):
                pending[exit_] -= 1
                if pending[exit_] == 0:
                    now_ready.append(exit_)
            return now_ready
        for consumer, edges in succ[name].items():
            if consumer in needed:
                if name in bypassed:  # only its control edges: the data ones are `through`
                    edges = [e for e in edges.values() if e["port"] == CONTROL]
                    if not edges:
                        continue
                pending[consumer] -= len(edges)
                if pending[consumer] == 0:
                    now_ready.append(consumer)
        for consumer in through.get(name, ()):
            pending[consumer] -= 1
            if pending[consumer] == 0:
                now_ready.append(consumer)
        if len(now_ready) > 1:
            now_ready.sort(key=order_index.get)
        return now_ready

    sources = sorted((n for n, count in pending.items() if count == 0), key=order_index.get)
    if workers == 1:
        return _in_order(sources, release)
    op_of = graph.ops(needed)
    return _pool(sources, release, workers, {n for n in needed if op_of[n] in INLINE_OPS},
                 seconds or (lambda name: 1.0), {} if times is None else times)


def _in_order(sources: list[str], release) -> list[str]:
    ready, order = deque(sources), []
    while ready:
        name = ready.popleft()
        order.append(name)
        ready.extend(release(name))
    return order


def _pool(sources: list[str], release, workers: int, cheap, seconds,
          times: dict) -> list[str]:
    """TensorFlow's CPU executor on `workers` inter-op threads, in modelled time: a node takes
    `seconds(name)` (its arithmetic or its memory traffic on this CPU), the `cheap` ones
    (`INLINE_OPS`) none. Of the nodes one makes ready (when it ends), the cheap ones run next on
    the same thread (ExecutorState::ScheduleReady); of the others (every other CPU kernel
    counts as expensive in a step's first hundred runs: its cost estimate starts high), the
    last runs next on the same thread when no cheap one is waiting, and the rest are pushed on
    the front of that thread's queue (Eigen's pool: a thread takes its own newest first, and an
    idle thread steals another's oldest). A thread thus finishes one chain before starting
    another. Timed, a long matrix product on one thread lets the other run many small kernels
    meanwhile: in turns instead (one kernel each), a deep MLP's optimizer updates fell ever
    further behind its backward pass, and the weight gradients waiting for them were modelled
    held (+34% on a TF2 MLP with Adam). A `ShapeN` a
    convolution's gradient reads its input by runs as that input is made: queued instead, it
    held every forward activation of a rewritten DenseNet step (modelled 337 MiB, measured
    187). The order returned is the order nodes start in; `times` gets (start, end) of each."""
    queues = [deque() for _ in range(workers)]  # front: newest
    injected = deque(sources)  # pushed by the caller: taken oldest first
    inline: list[deque] = [deque() for _ in range(workers)]
    events = [(0.0, w, w, None) for w in range(workers)]  # (time, tie, worker, node ended)
    heapq.heapify(events)
    idle: list[int] = []
    order: list[str] = []
    tie = workers
    while events:
        now, _, worker, ended = heapq.heappop(events)
        own = inline[worker]
        if ended is not None:
            expensive = []
            for ready_now in release(ended):
                (own if ready_now in cheap else expensive).append(ready_now)
            if expensive:
                last = expensive.pop()
                if own:  # inexpensive work first: the expensive node goes to the pool
                    expensive.append(last)
                else:
                    own.append(last)
                queues[worker].extendleft(expensive)
                while idle and expensive:  # a push wakes a waiting thread
                    expensive.pop()
                    heapq.heappush(events, (now, tie, idle.pop(0), None))
                    tie += 1
        if own:
            name = own.popleft()
        elif queues[worker]:
            name = queues[worker].popleft()
        elif injected:
            name = injected.popleft()
        else:
            victim = next((q for q in queues if q), None)
            if victim is None:
                idle.append(worker)
                continue
            name = victim.pop()
        order.append(name)
        end = now + (0.0 if name in cheap else seconds(name))
        times[name] = (now, end)
        heapq.heappush(events, (end, tie, worker, name))
        tie += 1
    return order
