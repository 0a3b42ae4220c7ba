"""While loops in the memory model: what a loop keeps from every iteration for the backward pass.

The schedule (`schedule.schedule`) runs a loop body once. What one iteration computes and drops
is counted right that way, but a training loop also keeps a value of every iteration for its
gradient: TF1 gradients push them on stacks (`StackPushV2`, popped by the gradient loop's
`StackPopV2`), a TF2 loop lowered by Grappler pushes them on tensor lists (`TensorListPushBack`,
popped by `TensorListPopBack`), and the loop's own outputs are written one element per
iteration (`TensorListSetItem` into a `TensorListReserve`, `TensorArrayWriteV3`). Those hold
`trip count x element` bytes (as that many allocations), which this module gives the
accumulating op's output, held until its last reader runs (the stack of the list, the gather),
or to the end of the loop that pops them (a gradient loop empties them over all its iterations;
the body that runs once stands for its first one). A popped element is one of those buffers.

The trip count of a loop frame comes from, in order: its condition (`i < N` with `N` a constant
or a static shape's dimension, which is how `maximum_iterations` and a static sequence length
appear; the counter starts at a constant and steps by a constant), the forward loop whose stacks
or lists a gradient loop pops, the constant size of a TensorArray or `TensorListReserve` the
loop reads or writes. Where none gives it, a warning says so and the loop's accumulators count
one iteration.

Shape inference does not see through a v1 loop (a non-constant `Enter` and the `Merge` of a
loop variable have unknown shapes, so does everything the body computes from them):
`refine_shapes` infers once more with every loop variable held at its initial shape, and keeps
what it learns where each variable's next iteration has the same shape.

A value pushed every iteration that does not change (a constant or a tensor entered from outside
the loop) is one buffer referenced N times: it costs nothing more. The allocator serves every
element on its own, so an element counts at least 256 bytes.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from ..core.graph import Graph
from ..core.names import LOOP_GATE
from ..core.tensor_ref import CONTROL, TensorRef

__all__ = ["ENTER", "EXIT", "MERGE", "NEXT", "PASS_THROUGH", "ACCUMULATE", "READ", "RETURNED",
           "UNREAD", "TAKE", "POPPED", "FILLED_FROM", "DT_VARIANT", "ELEMENT_FLOOR", "LoopMemory",
           "analyse", "SUMS", "parallel_iterations", "body_ends", "frame_of", "runs_per_step",
           "trip_counts", "through", "list_fate", "FOLDED", "constant_value"]

log = logging.getLogger(__name__)


ENTER, EXIT, MERGE = ("Enter", "RefEnter"), ("Exit", "RefExit"), ("Merge", "RefMerge")
NEXT = ("NextIteration", "RefNextIteration")
# Ops whose output is (a view of) their first input, followed when tracing a handle or a list.
PASS_THROUGH = frozenset({"Identity", "Enter", "RefEnter", "Exit", "RefExit", "Merge", "RefMerge",
                          "Switch", "RefSwitch", "NextIteration", "RefNextIteration", "Snapshot",
                          "IdentityN"})
# Accumulating op -> index of the element it adds.
ACCUMULATE = {"StackPushV2": 1, "TensorListPushBack": 1, "TensorListSetItem": 2,
              "TensorArrayWriteV3": 2}
READ, RETURNED, UNREAD = "read", "returned", "unread"  # `list_fate`
# Ops that take elements out of a container the accumulators filled (their last one frees it).
TAKE = frozenset({"StackPopV2", "TensorListPopBack", "TensorListGetItem", "TensorListStack",
                  "TensorListGather", "TensorListConcatV2", "TensorArrayReadV3",
                  "TensorArrayGatherV3", "TensorArrayConcatV3"})
# Ops that hand out an element an accumulator holds: op -> its output port.
POPPED = {"StackPopV2": 0, "TensorListPopBack": 1}
# Containers filled from one tensor outside a loop: op -> input whose bytes they copy.
FILLED_FROM = {"TensorListFromTensor": 0, "TensorArrayScatterV3": 2, "TensorArraySplitV3": 2}
DT_VARIANT = 21
ELEMENT_FLOOR = 256  # the BFC allocator's smallest chunk


@dataclass
class LoopMemory:
    """What the memory model adds for loops: output sizes that replace the inferred ones, and
    tensors some later node holds (node -> the extra tensors it reads, last)."""

    sizes: dict[TensorRef, int] = field(default_factory=dict)
    pieces: dict[TensorRef, int] = field(default_factory=dict)  # allocations a size stands for
    held_by: dict[str, list[TensorRef]] = field(default_factory=dict)
    trips: dict[str, int | None] = field(default_factory=dict)  # frame -> trip count
    overlap: dict[str, int] = field(default_factory=dict)  # node -> bytes of a next iteration's
    parallel: dict[str, int] = field(default_factory=dict)  # frame -> parallel_iterations
    # node -> bytes more its lagging sum can hold when the frame's iterations run ahead of it
    # (`_lagging_sums`), as the sizes of its allocations: an upper bound, not in the peak
    pileup: dict[str, tuple[int, ...]] = field(default_factory=dict)


def analyse(graph: Graph, shapes, order: list[str]) -> LoopMemory:
    """Sizes and holders for the accumulators of the loops among `order` (the scheduled nodes)."""
    result = LoopMemory()
    if not _has_containers(graph, shapes, order):
        return result  # most graphs: the model runs this for every plan it prices
    for name in order:  # containers and list handles: their elements, or nothing
        op = graph.op(name)
        if op in FILLED_FROM:
            inputs = graph.data_inputs(name)
            source = inputs[FILLED_FROM[op]] if len(inputs) > FILLED_FROM[op] else None
            result.sizes[TensorRef(name)] = (shapes.nbytes(source) or 0) if source else 0
        else:
            for ref in shapes.outputs(name):
                info = shapes[ref]
                if info is not None and info.dtype == DT_VARIANT and op not in PASS_THROUGH:
                    result.sizes[ref] = 0
        if op in POPPED:  # one of the elements the accumulator holds, not a new buffer
            result.sizes[TensorRef(name, POPPED[op])] = 0
    accumulators = [n for n in order if graph.op(n) in ACCUMULATE]
    if not accumulators:
        return result
    position = {name: i for i, name in enumerate(order)}
    frames = frame_of(graph)
    result.trips = trip_counts(graph, shapes, frames)
    last = {frames[n]: n for n in order if frames.get(n)}  # frame -> its last scheduled node
    unknown_trips = set()
    counted = set()  # (frame, value) kept already: a loop variable is the last iteration's value
    for name in accumulators:
        frame = frames.get(name, "")
        if not frame:
            continue
        trips = result.trips.get(frame)
        if trips is None:
            unknown_trips.add(frame)
            trips = 1
        element = graph.data_inputs(name)[ACCUMULATE[graph.op(name)]]
        size = shapes.nbytes(element)
        kept = _kept_value(graph, element)
        fate = list_fate(graph, name)
        if fate == UNREAD:
            result.sizes[TensorRef(name)] = 0  # the executor never runs it (measured)
            continue
        if _invariant(graph, element, frames, frame) or (frame, kept) in counted:
            size = 0
        elif size is not None:
            size = trips * max(size, ELEMENT_FLOOR) if size else 0
            result.pieces[TensorRef(name)] = trips
        counted.add((frame, kept))
        result.sizes[TensorRef(name)] = size or 0
        readers = [r for r in _readers(graph, name) if position.get(r, -1) > position[name]]
        # A loop that takes them out (the gradient loop popping them) empties the container
        # over all its iterations, and the body that runs once stands for its first one.
        readers = [last[frames[r]] if frames.get(r) not in ("", frame) else r for r in readers]
        if not readers and fate == RETURNED:
            readers = [last[frame]]  # freed when its call returns, after its loop
        for reader in readers or order[-1:]:  # nothing takes them: held to the step's end
            result.held_by.setdefault(reader, []).append(TensorRef(name))
    result.parallel = parallel_iterations(graph, frames)
    _overlap(graph, shapes, order, frames, result)
    _lagging_sums(graph, shapes, order, frames, result)
    for frame in sorted(unknown_trips):
        log.warning("loop '%s': its trip count is not given by a constant bound, a constant "
                    "TensorArray/TensorList size or the loop it differentiates; what it keeps "
                    "for the backward pass counts one iteration", frame)
    return result


def _has_containers(graph: Graph, shapes, order: list[str]) -> bool:
    """Whether anything `analyse` sizes can be there: a variant tensor (a list or stack
    handle) or an op that fills, pops or accumulates into a container."""
    if any(info is not None and info.dtype == DT_VARIANT for info in shapes.tensors.values()):
        return True
    container_ops = FILLED_FROM.keys() | POPPED.keys() | ACCUMULATE.keys()
    return not container_ops.isdisjoint(graph.ops(order).values())


def _overlap(graph: Graph, shapes, order, frames, result: LoopMemory) -> None:
    """The executor starts an iteration before the last one is done (`parallel_iterations`):
    what is not on the chain from one iteration to the next, such as a gradient loop's
    per-iteration weight gradient waiting to be added to its sum, is computed for the next
    iteration while the last one's is still held. Counted as a second copy of each loop's
    largest per-iteration tensor, held while its node runs."""
    largest: dict[str, tuple[int, str]] = {}
    for name in order:
        frame = frames.get(name, "")
        if not frame or min(result.trips.get(frame) or 1, result.parallel.get(frame, 2)) < 2 \
                or graph.op(name) in PASS_THROUGH \
                or graph.op(name) in ACCUMULATE:
            continue
        size = sum(result.sizes.get(r, shapes.nbytes(r) or 0) for r in shapes.outputs(name))
        if size > largest.get(frame, (0, ""))[0]:
            largest[frame] = (size, name)
    for size, name in largest.values():
        result.overlap[name] = size


SUMS = frozenset({"AddN", "Add", "AddV2"})


def _lagging_sums(graph: Graph, shapes, order, frames, result: LoopMemory) -> None:
    """How much more a loop can hold when its iterations run ahead of a sum it carries.

    A gradient loop adds each iteration's weight gradient (a term computed off the recurrence
    that carries the next iteration's input gradient) to a loop variable: `acc = AddN(acc,
    term)`, itself a chain of one add per iteration. TensorFlow's executor lets a frame have
    `parallel_iterations` iterations in flight and retires them in order
    (`propagator_state.cc`: an iteration is done when its ops are and the one before it is
    deleted; a NextIteration past the window waits in `next_iter_roots`), so when the recurrence
    races ahead, the terms of up to min(parallel_iterations, trips) iterations can be computed
    and wait for the sum. Measured on the TF2 GRU step at batch 16 (`BENCHMARKS.md`) that many
    are held at 4, 8 and 16 parallel iterations in nearly every step, and from 1 to all 32 at
    Keras's 32; the LSTM of the same size keeps up. When it happens is a race between the
    executor's two inter-op threads, so this is an upper bound beside the modelled peak. The
    sums of a frame lag together (the whole iteration waits), so the frame's
    `(window - 1) x its sums' terms` is held at once (each its own allocation), at its last
    scheduled sum."""
    held: dict[str, tuple[tuple, str]] = {}  # frame -> (terms held, its last scheduled sum)
    gated = {frames.get(n) for n in order if LOOP_GATE in n}  # `loop_copy`'s: they keep pace
    for name in order:
        frame = frames.get(name, "")
        if not frame or frame in gated or graph.op(name) not in SUMS:
            continue
        window = min(result.trips.get(frame) or 1, result.parallel.get(frame, 1))
        inputs = graph.data_inputs(name)
        carried = [r for r in inputs if _carried_by(graph, r, name, frames, frame)]
        if window < 2 or len(carried) != 1 or not _only_carried_on(graph, name):
            continue  # a sum the iteration reads (a cell state's gradient) is the recurrence
        terms = [r for r in inputs if r != carried[0]
                 and not _invariant(graph, r, frames, frame)]
        sizes = tuple(max(n, ELEMENT_FLOOR) for n in map(shapes.nbytes, terms) if n)
        if sizes:
            held[frame] = (held.get(frame, ((), ""))[0] + sizes * (window - 1), name)
    for sizes, name in held.values():
        result.pileup[name] = sizes


def _carried_by(graph: Graph, ref: TensorRef, name: str, frames, frame: str) -> bool:
    """Whether `ref` is the value of a loop variable of `frame` whose next value `name`
    computes (its Merge's NextIteration takes `name`'s output)."""
    merge = through(graph, ref, ("Identity", "Snapshot", "Switch", "RefSwitch"))
    if graph.op(merge.node) not in MERGE or frames.get(merge.node) != frame:
        return False
    for source in graph.data_inputs(merge.node):
        if graph.op(source.node) in NEXT and graph.data_inputs(source.node):
            back = through(graph, graph.data_inputs(source.node)[0], ("Identity", "Snapshot"))
            if back.node == name:
                return True
    return False


def _only_carried_on(graph: Graph, name: str) -> bool:
    """Whether nothing but the next iteration (a NextIteration, through Identity) reads the
    output of `name`: nothing in the loop waits for it."""
    stack, seen = [name], set()
    while stack:
        node = stack.pop()
        for consumer, port in graph.consumers(node):
            if port is None or port == CONTROL or consumer in seen:
                continue
            seen.add(consumer)
            op = graph.op(consumer)
            if op in ("Identity", "Snapshot"):
                stack.append(consumer)
            elif op not in NEXT:
                return False
    return True


def parallel_iterations(graph: Graph, frames: dict[str, str]) -> dict[str, int]:
    """frame -> the iterations TensorFlow's executor may run at once (its Enters'
    `parallel_iterations`; a lowered functional While carries its own attribute onto them)."""
    found: dict[str, int] = {}
    for name, frame in frames.items():
        if frame and graph.op(name) in ENTER:
            attr = graph.node_def(name).attr
            if "parallel_iterations" in attr and attr["parallel_iterations"].i > 0:
                found[frame] = min(found.get(frame, attr["parallel_iterations"].i),
                                   attr["parallel_iterations"].i)
    return found


def body_ends(graph: Graph, names) -> dict[str, list[str]]:
    """NextIteration -> the Exits of its frame among `names`: a loop's values leave it after its
    last iteration, so what follows the loop waits for its whole body (the schedule, which
    runs a body once, would otherwise start it beside the body)."""
    frames = frame_of(graph)
    exits: dict[str, list[str]] = {}
    for name in names:
        if graph.op(name) in EXIT and graph.data_inputs(name):
            exits.setdefault(frames.get(graph.data_inputs(name)[0].node, ""), []).append(name)
    return {name: exits[frames[name]] for name in names
            if graph.op(name) in NEXT and frames.get(name) in exits}


# --- frames and trip counts ------------------------------------------------------------------

def frame_of(graph: Graph) -> dict[str, str]:
    """node -> the name of the innermost v1 while-loop frame it runs in ("" outside loops)."""
    return _frames(graph)[0]


def runs_per_step(graph: Graph, shapes) -> dict[str, int]:
    """node -> how many times it runs in a step: the trip counts of the frames around it
    multiplied (a frame whose count nothing static says counts once)."""
    frames, parent = _frames(graph)
    trips = trip_counts(graph, shapes, frames)
    totals: dict[str, int] = {"": 1}

    def total(frame: str) -> int:
        if frame not in totals:
            totals[frame] = 1  # a frame its own ancestor cannot be, but never loop on one
            totals[frame] = (trips.get(frame) or 1) * total(parent.get(frame, ""))
        return totals[frame]

    return {name: total(frame) for name, frame in frames.items()}


def _frames(graph: Graph) -> tuple[dict[str, str], dict[str, str]]:
    """`frame_of`, and each frame's enclosing frame."""
    frames: dict[str, str] = {}
    parent: dict[str, str] = {}
    for name in graph.topological_order():
        op = graph.op(name)
        inputs = graph.inputs(name)
        outer = next((frames[r.node] for r in inputs if frames.get(r.node)), "")
        if op in ENTER:
            frame = graph.node_def(name).attr["frame_name"].s.decode()
            parent.setdefault(frame, frames.get(inputs[0].node, "") if inputs else "")
            frames[name] = frame
        elif op in EXIT:
            frames[name] = parent.get(outer, "")
        else:
            frames[name] = outer
    return frames, parent


