"""What the modelled peak is made of, to say why a rewrite saved little, in terms a user acts on.

Recomputation removes only activations the backward pass reads; swapping moves only those that
wait long enough. When a training step is left alone or barely changes, the note names the
share of the peak no checkpoint choice can touch (parameters and optimizer state, the backward
pass's own values, values inside loops and function calls) and the option that reaches it.
"""

from __future__ import annotations

from ..analysis import optimizers, parameters, split
from ..analysis.memory import DEVICE
from ..analysis.memory import STATE as STATE_LIFETIME
from ..core.names import DIET_ATTR
from ..core.ops import XENT_OPS
from ..core.tensor_ref import TensorRef
from .context import CALL_OPS, Context

__all__ = ["composition", "why_so_little"]

VIEWS = ("Identity", "Snapshot", "Reshape", "Cast")  # a read passed on, reshaped or cast
ACTIVATIONS, STATE, BACKWARD, CALLS = ("activations", "parameters and optimizer state",
                                       "backward-pass values", "loops and function calls")


def composition(ctx: Context, report) -> dict[str, int]:
    """Bytes live at `report`'s device peak by kind (the four kinds above); `report` models
    `ctx`'s graph or a rewrite of it."""
    parts = dict.fromkeys((ACTIVATIONS, STATE, BACKWARD, CALLS), 0)
    for ref, size in report.live_at_peak.get(DEVICE, []):
        parts[_kind(ctx, report, ref)] += size
    return parts


def _kind(ctx: Context, report, ref) -> str:
    """Which of the four kinds the tensor `ref`, live at `report`'s peak, is."""
    graph, name = ctx.graph, ref.node
    if name not in graph:  # of a rewrite: a recomputed copy, a swapped-in value
        return ACTIVATIONS
    if name in ctx.in_loop_frame or graph.op(name) in CALL_OPS or graph.op(name) in ctx.functions:
        return CALLS
    if _held_state(graph, name, ctx) or name in ctx.constant or \
            getattr(report.buffer_of.get(ref), "lifetime", None) == STATE_LIFETIME:
        return STATE
    return ACTIVATIONS if name in ctx.analysis.split.forward else BACKWARD


def _held_state(graph, name: str, ctx: Context) -> bool:
    """A variable or its value as read: what the variables hold. A value computed from them
    (a capsule network's transform matrix tiled over the batch, 45 MiB of its 153) is the
    step's, as an activation is."""
    return name in ctx.parameters and (parameters.is_variable(graph, name) or graph.op(name)
                                       in (*parameters.READ_OPS, *VIEWS))


def why_so_little(ctx: Context, report, swapping: bool = False) -> str:
    """One sentence: what holds the peak, and which option reaches what recomputation cannot;
    first, where tensors only the data sizes count nothing, that the shares leave them out (a
    mixture of experts' dispatched tokens: 43% of its measured peak; its note advised diet,
    which raised the peak). `swapping`: said of the swap pass, whose advice is the other way
    round."""
    unsized = len(ctx.analysis.sized_by_data)
    caveat = (f"{unsized} tensors whose size only the data decides (after a Where, Unique or "
              "DynamicPartition) count 0 bytes in the model, so what follows leaves them out: "
              if unsized else "")
    return caveat + _what_holds_it(ctx, report, swapping)


def _what_holds_it(ctx: Context, report, swapping: bool) -> str:
    """`why_so_little`'s sentence on the modelled peak."""
    parts = composition(ctx, report)
    total = sum(parts.values()) or 1
    shares = ", ".join(f"{kind} {size / total:.0%}" for kind, size in
                       sorted(parts.items(), key=lambda item: -item[1]) if size)
    top = max(parts, key=parts.get)
    logits = _logits_at_peak(ctx, report)
    if logits and top in (ACTIVATIONS, BACKWARD):
        return (f"at the modelled peak ({shares}) a cross entropy's logits and their gradient "
                f"hold it ({logits}), which every lossless rewrite keeps whole: the chunked "
                "loss computes them a block of rows at a time (lossy: --budget B --lossy, or "
                "--passes chunk_loss)")
    if top == STATE:
        variables, updates = parameters.variables(ctx.graph), optimizers.updates(ctx.graph)
        dieted = sum(DIET_ATTR in ctx.graph.node_def(v).attr for v in variables)
        if dieted:  # diet ran before: its variables' updates are its own now
            return (f"at the modelled peak ({shares}) the variables hold it, which no "
                    f"recomputation lowers; diet already stores {dieted} variables in 16 bits")
        if variables and not updates:
            users = {(ctx.graph.op(u), slot) for v in variables
                     for u, slot in ctx.graph.consumers(TensorRef(v))}
            written = sorted({op for op, slot in users
                              if slot == 0 and ("Apply" in op or "Scatter" in op)})
            branches = sorted({op for op, _ in users if op in ("If", "StatelessIf", "Case")})
            by = f": they are written by {', '.join(written)}" if written else (
                f": they are written inside {' or '.join(branches)} (a LossScaleOptimizer "
                "applies its gradients in a cond), which diet does not read" if branches else "")
            return (f"at the modelled peak ({shares}) the variables hold it, which no "
                    f"recomputation lowers, and --mode diet reads no update here{by} (it "
                    "rewrites the dense updates of Adam and AdamW, momentum, RMSProp, "
                    "Adagrad, SGD and Lion, and Adam's sparse one)")
        return (f"at the modelled peak ({shares}) the variables hold it, which no "
                f"recomputation lowers: {_diet(ctx, variables, updates)}")
    if top == BACKWARD:
        return f"at the modelled peak ({shares}) {_backward_held(ctx, report, parts)}"
    advice = {
        ACTIVATIONS: "activations hold it, but no swap whose transfer hides lowers it: try "
                     "--mode memory (recomputation)" if swapping else
                     "activations hold it, but none can be recomputed more cheaply than kept: "
                     "try --mode swap, or --mode collection --checkpoints to choose them",
        CALLS: "values inside while loops and function calls hold it (an RNN's per-step "
               "values); --mode memory computes a step's values again in its gradient loop "
               "where that lowers the peak (loop_recompute) and runs a stacked RNN's earlier "
               "layers again whole (rerun); "
               "variant tensors are never swapped",
    }[top]
    return f"at the modelled peak ({shares}) {advice}"


