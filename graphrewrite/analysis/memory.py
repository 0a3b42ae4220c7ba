"""Static memory model of one training step: schedule, liveness, peak per device.

The schedule imitates TensorFlow's executor: only nodes the fetches need run; a node becomes ready
when all its inputs (data and control) are done, and ready nodes run first-come first-served
(breadth-first), starting from the sources in file order. Loop back edges are ignored, so a loop
body counts once; what a loop keeps from every iteration for its gradient counts times its trip
count (`loops.py`).

Each output tensor gets a buffer when its node runs and loses it after its last consumer ran:

- outputs of ops that alias an input (Identity, Reshape, Squeeze, ExpandDims, ...) share that
  input's buffer and allocate nothing;
- element-wise ops reuse the buffer of an input of the same size whose last use they are, as
  TensorFlow's `forward_input_or_allocate_output` does;
- constants and variables live for the whole step (their kernels hold them; a TF2 step's
  captured-variable placeholders count their variable's value); fed inputs live throughout
  (in host memory as a session on a CPU runs the step: `executor`); fetched outputs live to
  the end;
- tensors of unknown size count 0 bytes and are listed in `unknown`.

A node's inputs and outputs are live together while it runs; the peak is taken at that moment.
Nodes pinned to `/device:CPU:0` are host memory when the compute device is something else (see
`cpu_is_host`).
A kernel's scratch (`scratch.py`: on the CPU the convolution gradients' column buffers, on a
GPU cuDNN's workspace, an unmeasured estimate) is held while it runs: the allocator's peak
counts it, the liveness peak does not (it is the same whatever is recomputed). A convolution's
two gradients, run at once, hold their scratch at once (`scratch.alongside`).

Two peaks come out: the liveness peak (the bytes of the live tensors, what the planner
minimises) and the allocator's (`allocated_peak`): the same allocations and frees replayed for
two steps through a model of TensorFlow's BFC allocator (`bfc.py`), whose `bytes_in_use` counts
rounded, sometimes oversized chunks. The second is what TensorFlow measures.

Only the allocator's replay sees variables change buffers during a step (`Move`): a read of a
resource variable shares its buffer, and an update that finds such a read still alive copies the
variable first (TensorFlow's copy-on-write, `PrepareToUpdateVariable`, in AssignAdd/Sub and the
fused `ResourceApply*` kernels), while `AssignVariableOp` makes the variable share the value's
buffer. A TF2 step, whose updates run as soon as their gradients are ready, moves its variables
into the middle of the activations' chunks that way, so the next step finds its free memory cut
into pieces that serve requests oversized (TF1 gradients wait for every gradient of an op, so
its updates rarely find a live read). A variable a sparse op touches (an embedding's gather, a
sparse optimizer's scatter) stays in copy-on-read mode (`EnsureSparseVariableAccess`): each read
of it is a copy, and each dense write copies it first, the old buffer freed as the write ends
(measured: the Adam moment of an embedding of 8000 x 256 took 12 MiB as `m * beta1` was
assigned to it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

from tensorflow.core.framework import types_pb2

from ..core import dtypes
from ..core.graph import LOOP_BACK_OPS, Graph
from ..core.tensor_ref import TensorRef
from . import bfc, flops, loops, parameters, row_views, scratch, split
from .schedule import bypassed_identities, schedule
from .shapes import Shapes, TensorInfo

__all__ = ["DEVICE", "HOST", "ALIAS_OPS", "FORWARDING_OPS", "FORWARDED_INPUT", "PERSISTENT_OPS",
           "SAVER_OPS", "FEED_OPS", "ACCELERATOR_MARKERS", "HOST_OUTPUT_OPS", "HOST_BANDWIDTH",
           "STATE", "FEED", "STEP", "UPDATE_OPS", "UPDATE_PREFIX", "ADOPT_OPS", "Buffer", "Move",
           "MemoryReport", "replay", "placement", "cpu_is_host", "simulate", "REUSING_OPS",
           "CPU_WORKERS", "CPU_FLOPS", "CPU_OP_FLOPS", "CPU_BANDWIDTH", "CPU_KERNEL_SECONDS",
           "cpu_seconds"]

DEVICE, HOST = "device", "host"

# Output i is (a view of) input i: no allocation.
ALIAS_OPS = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "PreventGradient", "Snapshot", "EnsureShape", "CheckNumerics", "Enter", "RefEnter", "Exit",
    "RefExit", "NextIteration", "RefNextIteration", "Switch", "RefSwitch", "Merge", "RefMerge",
    "ReadVariableOp", "_Retval", "_Arg", "PlaceholderWithDefault",
    # A reference variable's writes: their output is the variable, written in place (TF1's
    # `ApplyMomentum` counted as a new buffer of the variable's size: +1 MiB at the update)
    "Assign", "AssignAdd", "AssignSub", "ScatterUpdate", "ScatterAdd", "ScatterSub",
    "ApplyGradientDescent", "ApplyMomentum", "ApplyAdam", "ApplyRMSProp", "ApplyCenteredRMSProp",
    "ApplyAdagrad", "ApplyAdagradV2", "ApplyAdadelta", "ApplyFtrl", "ApplyFtrlV2",
    "ApplyProximalAdagrad", "ApplyProximalGradientDescent", "ApplyAdaMax", "ApplyPowerSign",
    "ApplyAddSign", "SparseApplyMomentum", "SparseApplyAdagrad", "SparseApplyFtrl",
    "SparseApplyRMSProp", "SparseApplyAdadelta", "SparseApplyProximalAdagrad",
})
# Element-wise kernels that write into an input's buffer when it dies with them.
FORWARDING_OPS = frozenset({
    "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Neg", "Exp", "Log", "Log1p",
    "Sqrt", "Rsqrt", "Square", "Abs", "Reciprocal", "Inv", "Erf", "Softplus", "Sign", "Floor",
    "Ceil", "Round", "Cos", "Sin",
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "FloorDiv", "FloorMod", "MulNoNan",
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "TanhGrad", "SigmoidGrad",
    "RsqrtGrad", "SqrtGrad", "ReciprocalGrad", "InvGrad", "SoftplusGrad",
    "BiasAdd", "AddN", "Select", "SelectV2", "ZerosLike", "OnesLike",
})
# Kernels that write one output into an input's buffer when that input dies with them:
# op -> {output port: input index} (the cross-entropy kernels write the logits' gradient over
# the logits, `forward_input_or_allocate_output({0}, 1, ...)`).
FORWARDED_INPUT = {
    "SparseSoftmaxCrossEntropyWithLogits": {1: 0},
    "SoftmaxCrossEntropyWithLogits": {1: 0},
}
# The ops whose outputs may live in an input's buffer (`_output_buffer`).
REUSING_OPS = ALIAS_OPS | FORWARDING_OPS | frozenset(FORWARDED_INPUT)
PERSISTENT_OPS = frozenset({"Const", "HostConst", "VariableV2", "Variable", "VarHandleOp"})
FEED_OPS = frozenset({"Placeholder", "PlaceholderV2"})
ACCELERATOR_MARKERS = ("GPU", "TPU", "gpu", "tpu", "XLA_")
HOST_OUTPUT_OPS = frozenset({"_CopyFromGpuToHost"})
# The CPU executor's inter-op threads, one per core: those of the 2-core machine every CPU
# figure was measured on (a CPU with more cores runs more chains at once: not modelled).
CPU_WORKERS = 2
# How long a CPU kernel takes, for the order those threads run a step in: the longer of its
# arithmetic and its memory traffic, plus a launch. Measured on that machine (Eigen, oneDNN off:
# a 4096x1024x1024 MatMul and a 3x3 convolution 190-235 GFLOP/s, an Add of 16 MiB 8.6 GB/s).
CPU_FLOPS, CPU_BANDWIDTH, CPU_KERNEL_SECONDS = 200e9, 8.6e9, 5e-6
# Eigen's convolution gradients are slower than its products: against the same convolution
# forward (3x3, batch 8-32, 12x12 to 56x56, 32-128 channels) the weights' gradient ran at
# 0.34-0.78 of its rate (median 0.48; 0.3 in a traced Keras CNN step), the input's at
# 0.41-0.89 (median 0.73; 0.5-0.77 traced). `fixtures/cpu_rates.py` measures both.
CPU_OP_FLOPS = {"Conv2DBackpropFilter": 0.45 * CPU_FLOPS, "Conv2DBackpropInput": 0.65 * CPU_FLOPS}
HOST_BANDWIDTH = 16e9  # bytes/s each way between host and device (Grappler's PCIe assumption)
# What a buffer lives for: the whole session (constants, variables), one step (feeds, made
# before it starts), or part of a step.
STATE, FEED, STEP = "state", "feed", "step"
# Variable writes that update in place, copying the variable first while a read of it is alive
# (every resource input of a fused `ResourceApply*` kernel is such a write).
UPDATE_OPS = frozenset({"AssignAddVariableOp", "AssignSubVariableOp"})
SUMMING_OPS = frozenset({"AddN", "AccumulateNV2"})  # sums of many terms (`_operand_bytes`)
UPDATE_PREFIX = "ResourceApply"
ADOPT_OPS = frozenset({"AssignVariableOp"})  # the variable takes the value's buffer
# Ops that put the variable of their first input (every resource input: `ResourceSparseApply*`)
# in copy-on-read mode.
SPARSE_ACCESS_PREFIXES = ("ResourceGather", "ResourceScatter", "ResourceSparseApply")
MAX_HANDLE_HOPS = 16  # Identity-like ops between a variable and a read of it


@dataclass(eq=False)
class Buffer:
    """One allocation; several tensors share it when ops alias or write in place."""

    size: int
    place: str
    owner: TensorRef            # the tensor that allocated it
    start: int = 0              # step that allocated it
    end: int | None = None      # step after which it was freed (None: live to the end)
    uses_left: int = 0
    pinned: bool = False        # persistent, fed or fetched: never freed during the step
    lifetime: str = STEP
    pieces: int = 1             # allocations of size / pieces each (a loop's kept elements)


@dataclass(eq=False)
class Move:
    """A variable changes buffers at `step`: it takes `new` (the buffer of the value an
    `AssignVariableOp` gave it) or, with `new` None, a copy of itself an update made while a read
    was alive; its old buffer is freed at `free_at`, when the last read of it is done."""

    step: int
    variable: Buffer
    new: Buffer | None
    free_at: int


@dataclass
class MemoryReport:
    """Result of simulating one step."""

    order: list[str]
    peak_bytes: dict[str, int]                      # place -> peak
    peak_node: dict[str, str]                       # place -> node running at the peak
    live_at_peak: dict[str, list[tuple[TensorRef, int]]]  # place -> (owner tensor, bytes)
    persistent_bytes: dict[str, int]
    buffers: list[Buffer]
    buffer_of: dict[TensorRef, Buffer]              # tensor -> the buffer holding it
    transfer_bytes: int                             # copied between host and device per step
    unknown: list[TensorRef] = field(default_factory=list)
    accelerator: bool = False  # the device is a GPU-like one (its allocator has one region)
    # step -> kernel scratch bytes, or the allocations' bytes when kernels run at once
    scratch: dict[int, int | tuple[int, ...]] = field(default_factory=dict)
    timeline: list[int] = field(default_factory=list)  # device bytes of live tensors per step
    # step -> bytes more a loop's lagging sum can hold while its iterations run ahead of it
    # (`loops._lagging_sums`): counted only by `allocated_peak_bound`
    pileup: dict[int, tuple[int, ...]] = field(default_factory=dict)  # step -> allocations
    # () -> (step, bytes): the kernel whose operands (inputs and outputs, the variables'
    # values aside) and own scratch are the most on the device, and those bytes (`floor`),
    # worked out when first asked: the planners simulate many steps and never ask
    _widest_of: Callable[[], tuple[int, int]] | None = field(default=None, repr=False)
    _widest: tuple[int, int] | None = field(default=None, repr=False)
    _writes: _Writes | None = field(default=None, repr=False)  # what `moves` comes from
    _moves: list[Move] | None = field(default=None, repr=False)
    _allocated: dict = field(default_factory=dict, repr=False)

    @property
    def moves(self) -> list[Move]:
        """The variables changing buffers during the step, which only the allocator's replay
        sees; worked out on first use (most simulations only want the liveness peak)."""
        if self._moves is None:
            self._moves = self._writes.moves(self.order) if self._writes is not None else []
            self._writes = None
        return self._moves

    def peak(self, place: str = DEVICE) -> int:
        """The liveness peak: the most bytes of live tensors at once."""
        return self.peak_bytes.get(place, 0)

    def allocated_peak(self, place: str = DEVICE) -> int:
        """The BFC allocator's `bytes_in_use` peak in the second of two steps (the first one
        grows its regions), as TensorFlow reports it."""
        if place not in self._allocated:
            self._allocated[place] = self._replay(place)
        return self._allocated[place]

    def allocated_peak_bound(self, place: str = DEVICE) -> int:
        """`allocated_peak` with every loop's lagging sums holding as many terms as its
        `parallel_iterations` let the executor compute ahead (`loops._lagging_sums`): what a
        step can reach when the iterations race ahead; the allocator peak when no loop can."""
        if place != DEVICE or not self.pileup:
            return self.allocated_peak(place)
        held: dict = dict(self.scratch)
        for step, sizes in self.pileup.items():
            held[step] = _allocations(held.get(step, 0)) + sizes
        return replay([b for b in self.buffers if b.place == place],
                      bfc.Allocator(growth=not self.accelerator), held, moves=self.moves)

    def allocated_timeline(self, place: str = DEVICE) -> list[int]:
        """The allocator's `bytes_in_use` at each step of the schedule (its most during the
        step), in the second of two steps, as `allocated_peak` replays it."""
        per_step: dict[int, int] = {}
        self._allocated[place] = self._replay(place, per_step)
        timeline, in_use = [], per_step.get(-1, 0)
        for step in range(len(self.order)):
            in_use = per_step.get(step, in_use)  # a step that allocates nothing holds as before
            timeline.append(in_use)
        return timeline

    def allocated_peak_at(self) -> tuple[str, int] | None:
        """Where the allocator's peak on the device falls: (node, the kernel scratch it holds
        while it runs); None for an empty schedule."""
        timeline = self.allocated_timeline()
        if not timeline:
            return None
        step = max(range(len(timeline)), key=timeline.__getitem__)
        return self.order[step], sum(_allocations(self.scratch.get(step, 0)))

    @property
    def widest(self) -> tuple[int, int]:
        """(step, bytes) of `_widest_of`, once; (-1, 0) without it."""
        if self._widest is None:
            self._widest = self._widest_of() if self._widest_of is not None else (-1, 0)
        return self._widest

    def floor(self) -> tuple[int, str | None]:
        """(bytes, node): what no lossless rewrite of this step (recomputation, swapping,
        running sums) goes below, in bytes live at once: the constants and variables on the
        device, and the fed inputs, beside the kernel whose operands and own scratch are the
        most (every kernel runs with its inputs and outputs on the device; a copy of it has
        the same; a sum's terms count two, as a running sum holds them). Without the
        variables' updates' copies and the allocator's rounding: a bound, not a forecast."""
        step, operands = self.widest
        return (self.persistent_bytes.get(DEVICE, 0) + operands,
                self.order[step] if step >= 0 else None)

    def _replay(self, place: str, timeline: dict[int, int] | None = None) -> int:
        """`replay` of this step's buffers at `place` through the allocator that place has: a
        CPU's or a host's grows regions, an accelerator's holds one."""
        return replay([b for b in self.buffers if b.place == place],
                      bfc.Allocator(growth=place == HOST or not self.accelerator),
                      self.scratch if place == DEVICE else {}, timeline=timeline,
                      moves=self.moves)


def _allocations(scratch: int | tuple[int, ...]) -> tuple[int, ...]:
    return scratch if isinstance(scratch, tuple) else (scratch,)


def replay(buffers: list[Buffer], allocator: bfc.Allocator,
           scratch: dict[int, int | tuple[int, ...]], steps: int = 2,
           timeline: dict[int, int] | None = None, moves: list[Move] = ()) -> int:
    """Allocate and free `buffers` (in the order `simulate` made them) through `allocator`:
    the state once, then `steps` steps, each with its feeds first and every output it still
    holds (fetched) freed at its end; a step's kernel scratch (its bytes, or the bytes of
    several allocations: `allocated_peak_bound`) comes after its outputs and goes before its
    inputs; a variable's `moves` after both, its old buffer freed with the inputs
    (an adopted buffer stays the variable's). The peak of the last step; `timeline` (schedule
    step -> the most bytes in use during it; -1: before the first) is filled in for the last
    step when given."""
    position = {id(b): i for i, b in enumerate(buffers)}
    moves = [m for m in moves if id(m.variable) in position
             and (m.new is None or id(m.new) in position)]
    adopted = {position[id(m.new)] for m in moves if m.new is not None}
    held = {i: allocator.allocate(b.size) for i, b in enumerate(buffers) if b.lifetime == STATE}
    feeds = [b for b in buffers if b.lifetime == FEED]
    events = sorted([(b.start, 0, i) for i, b in enumerate(buffers) if b.lifetime == STEP]
                    + [(step, 1, size) for step, size in scratch.items()]
                    + [(m.step, 2, k) for k, m in enumerate(moves)]
                    + [(m.free_at, 3, k) for k, m in enumerate(moves)]
                    + [(b.end, 4, i) for i, b in enumerate(buffers)
                       if b.lifetime == STEP and b.end is not None and i not in adopted])
    for round_ in range(steps):
        allocator.peak = allocator.in_use
        fed = [allocator.allocate(b.size) for b in feeds]
        chunks, displaced = {}, {}
        record = timeline if round_ == steps - 1 else None
        if record is not None:
            record[-1] = allocator.in_use  # state and feeds, before the first node runs
        for step, kind, index in events:
            if kind == 0:
                buffer = buffers[index]
                chunks[index] = [allocator.allocate(buffer.size // buffer.pieces)
                                 for _ in range(buffer.pieces)]
            elif kind == 1:  # index: the scratch's bytes, or a tuple of allocations' bytes
                scratch_chunks = [allocator.allocate(size) for size in
                                  _allocations(index) if size]
            elif kind == 2:
                move, variable = moves[index], position[id(moves[index].variable)]
                displaced[index] = held[variable]
                held[variable] = (allocator.allocate(move.variable.size) if move.new is None
                                  else chunks.pop(position[id(move.new)])[0])
            if record is not None:
                record[step] = max(record.get(step, 0), allocator.in_use)
            if kind == 1:
                for chunk in scratch_chunks:
                    allocator.free(chunk)
            elif kind == 3:
                allocator.free(displaced.pop(index))
            elif kind == 4:
                for chunk in chunks.pop(index):
                    allocator.free(chunk)
        for chunk in [c for pieces in chunks.values() for c in pieces] + fed:
            allocator.free(chunk)
    return allocator.peak


def placement(node, cpu_is_host: bool) -> str:
    """Where a node's (NodeDef's) outputs live: HOST for CPU-pinned nodes when the compute
    device is something else, and for Grappler's swap-out copy (its output is host memory);
    else DEVICE."""
    if node.op in HOST_OUTPUT_OPS or (cpu_is_host and "CPU" in node.device.upper()):
        return HOST
    return DEVICE


def cpu_is_host(graph: Graph) -> bool:
    """Whether CPU-pinned nodes are host memory: the graph uses an accelerator, or most nodes are
    unplaced (they land on the accelerator of a GPU machine, and a node pinned to the CPU, such
    as a swapped-out copy, lives in host memory there)."""
    devices = graph.devices()
    if any(m in d for d in devices for m in ACCELERATOR_MARKERS):
        return True
    pinned_cpu = 0
    if any("CPU" in d.upper() for d in devices):  # not a Saver's: pinned on any machine
        pinned_cpu = sum("CPU" in graph.node_def(n).device.upper()
                         and not _saver_node(graph, n) for n in graph.nodes())
    return 0 < pinned_cpu < sum(devices.values()) - pinned_cpu


SAVER_OPS = frozenset({"SaveV2", "RestoreV2", "MergeV2Checkpoints", "ShardedFilename",
                       "StringJoin", "SaveSlices", "RestoreSlice"})


def _saver_node(graph: Graph, name: str) -> bool:
    """A checkpoint op, or a string constant (its tensor names): pinned to the CPU wherever the
    graph was built (a TF1 Inception MetaGraphDef built on a CPU was modelled as a GPU's step,
    for its `save/RestoreV2`)."""
    node = graph.node_def(name)
    return node.op in SAVER_OPS or (node.op == "Const" and
                                    node.attr["dtype"].type == types_pb2.DT_STRING)


def cpu_seconds(graph: Graph, shapes: Shapes, name: str) -> float:
    """A node's modelled time on the CPU (`CPU_FLOPS`, `CPU_BANDWIDTH`)."""
    rate = CPU_OP_FLOPS.get(graph.op(name), CPU_FLOPS)
    return CPU_KERNEL_SECONDS + max(flops.node_flops(graph, shapes, name) / rate,
                                    flops.node_traffic(graph, shapes, name) / CPU_BANDWIDTH)


def simulate(graph: Graph, shapes: Shapes, fetches: list[str] | None = None,
             device: str | None = None, executor: bool = False) -> MemoryReport:
    """Simulate one step that fetches `fetches` (default: the sinks) and report the peaks.
    `device` ("cpu", "gpu"; default: "gpu" when a node is placed on one) picks the kernel
    scratch (`scratch.KERNEL_SCRATCH`) and the allocator; unplaced graphs with some nodes pinned
    to the CPU (swap copies) are modelled on a GPU, the device with memory of its own they are
    made for. `executor`: in the order TensorFlow's executor runs the step on that device
    (`CPU_WORKERS` threads on a CPU), not first come first served (the order the passes plan
    on)."""
    if fetches is None:
        fetches = [n for n in graph.nodes() if graph.nx.out_degree(n) == 0]
    fetched = set(fetches)
    host_split = cpu_is_host(graph)
    kind = device or ("gpu" if host_split else "cpu")
    bypassed = bypassed_identities(graph, graph.nodes(), fetches)
    times: dict[str, tuple[float, float]] = {}  # the CPU executor's modelled (start, end)
    order = schedule(graph, fetches, bypassed,
                     workers=CPU_WORKERS if executor and kind == "cpu" else 1,
                     seconds=lambda name: cpu_seconds(graph, shapes, name), times=times)
    untaken, unmade = split.untaken(graph)
    if untaken:  # the side of a v1 cond its known predicate never takes: never run (but a
        # constant's kernel holds its value from the session's first step, taken or not)
        order = [n for n in order if n not in untaken or graph.op(n) in PERSISTENT_OPS]
    op_of = graph.ops(order)
    # `placement` of each node; a node's device is only read when CPU-pinned nodes are host
    place_of = {name: placement(graph.node_def(name), host_split) if host_split else
                HOST if op in HOST_OUTPUT_OPS else DEVICE for name, op in op_of.items()}
    buffers: list[Buffer] = []
    buffer_of: dict[TensorRef, Buffer] = {}
    in_use: dict[str, int] = {}
    peak: dict[str, tuple[int, int]] = {}  # place -> (bytes, step)
    unknown: list[TensorRef] = []
    maybe_variable = parameters.VARIABLE_OPS | FEED_OPS
    variable_sizes = {n: _nbytes(parameters.value_info(graph, shapes, n)) for n in order
                      if op_of[n] in maybe_variable and parameters.is_variable(graph, n)}

    copied_on_read = _copied_on_read(graph, order, op_of, variable_sizes)
    copying_reads = {name for name in order if op_of[name] == "ReadVariableOp" and _variable_of(
        graph, graph.data_inputs(name)[0], variable_sizes) in copied_on_read} \
        if copied_on_read else set()
    viewed = {name: index for name in order if op_of[name] in row_views.ROW_VIEW_OPS
              and (index := row_views.viewed_input(graph, shapes, name)) is not None}
    kernel_scratch = scratch.KERNEL_SCRATCH.get(kind, {})  # the ops that take any
    transfers: set[tuple[TensorRef, str]] = set()  # (tensor, place it was copied to)
    scratch_at: dict[int, int] = {}
    pileup_at: dict[int, int] = {}
    timeline: list[int] = []
    # A Merge's back edge is not a read: the body counts once. What loops keep from every
    # iteration is held by the nodes that take it out (`loops.py`).
    loops_back = {name for name, op in op_of.items() if op in LOOP_BACK_OPS}
    reads = {name: [bypassed[r.node][r.port] if r.node in bypassed else r
                    for r in graph.data_inputs(name) if r.node not in loops_back]
             for name in order} if bypassed or loops_back else \
        graph.data_inputs_of(order)  # most graphs: the inputs as they are (shared: not changed)
    looped = loops.analyse(graph, shapes, order)
    for name, held in looped.held_by.items():
        reads[name] = reads[name] + held
    outputs = shapes.outputs_of(order)
    for ref in unmade:  # a Merge after it reads the side taken
        if ref.node in outputs:
            outputs[ref.node] = [r for r in outputs[ref.node] if r != ref]
    for identity in bypassed:  # its readers hold its inputs' buffers, it holds none
        reads[identity], outputs[identity] = [], []
    uses = Counter(chain.from_iterable(reads.values()))  # `reads` is in `order`

    def add_output(ref: TensorRef, buffer: Buffer) -> None:
        buffer.uses_left += uses[ref]
        buffer_of[ref] = buffer

    def allocate(ref: TensorRef, place: str, step: int, pinned: bool,
                 lifetime: str = STEP) -> Buffer:
        size = looped.sizes[ref] if ref in looped.sizes else shapes.nbytes(ref)
        if ref.node in variable_sizes:  # its value, not its handle
            size = variable_sizes[ref.node]
        if size is None:
            unknown.append(ref)
            size = 0
        buffer = Buffer(size, place, ref, start=step, pinned=pinned, lifetime=lifetime,
                        pieces=looped.pieces.get(ref, 1))
        buffers.append(buffer)
        in_use[place] = in_use.get(place, 0) + size
        return buffer

    def release(buffer: Buffer, step: int) -> None:
        if not buffer.pinned and buffer.end is None:
            buffer.end = step
            in_use[buffer.place] -= buffer.size

    # Constants, variables and fed inputs exist before the step starts. As a session runs
    # the step on a CPU, it holds what it is fed in an allocator of its own, not the step's
    # (a GCN's fed features were an eighth of its modelled peak): host memory.
    session_held = executor and kind == "cpu"
    preexisting = PERSISTENT_OPS | FEED_OPS
    for name in order:
        if op_of[name] in preexisting:
            fed = op_of[name] in FEED_OPS and name not in variable_sizes
            place = HOST if fed and session_held else place_of[name]
            for ref in outputs[name]:
                add_output(ref, allocate(ref, place, 0, pinned=True,
                                         lifetime=FEED if fed else STATE))
    persistent = {}
    for buffer in buffers:
        if op_of[buffer.owner.node] in PERSISTENT_OPS or buffer.owner.node in variable_sizes:
            persistent[buffer.place] = persistent.get(buffer.place, 0) + buffer.size

    overlap, pileup = looped.overlap, looped.pileup
    own_scratch = {name: scratch.kernel_bytes(kind, graph, shapes, name)
                   for name, op in op_of.items() if op in kernel_scratch}
    held_alongside = scratch.alongside(graph, order, own_scratch, times or None)
    for step, name in enumerate(order):
        op = op_of[name]
        place = place_of[name]
        inputs = [r for r in reads[name] if r in buffer_of]
        for ref in inputs:
            held = buffer_of[ref]
            if held.place != place and not (session_held and held.lifetime == FEED):
                transfers.add((ref, place))  # (the same memory: nothing moves on a CPU)
        made = outputs[name]
        if op not in preexisting:
            reused = op in REUSING_OPS and name not in copying_reads  # else new buffers
            for ref in made:
                if name in viewed:  # rows of its input (`row_views`)
                    buffer = buffer_of.get(reads[name][viewed[name]])
                else:
                    buffer = _output_buffer(op, ref, inputs, buffer_of, shapes) if reused \
                        else None
                if buffer is not None and buffer.place != place:
                    buffer = None  # another device: TensorFlow copies, nothing is shared
                if buffer is None:
                    buffer = allocate(ref, place, step, pinned=False)
                buffer.pinned |= name in fetched
                add_output(ref, buffer)
        extra = own_scratch.get(name, 0) + (overlap.get(name, 0) if overlap else 0)
        if name in held_alongside:
            scratch_at[step] = (extra,) + held_alongside[name]
        elif extra:
            scratch_at[step] = extra
        if pileup and pileup.get(name) and place == DEVICE:
            pileup_at[step] = pileup[name]
        timeline.append(in_use.get(DEVICE, 0))
        for where, value in in_use.items():
            if value > peak.get(where, (-1, 0))[0]:
                peak[where] = (value, step)
        for ref in inputs:
            buffer = buffer_of[ref]
            buffer.uses_left -= 1
            if buffer.uses_left <= 0:
                release(buffer, step)
        for ref in made:
            buffer = buffer_of.get(ref)
            if buffer is not None and buffer.uses_left <= 0:
                release(buffer, step)

    live_at_peak = {
        where: sorted(((b.owner, b.size) for b in buffers
                       if b.place == where and b.start <= at and (b.end is None or b.end >= at)),
                      key=lambda item: (-item[1], item[0]))
        for where, (_, at) in peak.items()}

    def widest() -> tuple[int, int]:
        """(step, bytes): the kernel whose operands and scratch are the most, and the fed
        inputs beside it (the caller holds them the whole step: a deep MLP's batch)."""
        found = (0, 1)  # (bytes, -step): the first of the widest kernels
        fed = {id(b) for b in buffers if b.lifetime == FEED and b.place == DEVICE}
        for step, name in enumerate(order):
            if place_of[name] == DEVICE and op_of[name] not in preexisting:  # (a feed: counted)
                inputs = [r for r in reads[name] if r in buffer_of
                          and id(buffer_of[r]) not in fed]
                found = max(found, (_operand_bytes(op_of[name], inputs, outputs[name],
                                                   buffer_of, looped, name)
                                    + own_scratch.get(name, 0), -step))
        return -found[1], found[0] + sum(b.size for b in buffers if id(b) in fed)

    return MemoryReport(order, {w: v for w, (v, _) in peak.items()},
                        {w: order[at] for w, (_, at) in peak.items()}, live_at_peak, persistent,
                        buffers, buffer_of, sum(shapes.nbytes(r) or 0 for r, _ in transfers),
                        sorted(set(unknown)), host_split if device is None else device == "gpu",
                        scratch_at, timeline, pileup_at, widest,
                        _writes=_Writes({id(b) for b in buffers if b.owner.node in variable_sizes},
                                {id(b) for b in buffers if b.owner.node in copied_on_read},
                                graph, order, op_of, reads, outputs, buffer_of, shapes))


class _Writes:
    """The variables' reads and writes in the simulated step, turned into `Move`s when first
    asked (`moves`): the planners simulate many steps and never ask.

    An update copies its variable when a read of it is still to be consumed: one the schedule
    runs later, or one it does not wait for (not its ancestor). The executor runs that one on
    another thread while the update's short chain catches up, so the copy is made while it
    runs and its old buffer goes when it is done."""

    def __init__(self, variables: set[int], copied_on_read: set[int], graph: Graph,
                 order: list[str], op_of, reads, outputs, buffer_of: dict[TensorRef, Buffer],
                 shapes: Shapes):
        self.variables = variables  # ids of the variables' buffers
        self.copied_on_read = copied_on_read  # those of them every dense write copies
        self.step = (order, op_of, reads, outputs, buffer_of, shapes)  # as `simulate` left it
        # The edges `moves` walks, kept now: the graph may change before it is asked.
        pred = graph.pred
        self.parents = {name: tuple(pred[name]) for name in order} if variables else {}
        self.view_of: dict[TensorRef, TensorRef] = {}  # tensor -> the read it is a view of
        self.readers: dict[TensorRef, list[tuple[int, str]]] = {}  # read -> (step, reader)
        self.events: dict[int, tuple[Buffer, list]] = {}  # variable -> (buffer, events)

    def _event(self, buffer: Buffer | None, event: tuple) -> None:
        if buffer is not None and id(buffer) in self.variables:
            self.events.setdefault(id(buffer), (buffer, []))[1].append(event)

    def saw(self, step: int, name: str, op: str, reads: list[TensorRef],
            outputs: list[TensorRef], buffer_of: dict[TensorRef, Buffer], shapes: Shapes) -> None:
        for ref in reads:
            if ref in self.view_of:
                self.readers[self.view_of[ref]].append((step, name))
        if op == "ReadVariableOp":
            for ref in outputs:
                self.view_of[ref], self.readers[ref] = ref, []
                self._event(buffer_of.get(ref), (step, name, "read", ref))
        elif op in ALIAS_OPS:
            present = [r for r in reads if r in buffer_of]
            for ref in outputs:
                source = _alias_source(op, ref, present)
                if source in self.view_of and buffer_of.get(ref) is buffer_of.get(source):
                    self.view_of[ref] = self.view_of[source]
        if op in ADOPT_OPS and len(reads) > 1:
            self._event(buffer_of.get(reads[0]),
                        (step, name, "adopt", buffer_of.get(reads[1])))
        elif op in UPDATE_OPS or op.startswith(UPDATE_PREFIX):
            for ref in reads:
                info = shapes[ref]
                if info is not None and dtypes.base(info.dtype) == dtypes.RESOURCE:
                    self._event(buffer_of.get(ref), (step, name, "update", None))

    def moves(self, order: list[str]) -> list[Move]:
        if not self.variables:
            return []
        steps, op_of, reads, outputs, buffer_of, shapes = self.step
        for step, name in enumerate(steps):
            self.saw(step, name, op_of[name], reads[name], outputs[name], buffer_of, shapes)
        step_of = {name: i for i, name in enumerate(order)}
        found, adopted = [], set()
        for variable, events in self.events.values():
            if id(variable) in self.copied_on_read:  # a copy as the write runs, no read shares
                found.extend(Move(step, variable, None, step) for step, _, kind, _ in events
                             if kind != "read")
                continue
            reads: list[TensorRef] = []
            for step, name, kind, item in events:
                if kind == "read":
                    reads.append(item)
                    continue
                readers = [r for read in reads for r in self.readers[read]]
                later = max((s for s, _ in readers if s > step), default=-1)
                if kind == "adopt":
                    if (item is None or item.lifetime != STEP or item.pinned or item.pieces != 1
                            or item.place != variable.place or id(item) in adopted):
                        continue
                    adopted.add(id(item))
                    found.append(Move(step, variable, item, max(later, step)))
                elif later > step:
                    found.append(Move(step, variable, None, later))
                else:
                    racing = _first_not_waited(self.parents, name, step_of,
                                               sorted({r for r in readers if r[0] < step}))
                    if racing is None:
                        continue
                    found.append(Move(racing, variable, None, racing))
                reads = []
        return sorted(found, key=lambda m: m.step)


def _operand_bytes(op: str, inputs: list[TensorRef], made: list[TensorRef], buffer_of: dict,
                   looped, name: str) -> int:
    """Bytes of the step's buffers `name` (an `op`) reads and writes, each once: not the
    variables' and constants' (counted apart) nor what a loop keeps from every iteration
    (its lists and stacks, which the loop passes can free). Of a sum's terms only its two
    largest: a running sum (the accumulate pass) holds no more."""
    held = set(looped.held_by.get(name, ()))

    def buffers(refs) -> dict:
        return {id(b): b for b in (buffer_of.get(r) for r in refs
                                   if r not in held and r not in looped.sizes)
                if b is not None and b.lifetime != STATE and b.pieces == 1}

    read = buffers(inputs)
    written = sum(b.size for key, b in buffers(made).items() if key not in read)
    sizes = sorted((b.size for b in read.values()), reverse=True)
    return sum(sizes[:2] if op in SUMMING_OPS else sizes) + written


def _copied_on_read(graph: Graph, order: list[str], op_of: dict[str, str],
                    variables: dict) -> set[str]:
    """The variables (of `variables`) a sparse op reads or writes in the step."""
    found = set()
    for name in order:
        if op_of[name].startswith(SPARSE_ACCESS_PREFIXES):
            handles = graph.data_inputs(name)
            if not op_of[name].startswith("ResourceSparseApply"):
                handles = handles[:1]
            found.update(_variable_of(graph, ref, variables) for ref in handles)
    found.discard(None)
    return found


def _variable_of(graph: Graph, ref: TensorRef, variables: dict) -> str | None:
    """The variable (of `variables`) whose handle `ref` is, through ops that pass it on."""
    for _ in range(MAX_HANDLE_HOPS):
        if ref.node in variables:
            return ref.node
        op = graph.op(ref.node)
        ref = _alias_source(op, ref, graph.data_inputs(ref.node)) if op in ALIAS_OPS else None
        if ref is None:
            return None
    return None


def _first_not_waited(parents: dict[str, tuple], name: str, step_of: dict[str, int],
                      readers: list[tuple[int, str]]) -> int | None:
    """The step of the last of `readers` ((step, node), in schedule order) that is not an
    ancestor of `name`, or None. Walks `name`'s ancestors down the schedule only as far as the
    reader it asks about (most updates race their last reader, found at once)."""
    seen: set[str] = set()
    waiting: list[str] = [name]  # reached, their parents not yet walked
    for step, reader in reversed(readers):
        stack, waiting = [n for n in waiting], []
        while stack:
            node = stack.pop()
            if step_of.get(node, -1) < step and node != name:
                waiting.append(node)  # below this reader: walked when an earlier one asks
                continue
            for parent in parents.get(node, ()):
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        if reader not in seen:
            return step
    return None


def _nbytes(info: TensorInfo | None) -> int | None:
    return None if info is None else info.nbytes


def _output_buffer(op: str, ref: TensorRef, inputs: list[TensorRef],
                   buffer_of: dict[TensorRef, Buffer], shapes: Shapes) -> Buffer | None:
    """The input buffer this output lives in (alias or in-place reuse), or None to allocate."""
    if op in ALIAS_OPS:
        source = _alias_source(op, ref, inputs)
        return buffer_of.get(source) if source is not None else None
    index = FORWARDED_INPUT.get(op, {}).get(ref.port)
    if op in FORWARDING_OPS and ref.port == 0:
        sources = inputs
    elif index is not None and index < len(inputs):
        sources = [inputs[index]]
    else:
        return None
    size = shapes.nbytes(ref)
    for source in sources:
        buffer = buffer_of[source]
        dies_here = buffer.uses_left - inputs.count(source) <= 0
        if dies_here and not buffer.pinned and buffer.size == size and size:
            return buffer
    return None


def _alias_source(op: str, ref: TensorRef, inputs: list[TensorRef]) -> TensorRef | None:
    if op in ("IdentityN", "_Retval"):
        return inputs[ref.port] if ref.port < len(inputs) else None
    if op in ("Merge", "RefMerge"):
        return inputs[0] if ref.port == 0 and inputs else None
    if op in ("Switch", "RefSwitch"):
        return inputs[0] if inputs else None
    return inputs[0] if ref.port == 0 and inputs else None