def trip_counts(graph: Graph, shapes, frames: dict[str, str]) -> dict[str, int | None]:
    """frame -> how many times its body runs, None where nothing static says."""
    members: dict[str, list[str]] = {}
    for name, frame in frames.items():
        if frame:
            members.setdefault(frame, []).append(name)
    trips = {}
    for frame, names in members.items():
        bounds = [_bound(graph, shapes, graph.data_inputs(n)[0], frame, frames)
                  for n in names if graph.op(n) == "LoopCond" and graph.data_inputs(n)]
        bounds = [b for b in bounds if b is not None]
        trips[frame] = min(bounds) if bounds else None
    for guess in (False, True):
        for _ in range(len(members)):  # gradient loops: as many as the loop they pop from
            for frame, names in members.items():
                if trips[frame] is None:
                    trips[frame] = next((trips[f] for f in _popped_frames(graph, names, frames)
                                         if trips.get(f) is not None), None)
        for frame, names in members.items():
            if trips[frame] is None and guess is False:
                trips[frame] = _container_size(graph, shapes, names)
    return trips


def _bound(graph: Graph, shapes, ref: TensorRef, frame: str, frames) -> int | None:
    """Iterations a loop condition allows: `counter < constant` (also <=, >, >=, and the
    smaller of a LogicalAnd's two), the counter starting at a constant and stepping by one."""
    ref = through(graph, ref, ("Identity", "Snapshot"))
    op = graph.op(ref.node)
    inputs = graph.data_inputs(ref.node)
    if op == "LogicalAnd":
        found = [b for b in (_bound(graph, shapes, r, frame, frames) for r in inputs)
                 if b is not None]
        return min(found) if found else None
    if op not in ("Less", "LessEqual", "Greater", "GreaterEqual") or len(inputs) != 2:
        return None
    counter, limit = inputs if op.startswith("Less") else inputs[::-1]
    end = constant_value(graph, shapes, limit)
    start_step = _counter(graph, shapes, counter, frame, frames)
    if end is None or start_step is None or np.ndim(end) != 0:
        return None
    start, step = start_step
    count = (int(end) - start + (1 if op.endswith("Equal") else 0)) / step
    return max(0, math.ceil(count))


