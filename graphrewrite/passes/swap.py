"""Swap pass: move activations to host memory between their forward and backward uses.

For each swapped tensor a swap-out copy reads it as soon as it exists (so its device buffer is
freed after the last forward reader) and a swap-in copy brings it back; only the backward readers
are rewired to the swap-in. The swap-in waits on a trigger: the latest gradient-flow node that, by
the modelled schedule timed on a device profile (`planning.devices`: `profile=h200`, the CLI's
`--device-profile`), starts early enough for the transfer (bytes / the profile's host link, or
`bandwidth`) to finish before the first backward use; what no node can hide is the swap's
exposed time, which the report gives beside the transfer time. The swap-ins share one link,
one copy after another: each is timed to end where the next one needed begins (as late as
the link allows), and a tensor is swapped only if the link, with the others already chosen,
still brings every copy back in time (on an H200 a ResNet-50's backward pass took 10 ms as
modelled and its swap-ins 12 ms: each alone hid, all together could not).

What is swapped:
- policy `auto` (mode swap): forward tensors the gradient flow reads whose transfer a trigger can
  hide, largest first, as few as reach the lowest modelled device peak (or `budget`);
- policy `manual` (mode manual), or `tensors` (`--swap SELECTORS`) in any mode: Grappler's
  `_swap_to_host` attribute on a reading node, and what the selectors name.

Forms:
- `portable`: Identity nodes, the swap-out pinned to `/device:CPU:0`, the swap-in on the
  tensor's device. Runs on any build; on a GPU TensorFlow inserts the device copies.
- `grappler`: the `_CopyFromGpuToHost` / `_CopyFromHostToGpu` pair colocated with the producer,
  as Grappler's swapping pass emits it. Those ops have GPU kernels only.

Never swapped (the report says why): constants, inputs, variable reads, tensors inside loop
frames, resource/variant/string/ref tensors; in `auto` also tensors under 1 KiB.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
from dataclasses import dataclass, field

from tensorflow.core.framework import attr_value_pb2

from ..analysis import memory
from ..analysis.shapes import Shapes, TensorInfo
from ..analysis.split import no_backward_pass, reachable, untaken
from ..analysis.step import Analysis
from ..core import dtypes
from ..core import selectors as selectors_mod
from ..core.errors import GraphRewriteError
from ..core.graph import Graph
from ..core.names import SWAP_IN_SUFFIX, SWAP_OUT_SUFFIX
from ..core.tensor_ref import TensorRef
from ..planning.budget import parse_budget
from ..planning.context import GRAPH_INPUT_OPS, VARIABLE_READ_OPS, Context
from ..planning.devices import DeviceProfile, node_times, profile
from ..planning.peak import why_so_little
from .base import PassOptions, PassResult, counted
from .pads import can_gate, keep_apart, pad_readers

__all__ = ["HOST_DEVICE", "MIN_BYTES", "SwapOptions", "Swap", "SwapResult", "run"]

log = logging.getLogger(__name__)

HOST_DEVICE = "/device:CPU:0"
MIN_BYTES = 1024


@dataclass(frozen=True)
class SwapOptions(PassOptions):
    form: str = "portable"           # portable | grappler
    budget: str | None = None        # bytes ("6GiB") or a share of the peak ("60%")
    bandwidth: float | None = None   # bytes per second each way (default: the profile's link)
    profile: str = "default"         # the device profile the schedule is timed on
    policy: str = "auto"             # auto: search by the modelled peak; manual: what is asked
    tensors: str | None = None       # selectors of tensors to swap (`--swap`): always swapped

    def __post_init__(self):
        if self.form not in ("portable", "grappler"):
            raise GraphRewriteError(f"swap: unknown form '{self.form}' (portable, grappler)")
        if self.policy not in ("auto", "manual"):
            raise GraphRewriteError(f"swap: unknown policy '{self.policy}' (auto, manual)")
        if self.bandwidth is not None and self.bandwidth <= 0:
            raise GraphRewriteError("pass 'swap': option 'bandwidth' must be positive")
        profile(self.profile)  # an unknown profile fails now
        parse_budget(self.budget, 0)  # a malformed budget fails now, not when it is first used

    def takes_budget(self) -> bool:
        return self.policy == "auto"


@dataclass(frozen=True)
class Swap:
    """One tensor to move out and back: who reads the swapped-in copy, and what it waits on."""

    ref: TensorRef
    readers: tuple[str, ...]
    trigger: str | None
    exposed: float = 0.0  # seconds of its swap-in no backward node's compute hides


@dataclass
class SwapResult(PassResult):
    swapped: list[str] = field(default_factory=list)  # tensors
    bytes_moved: int = 0
    transfer_seconds: float = 0.0  # both ways, on the profile's link (or `bandwidth`)
    exposed_seconds: float = 0.0   # of the swap-ins, not hidden behind backward compute
    device_profile: str = ""       # the profile the swaps were timed on
    fanout_pads: int = 0
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reason -> tensors

    def section(self) -> dict:
        return {**super().section(), "skipped": counted(self.skipped)}


def run(graph: Graph, analysis: Analysis, options: SwapOptions, model=None):
    """Swap what is asked (`_swap_to_host`, `--swap`), or search: the largest activations whose
    transfer a backward node can hide, as few as reach the lowest modelled peak (or the budget)."""
    device = profile(options.profile)
    if not device.has_host:
        return SwapResult(graph, False, note=f"device profile {device.name}: host and device "
                          "are one memory, so swapping frees no device memory",
                          device_profile=device.name)
    ctx = Context.build(graph, analysis)
    timing = _Timing.build(ctx, device, options.bandwidth)
    why = "nothing to swap"
    if options.policy == "manual" or options.tensors:
        chosen, skipped = _requested(ctx, timing, options.tensors)
        chosen = timing.schedule(chosen)
    elif not analysis.split.seeds:
        return SwapResult(graph, False, note=no_backward_pass(graph))
    else:
        candidates, skipped = _candidates(ctx, timing)
        together = timing.hidden(candidates)
        chosen = _search(ctx, together, options, timing)
        why = (_nothing_to_swap(ctx, together, skipped) if together or not candidates else
               f"nothing to swap: none of the {len(candidates)} activations whose swap-in a "
               "backward node could hide is also copied out in time (once made, over the "
               f"{device.name} profile's link)")
    if not chosen:
        return SwapResult(graph, False, note=why, skipped=skipped, device_profile=device.name)
    new_graph, shapes, pads = _apply(ctx, chosen, options.form)
    if options.form == "grappler":
        log.warning("swap form 'grappler': _CopyFromGpuToHost/_CopyFromHostToGpu have GPU "
                    "kernels only; the rewritten graph runs on a GPU build with a GPU")
    each_way = sum(ctx.analysis.shapes.nbytes(s.ref) or 0 for s in chosen)
    return SwapResult(new_graph, True, shapes, swapped=[str(s.ref) for s in chosen],
                      bytes_moved=2 * each_way,
                      transfer_seconds=each_way / timing.out_bandwidth
                      + each_way / timing.bandwidth,
                      exposed_seconds=sum(s.exposed for s in chosen),
                      device_profile=device.name, fanout_pads=pads, skipped=skipped)


def _search(ctx: Context, candidates: list[Swap], options: SwapOptions, timing: "_Timing"
            ) -> list[Swap]:
    """The shortest prefix of `candidates` (largest first, brought back in time together:
    `_Timing.hidden`) whose modelled peak meets the budget, or (no budget) is as low as
    swapping all of them gets, each timed on the link; nothing if swapping does not lower
    the peak."""
    analysis = ctx.analysis

    def peak(count: int) -> int:
        graph, shapes, _ = _apply(ctx, timing.schedule(candidates[:count]), options.form)
        return memory.simulate(graph, shapes, analysis.fetches).peak()

    if not candidates:
        return []
    budget = parse_budget(options.budget, analysis.memory.peak())
    if budget >= analysis.memory.peak():
        return []  # already within the budget
    lowest = peak(len(candidates))
    if lowest >= analysis.memory.peak():
        return []
    target = max(budget, lowest)
    low, high = 1, len(candidates)
    while low < high:  # assumes the peak falls as more is swapped, as it nearly does
        middle = (low + high) // 2
        if peak(middle) <= target:
            high = middle
        else:
            low = middle + 1
    return timing.schedule(candidates[:high])


def _nothing_to_swap(ctx: Context, candidates: list[Swap], skipped: dict) -> str:
    """Why the search swapped nothing, in terms a user acts on (an Estimator-style step built
    outside the repo was told "nothing to swap" alone)."""
    if candidates:
        return (f"nothing to swap: swapping all {len(candidates)} activations whose transfer "
                "can hide does not lower the modelled peak; "
                + why_so_little(ctx, ctx.analysis.memory, swapping=True))
    waiting = {reason: refs for reason, refs in skipped.items() if reason not in (
        "constant", "graph input", "variable read")}
    if not waiting:
        return "nothing to swap: the backward pass reads no activation"
    reason, refs = max(waiting.items(), key=lambda item: len(item[1]))
    return (f"nothing to swap: of the activations the backward pass reads, {len(refs)} are "
            f"not swapped because: {reason} (e.g. {refs[0]})")


def _candidates(ctx: Context, timing: "_Timing") -> tuple[list[Swap], dict]:
    """Forward tensors the gradient flow reads, largest first, whose swap-in a backward node can
    start early enough to finish before the first backward use; and the rest, by reason."""
    graph, analysis = ctx.graph, ctx.analysis
    shapes, split = analysis.shapes, analysis.split
    found, skipped = [], {}
    never_run, unmade = untaken(graph)  # a v1 cond's side its known predicate never takes
    for name in graph.nodes():
        if name not in split.forward or name in never_run:
            continue
        for ref in shapes.outputs(name):
            if ref in unmade:
                continue
            readers = _backward_readers(ctx, ref)
            if not readers:
                continue
            reason, trigger = _blocker(ctx, ref), None
            if not reason:
                trigger, exposed = timing.trigger(readers, timing.seconds_of(ref))
                if exposed or trigger is None:
                    reason = "no backward node runs early enough to hide the transfer"
            if reason:
                skipped.setdefault(reason, []).append(str(ref))
            else:
                found.append(Swap(ref, readers, trigger))
    found.sort(key=lambda s: (-(shapes.nbytes(s.ref) or 0), str(s.ref)))
    return found, {k: sorted(v) for k, v in sorted(skipped.items())}


def _requested(ctx: Context, timing: "_Timing", selectors: str | None
               ) -> tuple[list[Swap], dict]:
    """Grappler's `_swap_to_host` (an input index or a list of them, on the reading node: only
    that reader gets the swapped-in copy), and what `selectors` names (read back by the whole
    gradient flow). Unswappable tensors are skipped; the rest is swapped even if small."""
    graph, analysis = ctx.graph, ctx.analysis
    readers: dict[TensorRef, set[str]] = {}
    for name in graph.nodes():
        for index in graph.swap_hints(name):  # in range: `Graph.check` refuses the others
            readers.setdefault(graph.data_inputs(name)[index], set()).add(name)
    for name in selectors_mod.select(graph, selectors) if selectors else []:
        for ref in analysis.shapes.outputs(name):
            flow = _backward_readers(ctx, ref)
            if flow:
                readers.setdefault(ref, set()).update(flow)
    chosen, skipped = [], {}
    for ref in sorted(readers):
        reason = _blocker(ctx, ref, any_size=True)
        if reason:
            skipped.setdefault(reason, []).append(str(ref))
            continue
        trigger, exposed = timing.trigger(readers[ref], timing.seconds_of(ref))
        chosen.append(Swap(ref, tuple(sorted(readers[ref])), trigger, exposed))
    return chosen, skipped


def _backward_readers(ctx: Context, ref: TensorRef) -> tuple[str, ...]:
    """The gradient-flow nodes reading `ref`, sorted: who gets the swapped-in copy."""
    flow = ctx.analysis.split.gradient_flow
    return tuple(sorted({v for v, _ in ctx.graph.consumers(ref) if v in flow}))


def _blocker(ctx: Context, ref: TensorRef, any_size: bool = False) -> str | None:
    graph, info = ctx.graph, ctx.analysis.shapes[ref]
    op = graph.op(ref.node)
    if ref.node in ctx.constant:
        return "constant"
    if op in GRAPH_INPUT_OPS:
        return "graph input"
    if op in VARIABLE_READ_OPS or ref.node in ctx.parameters:
        return "variable read"
    if ref.node in ctx.in_loop_frame:
        return "inside a while-loop frame"
    if info is None or info.dtype not in dtypes.PLAIN:  # a reference type is not plain
        return "resource, variant, string or reference tensor"
    if not any_size and (info.nbytes or 0) < MIN_BYTES:
        return "smaller than 1 KiB"
    return None


def _apply(ctx: Context, swaps: list[Swap], form: str):
    """The graph with `swaps` made, its shapes, and the fan-out pads added."""
    graph = ctx.graph.copy()
    shapes = Shapes(dict(ctx.analysis.shapes.tensors))
    for swap in swaps:
        ref, info = swap.ref, ctx.analysis.shapes[swap.ref]
        device = graph.node_def(ref.node).device
        stem = ref.node if ref.port == 0 else f"{ref.node}_{ref.port}"
        out_name = graph.unique_name(stem + SWAP_OUT_SUFFIX)
        in_name = graph.unique_name(stem + SWAP_IN_SUFFIX)
        dtype = {"T": attr_value_pb2.AttrValue(type=info.dtype)}
        if form == "grappler":
            colocate = {"_class": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                s=[f"loc:@{ref.node}".encode()]))}
            graph.add_node(out_name, "_CopyFromGpuToHost", [ref], {**dtype, **colocate}, device)
            graph.add_node(in_name, "_CopyFromHostToGpu", [TensorRef(out_name)],
                           {**dtype, **colocate}, device)
        else:
            # Kept through Grappler, which would otherwise fold the pair away on a CPU-only
            # machine and regroup the backward arithmetic around it.
            keep = {"_grappler_do_not_remove": attr_value_pb2.AttrValue(b=True)}
            graph.add_node(out_name, "Identity", [ref], {**dtype, **keep}, HOST_DEVICE)
            graph.add_node(in_name, "Identity", [TensorRef(out_name)], {**dtype, **keep}, device)
        graph.replace_uses(ref, TensorRef(in_name), list(swap.readers))
        if swap.trigger:
            graph.add_control(swap.trigger, in_name)
        for name in (out_name, in_name):
            shapes.tensors[TensorRef(name)] = TensorInfo(info.dtype, info.shape)
    pads = pad_readers(graph, ctx.graph, ctx.analysis, {})
    keep_apart(graph)
    return graph, shapes, pads


@dataclass
class _Timing:
    """The modelled schedule with a device time per node (`DeviceProfile.node_seconds`), to
    pick swap-in triggers."""

    original: Graph
    shapes: Shapes
    flow: frozenset
    order: list[str]
    position: dict[str, int]
    starts: list[float]  # when each node of `order` begins, the nodes one after another
    bandwidth: float
    out_bandwidth: float
    reached: dict = field(default_factory=dict)  # `after`'s answers

    @classmethod
    def build(cls, ctx: Context, device: DeviceProfile, bandwidth: float | None) -> "_Timing":
        """`bandwidth`, if given, is the swap-in's link instead of the profile's."""
        graph, order = ctx.graph, ctx.analysis.memory.order
        seconds = node_times(graph, ctx.analysis.shapes, order, device)
        starts = [0.0]
        for name in order:
            starts.append(starts[-1] + seconds[name])
        return cls(graph, ctx.analysis.shapes, ctx.analysis.split.gradient_flow, order,
                   {n: i for i, n in enumerate(order)}, starts,
                   bandwidth or device.host_to_device, bandwidth or device.device_to_host)

    def seconds_of(self, ref: TensorRef) -> float:
        """A swap-in's transfer time."""
        return (self.shapes.nbytes(ref) or 0) / self.bandwidth

    def released(self, ref: TensorRef) -> float:
        """When the swapped-out copy of `ref` is on the host: its producer's end, then the
        copy out (the other direction of the link)."""
        index = self.position.get(ref.node)
        made = self.starts[index + 1] if index is not None else 0.0
        return made + (self.shapes.nbytes(ref) or 0) / self.out_bandwidth

    def needed(self, swap: Swap) -> float | None:
        """When the first reader of the swapped-in copy begins (None: none is scheduled)."""
        scheduled = [self.position[r] for r in swap.readers if r in self.position]
        return self.starts[min(scheduled)] if scheduled else None

    def hidden(self, candidates: list[Swap]) -> list[Swap]:
        """`candidates`, in their order, each kept if the link still brings it and those kept
        before it back in time: one copy after another, each begun no earlier than the
        earliest node that can trigger it (`trigger` with no time to hide) nor before it is on
        the host (`released`), and ended by its first reader."""
        kept: list[tuple[float, float, float]] = []  # (needed, earliest start, seconds)
        chosen = []
        for swap in candidates:
            needed, seconds = self.needed(swap), self.seconds_of(swap.ref)
            earliest, _ = self.trigger(swap.readers, float("inf"))
            if needed is None or earliest is None:
                continue
            begins = max(self.starts[self.position[earliest]], self.released(swap.ref))
            trial = sorted([*kept, (needed, begins, seconds)])
            free = 0.0
            for end_by, start_at, length in trial:
                free = max(free, start_at) + length
                if free > end_by:
                    break
            else:
                kept, chosen = trial, [*chosen, swap]
        return chosen

    def schedule(self, swaps: list[Swap]) -> list[Swap]:
        """`swaps` with triggers on the shared link: the copy needed last ends as its reader
        begins, each earlier one as the next begins (or its own reader, if earlier), and
        waits on the latest node that starts that early; each one's exposed time is how far
        the copies, in that order from those triggers, run past its reader."""
        timed = sorted(((needed, str(s.ref), s) for s in swaps
                        if (needed := self.needed(s)) is not None), key=lambda t: t[:2])
        latest, leads = float("inf"), {}
        for needed, key, swap in reversed(timed):
            end = min(needed, latest)
            latest = end - self.seconds_of(swap.ref)
            leads[key] = needed - latest
        free, stalled, planned = 0.0, 0.0, {}
        for needed, key, swap in timed:
            trigger, _ = self.trigger(swap.readers, leads[key])
            begins = max(self.starts[self.position[trigger]] if trigger in self.position
                         else needed, self.released(swap.ref))
            free = max(free, begins + stalled) + self.seconds_of(swap.ref)
            exposed = max(0.0, free - (needed + stalled))
            stalled += exposed
            planned[key] = dataclasses.replace(swap, trigger=trigger, exposed=exposed)
        return [planned.get(str(s.ref), s) for s in swaps]

    @functools.cached_property
    def gates(self) -> list[int]:
        """The positions in `order` of the nodes a swap-in can wait on: gradient-flow nodes
        whose new control output Grappler ignores (see `pads.can_gate`)."""
        return [index for index, name in enumerate(self.order)
                if name in self.flow and can_gate(self.original, name)]

    def after(self, readers: tuple[str, ...]) -> frozenset:
        """What runs after `readers` (asked again for each plan the search weighs)."""
        if readers not in self.reached:
            self.reached[readers] = frozenset(reachable(self.original.nx, readers))
        return self.reached[readers]

    def trigger(self, readers, transfer: float) -> tuple[str | None, float]:
        """The latest gate (`gates`) that starts early enough for a copy of `transfer`
        seconds to finish before the first of `readers` runs, and 0.0; else the earliest one
        there is, and the seconds of the copy that the nodes after it leave exposed (all of
        it without one)."""
        scheduled = [self.position[r] for r in readers if r in self.position]
        if not scheduled:
            return None, transfer
        first = min(scheduled)
        # The model lets readers of an IdentityN Grappler removes run before it (see
        # `schedule.bypassed_identities`), so an earlier node may still depend on the readers.
        after_readers = self.after(tuple(sorted(readers)))
        earliest, covered = None, 0.0
        for index in reversed(self.gates[:bisect.bisect_left(self.gates, first)]):
            name = self.order[index]
            if name in after_readers:
                continue
            elapsed = self.starts[first] - self.starts[index]
            if elapsed >= transfer:
                return name, 0.0
            earliest, covered = name, elapsed
        return earliest, transfer - covered
