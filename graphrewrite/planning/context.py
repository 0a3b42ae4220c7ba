"""What the checkpoint policies and the recompute and swap passes know about one graph, built
once per pass: the analysis, which nodes are constant, parameters, inside loop frames or
function calls, and why a node must never be copied (`Context.blocker`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..analysis import flops, parameters
from ..analysis.schedule import needed_nodes
from ..analysis.split import loop_frame_nodes, reachable
from ..analysis.step import Analysis
from ..core import ops
from ..core.graph import Graph
from ..core.ops import FUNCTIONAL_CONTROL_OPS, PLACEHOLDER_OPS, V1_LOOP_OPS
from ..core.tensor_ref import TensorRef

__all__ = ["VARIABLE_READ_OPS", "GRAPH_INPUT_OPS", "CALL_OPS", "REF_VARIABLES", "REF_SNAPSHOTS",
           "REF_READERS", "RANDOM_OP", "RANDOM_REASONS", "DATA_SIZED_OPS", "DATA_SIZED", "Context"]

# Reads of a variable whose output is an activation or an alias of the variable: never copied
# (a copy could read the variable after the optimizer wrote it).
VARIABLE_READ_OPS = frozenset({"ReadVariableOp", "VariableV2", "Variable", "VarHandleOp",
                               "ResourceGather", "PlaceholderWithDefault"})
# Inputs a step may be fed (a `PlaceholderWithDefault`: Keras's learning phase, `is_training`).
GRAPH_INPUT_OPS = PLACEHOLDER_OPS | {"PlaceholderWithDefault"}
CALL_OPS = FUNCTIONAL_CONTROL_OPS | {"PartitionedCall", "StatefulPartitionedCall"}
REF_VARIABLES = frozenset({"VariableV2", "Variable"})
# Ops that read a ref variable into a buffer of their own (a snapshot, as a resource read is),
# and ops that read it without writing it.
REF_SNAPSHOTS = frozenset({"Cast"})
REF_READERS = REF_SNAPSHOTS | {"Identity", "IsVariableInitialized"}
# A v1 cond's Switch and Merge outside loop frames: a copy reads the same (or copied) inputs
# as its original, so it is dead exactly when the original is, and a copied cond takes the
# branch the original took (the triggers that gate copies sit outside every branch).
COPYABLE_COND_OPS = frozenset({"Switch", "Merge"})
RANDOM_OP = "random op"
# Ops whose output's size depends on the values they read. Grappler gives each such output a
# shape of its own, so it could not tell a copy's from the original's: a Switch-style mixture of
# experts (tokens dispatched by `where`) had the GELU gradient's products regrouped otherwise by
# MinimizeBroadcasts, weights 7.5e-9 apart. Their outputs are indices, small: kept, never copied.
DATA_SIZED_OPS = frozenset({"Where", "Unique", "UniqueV2", "UniqueWithCounts",
                            "UniqueWithCountsV2", "ListDiff", "DynamicPartition",
                            "NonMaxSuppression", "NonMaxSuppressionV2", "NonMaxSuppressionV3",
                            "NonMaxSuppressionV4", "NonMaxSuppressionV5"})
DATA_SIZED = "output sized by the data"
RANDOM_REASONS = (RANDOM_OP, "a smaller form of a random draw")


@dataclass
class Context:
    """What the policies and the recompute and swap passes need to know about the graph."""

    graph: Graph
    analysis: Analysis
    constant: frozenset
    in_loop_frame: set[str]
    functions: frozenset = frozenset()
    parameters: frozenset = frozenset()
    _blockers: dict = field(default_factory=dict)
    _spreads: list | None = None  # the memory policy's, built once (see `_spreads`)
    _chain: tuple | None = None   # the bottlenecks and their byte counts (see `_chain`)
    _activations: tuple | None = None  # the activations towards the loss (`_activations`)
    _order: list | None = None
    _flow_reads: dict | None = None
    _node_flops: dict = field(default_factory=dict)
    _sources: dict | None = None
    _readers: dict | None = None
    _forward_blockers: dict | None = None
    _loops_back: bool | None = None
    _copyable_parameters: frozenset | None = None
    _ref_writers: tuple | None = None  # see `ref_writers`
    _needed: frozenset | None = None  # see `needed`
    _early_values: frozenset | None = None  # see `early_values`

    def order(self) -> list[str]:
        """The graph's topological order, computed once (the graph is not changed in place)."""
        if self._order is None:
            self._order = self.graph.topological_order()
        return self._order

    def loops_back(self) -> bool:
        """Whether the graph has v1 loop back edges (NextIteration -> Merge), found once."""
        if self._loops_back is None:
            self._loops_back = any(self.graph.loops_back(n) for n in self.order())
        return self._loops_back

    def sources(self) -> dict[str, tuple[str, ...]]:
        """Node -> the nodes its data inputs come from, computed once: the planners walk them
        for every plan they price."""
        if self._sources is None:
            self._sources = {n: tuple(r.node for r in self.graph.data_inputs(n))
                             for n in self.graph.nodes()}
        return self._sources

    def readers(self) -> dict[str, tuple[str, ...]]:
        """Node -> the nodes reading its outputs (once per data edge), computed once."""
        if self._readers is None:
            readers: dict[str, list[str]] = {n: [] for n in self.graph.nodes()}
            for name, sources in self.sources().items():
                for source in sources:
                    readers.setdefault(source, []).append(name)
            self._readers = {n: tuple(r) for n, r in readers.items()}
        return self._readers

    def forward_blockers(self) -> dict[str, str | None]:
        """Forward node -> `blocker(node)`, for all of them at once: the planners ask about
        the same nodes for every plan they price. Found in topological order: a node's reason
        can depend on its inputs' (`_distils_a_draw`), which are then known, so the recursion
        stays shallow however deep the graph."""
        if self._forward_blockers is None:
            forward = self.analysis.split.forward
            self._forward_blockers = {n: self.blocker(n) for n in self.order() if n in forward}
        return self._forward_blockers

    def copyable_parameters(self) -> frozenset:
        """Forward parameters computed from resource-variable reads and constants alone, through
        pure ops (a diet pass's dequantization of a 16-bit weight, a cast or view of a weight),
        found once: a recomputed node reading one copies it too. A resource read is a snapshot
        (an update after it writes another buffer, or copies first), so the copy computes the
        same value when the recomputation runs; held instead, the float32 parameter of every
        recomputed layer would live from the forward pass to its recomputation (a dieted
        ResNet-50: every dequantized weight at the peak, and recomputation found no plan).
        Reads themselves are never copied, nor what reads a variable directly (a ref
        variable's `Identity` aliases a buffer an in-place update may change), except a ref
        variable's `Cast` (the diet pass's dequantization) when no forward node waits on a
        write of that variable: the copy is then ordered before the writes (`ref_writers`)."""
        if self._copyable_parameters is None:
            graph, forward, found = self.graph, self.analysis.split.forward, set()
            snapshots = {"ReadVariableOp", "ResourceGather"}
            writers, _ = self.ref_writers()
            for name in self.order():
                if name not in self.parameters or name not in forward:
                    continue
                op = graph.op(name)
                inputs = graph.data_inputs(name)
                if op in VARIABLE_READ_OPS or parameters.is_variable(graph, name) or \
                        ops.is_stateful(op) or name in self.in_loop_frame or \
                        op in CALL_OPS or op in self.functions or \
                        not self.analysis.shapes.outputs(name):
                    continue
                if inputs and all(r.node in found or r.node in self.constant
                                  or graph.op(r.node) in snapshots
                                  or (op in REF_SNAPSHOTS and r.node in writers)
                                  for r in inputs):
                    found.add(name)
            self._copyable_parameters = frozenset(found)
        return self._copyable_parameters

    def needed(self) -> frozenset:
        """What one step runs: the fetches' ancestors, found once. The rest (a gradient with
        respect to a constant, such as the 1 of a GELU's `1 + erf`) Grappler prunes."""
        if self._needed is None:
            self._needed = frozenset(needed_nodes(self.graph, [
                f.split(":")[0] for f in self.analysis.fetches if f.split(":")[0] in self.graph]))
        return self._needed

    def early_values(self) -> frozenset:
        """The backward nodes outside the gradient flow that compute, from forward values
        alone, a value the flow reads (a tanh-GELU's `x ** 2`), found once: not what only an
        update reads (a batch norm's moving average, which the train op waits on)."""
        if self._early_values is None:
            split, graph = self.analysis.split, self.graph
            early = split.early_backward & self.needed()
            found, stack = set(), [r.node for v in split.gradient_flow
                                   for r in graph.data_inputs(v) if r.node in early]
            while stack:  # up data edges only: the flow waits on the updates by control edges
                name = stack.pop()
                if name not in found:
                    found.add(name)
                    stack += [r.node for r in graph.data_inputs(name) if r.node in early]
            self._early_values = frozenset(found)
        return self._early_values

    def ref_writers(self) -> tuple[dict[str, tuple[str, ...]], frozenset]:
        """Ref variable -> the step's ops that may write it (every user but a reader), for the
        ref variables whose writes nothing that reads an activation waits on (an optimizer's
        update, not a batch norm's moving average, which back-propagation may wait on); and
        every node that waits on one of those writes. A copy of a read made during
        back-propagation is ordered before the writes; no cycle closes as long as its trigger
        waits on none of those nodes."""
        if self._ref_writers is None:
            graph, forward = self.graph, self.analysis.split.forward
            variables = [n for n in self.order() if graph.op(n) in REF_VARIABLES]
            step = self.needed() if variables else ()

            def reads_an_activation(name: str) -> bool:
                return name in forward or any(r.node in forward and r.node not in self.parameters
                                              for r in graph.data_inputs(name))

            found, late = {}, set()
            for name in variables:
                writers = tuple(sorted(
                    user for user, slot in graph.consumers(TensorRef(name))
                    if slot is not None and slot >= 0 and user in step
                    and graph.op(user) not in REF_READERS))
                after = reachable(graph.nx, writers)
                if not any(map(reads_an_activation, after)):
                    found[name] = writers
                    late |= after
            self._ref_writers = found, frozenset(late)
        return self._ref_writers

    def flow_reads(self) -> dict[str, list[TensorRef]]:
        """Forward node -> its outputs the gradient flow reads, in order, computed once."""
        if self._flow_reads is None:
            split, shapes = self.analysis.split, self.analysis.shapes
            self._flow_reads = {
                n: [r for r in shapes.outputs(n)
                    if any(v in split.gradient_flow for v, _ in self.graph.consumers(r))]
                for n in self.order() if n in split.forward}
        return self._flow_reads

    def flops(self, names) -> int:
        """FLOPs of one run of each of `names` (each node's found once per context: the
        planners price a hundred plans that recompute mostly the same nodes)."""
        known = self._node_flops
        for name in names:
            if name not in known:
                known[name] = flops.node_flops(self.graph, self.analysis.shapes, name)
        return sum(known[name] for name in names)

    @classmethod
    def build(cls, graph: Graph, analysis: Analysis) -> "Context":
        functions = frozenset(f.signature.name for f in graph.shell.library.function)
        constant = analysis.split.constant
        return cls(graph, analysis, constant, loop_frame_nodes(graph), functions,
                   analysis.parameters(graph))

    def pin_never(self, names, reason: str) -> None:
        """Never copy `names` (a user's pin): `reason` is their blocker, before any is asked."""
        for name in names:
            self._blockers[name] = reason
        self._forward_blockers = None

    def blocker(self, name: str) -> str | None:
        """Why `name` must not be recomputed, or None when copying it is safe."""
        if name not in self._blockers:
            self._blockers[name] = self._find_blocker(name)
        return self._blockers[name]

    def _find_blocker(self, name: str) -> str | None:
        graph = self.graph
        op = graph.op(name)
        functions = self.functions
        if op in GRAPH_INPUT_OPS:
            return "graph input"
        if op == "Const":
            return "constant"
        if name in self.constant:
            return "computed from constants only"
        if op in VARIABLE_READ_OPS or parameters.is_variable(graph, name):
            return "variable read"
        if name in self.parameters:
            return "computed from variables only"
        if "Random" in op or op in ("Multinomial", "TruncatedNormal", "RandomShuffle"):
            return RANDOM_OP
        if op in DATA_SIZED_OPS:
            return DATA_SIZED
        if name in self.in_loop_frame:
            return "inside a while-loop frame"
        if op in V1_LOOP_OPS and op not in COPYABLE_COND_OPS:  # outside every loop frame
            return f"a v1 cond's {op} (of a ref variable)"
        if op in CALL_OPS or op in functions or any(
                v.HasField("func") for v in graph.node_def(name).attr.values()):
            return "function call"
        if ops.is_stateful(op):
            return "stateful op" if ops.op_def(op) is not None else "op unknown to TensorFlow"
        if not self.analysis.shapes.outputs(name):
            return "no outputs"
        if self._distils_a_draw(name):
            return "a smaller form of a random draw"
        return None

    def _distils_a_draw(self, name: str) -> bool:
        """Whether `name` is computed from random draws (and constants and parameters) alone and
        is no larger than the draw it reads: a dropout mask (`GreaterEqual(uniform, rate)`, one
        byte an element) is held instead of the uniform floats it was drawn from, which die in
        the forward pass; the mask's float cast, as large as the draw, is recomputed from it."""
        shapes = self.analysis.shapes
        drawn = [r for r in self.graph.data_inputs(name)
                 if r.node not in self.constant and r.node not in self.parameters]
        if not drawn or any(self.blocker(r.node) not in RANDOM_REASONS for r in drawn):
            return False
        size = max((shapes.nbytes(r) or 0 for r in shapes.outputs(name)), default=0)
        return 0 < size <= max(shapes.nbytes(r) or 0 for r in drawn)