def _counter(graph: Graph, shapes, ref: TensorRef, frame: str, frames):
    """(start, step) of a loop variable `ref` that starts at a constant and adds a constant."""
    ref = through(graph, ref, ("Identity", "Switch", "RefSwitch", "Snapshot"))
    if graph.op(ref.node) not in MERGE or frames.get(ref.node) != frame:
        return None
    start = step = None
    for source in graph.data_inputs(ref.node):
        if graph.op(source.node) in ENTER:
            start = constant_value(graph, shapes, graph.data_inputs(source.node)[0])
        elif graph.op(source.node) in NEXT:
            update = through(graph, graph.data_inputs(source.node)[0], ("Identity",))
            if graph.op(update.node) in ("Add", "AddV2"):
                values = [constant_value(graph, shapes, r) for r in graph.data_inputs(update.node)]
                step = next((v for v in values if v is not None and np.ndim(v) == 0), None)
    if start is None or step is None or np.ndim(start) != 0 or int(step) <= 0:
        return None
    return int(start), int(step)


def _popped_frames(graph: Graph, names: list[str], frames) -> list[str]:
    """The frames that filled the stacks and lists these nodes pop."""
    found = []
    for name in names:
        if graph.op(name) not in TAKE or not graph.data_inputs(name):
            continue
        source = _source(graph, graph.data_inputs(name)[0])
        for writer in _writers(graph, source):
            if frames.get(writer):
                found.append(frames[writer])
    return found