TO_THE_LOSS = frozenset({"Reshape", "Identity", "BiasAdd", "Add", "AddV2"})  # logits to loss


def _logits_at_peak(ctx: Context, report) -> str:
    """The largest tensor live at the peak, where it is a cross entropy's logits (read by one
    through reshapes and a bias) or their gradient, and holds a quarter of the live bytes or
    more (a TF1 LSTM language model's 61 MiB of 10,000-word logits): 'name, N MiB'; else ''."""
    live = report.live_at_peak.get(DEVICE, [])
    if not live:
        return ""
    ref, size = max(live, key=lambda item: item[1])
    if size * 4 < sum(bytes_ for _, bytes_ in live):
        return ""
    graph, todo = ctx.graph, [ref]
    found = graph.op(ref.node) in XENT_OPS  # the gradient: the cross entropy's second output
    for _ in range(4):  # down through the reshapes and the bias to the cross entropy
        todo = [TensorRef(reader) for node in todo for reader, _ in graph.consumers(node)]
        found = found or any(graph.op(r.node) in XENT_OPS for r in todo)
        todo = [r for r in todo if graph.op(r.node) in TO_THE_LOSS]
    return f"{ref}, {size / 2**20:.1f} MiB" if found else ""


def _backward_held(ctx: Context, report, parts: dict[str, int]) -> str:
    """The backward pass's own values hold the peak: the largest of them, and, where the
    weights' gradients wait for the optimizer beside the weights and their state (a deep MLP
    whose activations were 0% of its peak: a note naming the logits' gradient, 10 KiB, said
    nothing useful), what diet would store."""
    graph = ctx.graph
    backward = [(size, str(ref)) for ref, size in report.live_at_peak.get(DEVICE, [])
                if _kind(ctx, report, ref) == BACKWARD]
    size, name = max(backward, default=(0, "?"))
    text = (f"the backward pass's own values hold it (the largest: {name}, "
            f"{size / 2**20:.1f} MiB): no checkpoint choice changes them")
    if parts[STATE] >= parts[ACTIVATIONS] + parts[CALLS]:
        variables, updates = parameters.variables(graph), optimizers.updates(graph)
        if variables and updates:
            text += f"; beside them the variables: {_diet(ctx, variables, updates)}"
    return text


def _diet(ctx: Context, variables: list[str], updates: list) -> str:
    """What diet would store in 16 bits: the `variables` the optimizer `updates` write, of all
    the variables' bytes (a distillation step's frozen teacher held 70% of them: diet leaves
    it)."""
    if not variables:
        return "--mode diet stores the graph's large float constants in 16 bits (lossy)"

    def size(name: str) -> int:
        info = parameters.value_info(ctx.graph, ctx.analysis.shapes, name)
        return (info.nbytes or 0) if info is not None else 0

    trained = {name for update in updates
               for name in (update.var, *update.slots.values()) if name in ctx.graph}
    part = sum(map(size, trained))
    total = sum(map(size, variables))
    # Written by updates diet does not rewrite (`ResourceSparseApplyAdagrad`): trained all
    # the same, and their state is not diet's to store.
    other: dict[str, set] = {}
    held = set(variables)
    for node in ctx.graph.nodes():
        if split.is_update_op(ctx.graph.op(node)):
            other.setdefault(ctx.graph.op(node), set()).update(
                r.node for r in ctx.graph.data_inputs(node)
                if r.node in held and r.node not in trained)
    other = {op: names for op, names in other.items() if names}
    if other:
        rest = "; " + ", ".join(
            f"{op} writes {len(names)} variables ({sum(map(size, names)) / 2**20:.1f} MiB)"
            for op, names in sorted(other.items())) + ": an update diet does not rewrite"
    else:
        rest = ("; the rest no update writes (weights the step does not train stay as they "
                "are)" if part < total / 2 else "")
    return (f"--mode diet stores the trained weights and their optimizer state in 16 bits "
            f"(lossy): {part / 2**20:.1f} of the {total / 2**20:.1f} MiB the variables hold"
            f"{rest}")