def _container_size(graph: Graph, shapes, names: list[str]) -> int | None:
    """The constant size of a TensorArray or TensorListReserve the loop reads or writes."""
    for name in names:
        if graph.op(name) not in TAKE and graph.op(name) not in ACCUMULATE:
            continue
        source = _source(graph, graph.data_inputs(name)[0])
        op = graph.op(source.node)
        if op in ("TensorArrayV3", "TensorListReserve"):
            inputs = graph.data_inputs(source.node)
            size = constant_value(graph, shapes, inputs[0 if op == "TensorArrayV3" else 1])
            if size is not None and np.ndim(size) == 0 and int(size) > 0:
                return int(size)
    return None


# --- tracing ---------------------------------------------------------------------------------

def through(graph: Graph, ref: TensorRef, ops) -> TensorRef:
    """`ref` traced back through `ops` (each passing its first input on) and IdentityN (an
    inlined call's results: output k is input k)."""
    seen = set()
    while ref.node not in seen and graph.data_inputs(ref.node):
        seen.add(ref.node)
        op = graph.op(ref.node)
        if op == "IdentityN" and ref.port < len(graph.data_inputs(ref.node)):
            ref = graph.data_inputs(ref.node)[ref.port]
        elif op in ops:
            ref = graph.data_inputs(ref.node)[0]
        else:
            break
    return ref


def _source(graph: Graph, ref: TensorRef) -> TensorRef:
    """Where a handle, list or flow comes from, before the loop plumbing it passes through."""
    ref = through(graph, ref, PASS_THROUGH)
    if graph.op(ref.node) in ACCUMULATE:  # a list written to: the list it was
        return _source(graph, graph.data_inputs(ref.node)[0])
    return ref


def _writers(graph: Graph, source: TensorRef) -> list[str]:
    """Accumulating ops that write into the container `source` makes."""
    def writes(op, port):
        return op in ACCUMULATE and port == 0
    return _walk(graph, source.node, writes,
                 lambda op, port: writes(op, port) or op in PASS_THROUGH)


def _readers(graph: Graph, name: str) -> list[str]:
    """The ops that take out what accumulator `name` put in its container. A TensorArray
    lets go of an element when it is read (`clear_after_read`), else at the step's end. A
    tensor list is a value: its readers are those of what `name` wrote, not of every list
    made by the same empty list (Grappler merges equal `EmptyTensorList`s of two loops)."""
    if graph.op(name).startswith("TensorList"):
        source = TensorRef(name)
    else:  # a stack or TensorArray is a resource: every op on its handle shares it
        source = _source(graph, graph.data_inputs(name)[0])
    take = ("TensorArrayReadV3",) if graph.op(name) == "TensorArrayWriteV3" else TAKE
    return _walk(graph, source.node, lambda op, port: op in take,
                 lambda op, port: (op in PASS_THROUGH or (op in ACCUMULATE and port == 0)
                                   or op == "TensorListPopBack"))


def list_fate(graph: Graph, name: str) -> str:
    """What becomes of the tensor list accumulator `name` writes, past the loop plumbing: READ
    by an op (or it is a stack or TensorArray, a resource of the step, or taken by an op we do
    not know); RETURNED by an inlined call (`inline.py`: its results' IdentityN) and read by
    nothing else: the call runs its body whole, so the list lives until the call returns;
    UNREAD: an accumulator a TF2 loop's gradient turned out not to need, which TensorFlow does
    not run (a Keras LSTM in a TF1 graph: 13 of its 22 pushes per step ran, the 9 whose lists
    nothing reads did not)."""
    if not graph.op(name).startswith("TensorList"):
        return READ
    fate, seen, stack = UNREAD, set(), [TensorRef(name)]
    while stack:
        for consumer, port in graph.consumers(stack.pop()):
            if port is None or port == CONTROL or (consumer, port) in seen:
                continue
            seen.add((consumer, port))
            op = graph.op(consumer)
            if op == "IdentityN":  # output k is input k
                fate = RETURNED
                stack.append(TensorRef(consumer, port))
            elif op in PASS_THROUGH or (op in ACCUMULATE and port == 0):
                stack.extend(TensorRef(consumer, k) for k in (0, 1))  # a Switch's two
            else:
                return READ
    return fate


def _walk(graph: Graph, start: str, take, follow) -> list[str]:
    """The data consumers reachable from `start` through those `follow(op, port)` holds for;
    those `take(op, port)` holds for, in the order found."""
    found, seen, stack = [], set(), [start]
    while stack:
        node = stack.pop()
        for consumer, port in graph.consumers(node):
            if consumer in seen or port is None or port == CONTROL:
                continue
            seen.add(consumer)
            op = graph.op(consumer)
            if take(op, port):
                found.append(consumer)
            if follow(op, port):
                stack.append(consumer)
    return found


def _unchanged(graph: Graph, ref: TensorRef) -> TensorRef:
    """`ref` before the loop when it is a loop variable every iteration passes on unchanged (a
    lowered TF2 loop's captured tensors and constants are such variables), else `ref`."""
    ref = through(graph, ref, ("Identity", "Snapshot", "Switch", "RefSwitch"))
    if graph.op(ref.node) not in MERGE:
        return ref
    start = None
    for source in graph.data_inputs(ref.node):
        if graph.op(source.node) in NEXT:
            back = through(graph, graph.data_inputs(source.node)[0],
                            ("Identity", "Snapshot", "Switch", "RefSwitch"))
            if back.node != ref.node:
                return ref
        else:
            start = source
    return start if start is not None else ref


def _kept_value(graph: Graph, element: TensorRef) -> TensorRef:
    """The tensor whose buffers an accumulator keeps: a loop variable's value is the one the
    previous iteration computed (so a cell state pushed for the gradient and also written to
    the output shares every buffer but the first with that write)."""
    ref = through(graph, element, ("Identity", "Snapshot", "Switch", "RefSwitch"))
    if graph.op(ref.node) in MERGE:
        for source in graph.data_inputs(ref.node):
            if graph.op(source.node) in NEXT:
                return through(graph, graph.data_inputs(source.node)[0], ("Identity", "Snapshot"))
    return ref


def _invariant(graph: Graph, element: TensorRef, frames, frame: str) -> bool:
    """Whether the pushed element is the same buffer every iteration (a constant, a value
    entered from outside the loop, or a read of a variable whose handle is: the read aliases
    the variable's buffer)."""
    ref = _unchanged(graph, through(graph, element, ("Identity", "Snapshot")))
    node = graph.node_def(ref.node)
    if node.op in ("Const", "HostConst") or frames.get(ref.node, "") != frame:
        return True
    if node.op == "ReadVariableOp" and graph.data_inputs(ref.node):
        return _invariant(graph, graph.data_inputs(ref.node)[0], frames, frame)
    return node.op in ENTER  # entered once: a constant Enter, or an unchanged loop variable


FOLDED = {"Minimum": np.minimum, "Maximum": np.maximum, "Add": np.add, "AddV2": np.add,
          "Sub": np.subtract, "Mul": np.multiply}


def constant_value(graph: Graph, shapes, ref: TensorRef, depth: int = 8):
    """The value of a tensor computable from constants and static shapes, else None."""
    from tensorflow.python.framework import tensor_util

    ref = through(graph, ref, ("Identity", "Enter", "RefEnter", "Snapshot", "StopGradient"))
    if graph.op(ref.node) in MERGE + ("Switch", "RefSwitch"):
        ref = _unchanged(graph, ref)
        if graph.op(ref.node) in MERGE or depth <= 0:
            return None
        return constant_value(graph, shapes, ref, depth - 1)
    node = graph.node_def(ref.node)
    op, inputs = node.op, graph.data_inputs(ref.node)
    try:
        if op in ("Const", "HostConst"):
            return tensor_util.MakeNdarray(node.attr["value"].tensor)
        if op in ("Shape", "Size") and inputs:
            info = shapes[inputs[0]]
            if info is None or info.shape is None or None in info.shape:
                return None
            return np.array(info.shape if op == "Shape" else math.prod(info.shape))
        if op not in FOLDED and op not in ("Cast", "StridedSlice") or depth <= 0:
            return None
        values = [constant_value(graph, shapes, r, depth - 1) for r in inputs]
        if any(v is None for v in values):
            return None
        if op == "Cast":
            return values[0]
        if op in FOLDED:
            return FOLDED[op](values[0], values[1])
        if op == "StridedSlice" and np.ndim(values[0]) == 1:
            return _strided_slice(node, *values)
    except (ValueError, TypeError, IndexError):
        return None
    return None


def _strided_slice(node, value, begin, end, strides):
    """A 1-D StridedSlice (Keras reads a sequence length as `shape(x)[0]`)."""
    attr = node.attr
    if attr["ellipsis_mask"].i or attr["new_axis_mask"].i or len(begin) != 1:
        return None
    start = None if attr["begin_mask"].i & 1 else int(begin[0])
    stop = None if attr["end_mask"].i & 1 else int(end[0])
    if attr["shrink_axis_mask"].i & 1:
        return value[int(begin[0])]
    return value[start:stop:int(strides[0])]
