"""Swap pass: move activations to host memory between their forward and backward uses.

Candidates are forward tensors the gradient flow reads whose buffers are live at the modelled
peak; the largest go first, until the modelled device peak meets the budget or nothing is left.
For each, a swap-out copy (reading the tensor as soon as it exists, so its device buffer is freed
after the last forward reader) and a swap-in copy (on the tensor's device) are added, and only the
gradient-flow readers are rewired to the swap-in. The swap-in waits on a trigger: the latest
gradient-flow node that, by the modelled schedule, starts early enough for the transfer
(bytes / bandwidth) to finish before the first backward use.

Forms:
- `portable`: Identity nodes, the swap-out pinned to `/device:CPU:0`, the swap-in on the
  tensor's device. Runs on any build; on a GPU TensorFlow inserts the device copies.
- `grappler`: the `_CopyFromGpuToHost` / `_CopyFromHostToGpu` pair colocated with the producer,
  as Grappler's swapping pass emits it. Those ops have GPU kernels only.

Never swapped (the report says why): constants, inputs, variable reads, tensors inside loop
frames, resource/variant/string/ref tensors, tensors under 1 KiB.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from tensorflow.core.framework import attr_value_pb2

from .. import checkpoints as policies
from .. import flops, memory
from ..analysis import Analysis
from ..errors import GraphRewriteError
from ..graph import Graph
from ..names import SWAP_IN_SUFFIX, SWAP_OUT_SUFFIX
from ..shapes import Shapes, TensorInfo
from ..tensor_ref import TensorRef
from .pads import can_gate, pad_readers

log = logging.getLogger(__name__)

HOST_DEVICE = "/device:CPU:0"
MIN_BYTES = 1024
# The assumed accelerator when timing the schedule (a roofline: a node takes the longer of its
# arithmetic and its memory traffic, plus a launch overhead); V100-class figures.
DEVICE_FLOPS = 1e13      # arithmetic throughput, FLOP/s
DEVICE_BANDWIDTH = 9e11  # device memory bandwidth, bytes/s
NODE_OVERHEAD = 5e-6     # seconds a node takes at least
SWAPPABLE_TYPES = frozenset({1, 2, 3, 4, 5, 6, 9, 10, 14, 17, 19, 22, 23})  # numeric and bool


@dataclass(frozen=True)
class SwapOptions:
    form: str = "portable"           # portable | grappler
    budget: str | None = None        # bytes ("6GiB") or a share of the peak ("60%")
    bandwidth: float = 16e9          # bytes per second each way (Grappler's PCIe assumption)

    def __post_init__(self):
        if self.form not in ("portable", "grappler"):
            raise GraphRewriteError(f"swap: unknown form '{self.form}' (portable, grappler)")
        object.__setattr__(self, "bandwidth", float(self.bandwidth))


def parse_budget(text: str | None, peak: int) -> int:
    """`6GiB`, `512MB`, `1048576` or `60%` (of `peak`) -> bytes; None -> 0 (as low as it goes).

    >>> parse_budget("60%", 1000), parse_budget("2KiB", 0)
    (600, 2048)
    """
    if not text:
        return 0
    match = re.fullmatch(r"\s*([0-9.]+)\s*(%|[KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise GraphRewriteError(f"budget '{text}': expected bytes like 6GiB or a share like 60%")
    value, unit = float(match.group(1)), (match.group(2) or "B").upper()
    if unit == "%":
        return int(peak * value / 100)
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(value * scale)


def run(graph: Graph, analysis: Analysis, options: SwapOptions, model=None):
    """Swap the largest long-lived activations at the modelled peak out to host memory."""
    from . import PassResult

    if not analysis.split.seeds:
        return PassResult(graph, False, {"swap": "no backward pass found: nothing to do"})
    ctx = policies.Context.build(graph, analysis)
    target = parse_budget(options.budget, analysis.memory.peak())
    candidates, skipped = _candidates(ctx)
    if not candidates:
        return PassResult(graph, False, {"swap": "no tensor at the modelled peak can be "
                                                 "swapped", "swap_skipped": skipped})

    def attempt(count: int):
        swapped = _apply(ctx, candidates[:count], options)
        return (*swapped, memory.simulate(swapped[0], swapped[1], analysis.fetches).peak())

    best, count = attempt(len(candidates)), len(candidates)
    if target and best[-1] <= target:  # the fewest largest tensors that meet the budget
        low, high = 1, len(candidates)
        while low < high:
            middle = (low + high) // 2
            trial = attempt(middle)
            if trial[-1] <= target:
                best, count, high = trial, middle, middle
            else:
                low = middle + 1
    if best[-1] >= analysis.memory.peak():
        return PassResult(graph, False, {"swap": "swapping does not lower the modelled peak",
                                         "swap_skipped": skipped})
    new_graph, shapes, moved, pads, _ = best
    chosen = candidates[:count]
    if options.form == "grappler":
        log.warning("swap form 'grappler': _CopyFromGpuToHost/_CopyFromHostToGpu have GPU "
                    "kernels only; the rewritten graph runs on a GPU build with a GPU")
    return PassResult(new_graph, True, {
        "swapped": [str(r) for r in chosen],
        "bytes_moved": 2 * moved,
        "transfer_seconds": 2 * moved / options.bandwidth,
        "swap_form": options.form,
        "fanout_pads": pads,
        "swap_skipped": skipped,
    }, shapes)


def _candidates(ctx: policies.Context) -> tuple[list[TensorRef], dict]:
    """Forward tensors the gradient flow reads, live at the peak, largest first; and the rest."""
    graph, analysis = ctx.graph, ctx.analysis
    shapes, split = analysis.shapes, analysis.split
    live = {ref for ref, _ in analysis.memory.live_at_peak.get(memory.DEVICE, [])}
    buffer_of = analysis.memory.buffer_of
    found, skipped = [], {}
    for name in graph.nodes():
        if name not in split.forward:
            continue
        for ref in shapes.outputs(name):
            readers = [v for v, _ in graph.consumers(ref) if v in split.gradient_flow]
            if not readers or ref not in buffer_of or buffer_of[ref].owner not in live:
                continue
            reason = _blocker(ctx, ref)
            if reason:
                skipped.setdefault(reason, []).append(str(ref))
            else:
                found.append(ref)
    found.sort(key=lambda r: (-(shapes.nbytes(r) or 0), str(r)))
    return found, {k: sorted(v) for k, v in sorted(skipped.items())}


def _blocker(ctx: policies.Context, ref: TensorRef) -> str | None:
    graph, info = ctx.graph, ctx.analysis.shapes[ref]
    op = graph.op(ref.node)
    if ref.node in ctx.constant:
        return "constant"
    if op in policies.PLACEHOLDER_OPS:
        return "graph input"
    if op in policies.VARIABLE_READ_OPS:
        return "variable read"
    if ref.node in ctx.in_loop_frame:
        return "inside a while-loop frame"
    if info is None or info.dtype % 100 not in SWAPPABLE_TYPES or info.dtype > 100:
        return "resource, variant, string or reference tensor"
    if (info.nbytes or 0) < MIN_BYTES:
        return "smaller than 1 KiB"
    return None


def _apply(ctx: policies.Context, refs: list[TensorRef], options: SwapOptions):
    """The graph with `refs` swapped, its shapes, the bytes moved each way, and the pads."""
    graph = ctx.graph.copy()
    analysis = ctx.analysis
    shapes = Shapes(dict(analysis.shapes.tensors))
    order = analysis.memory.order
    position = {n: i for i, n in enumerate(order)}
    seconds = _node_seconds(ctx, order)
    moved = 0
    for ref in refs:
        info = analysis.shapes[ref]
        device = graph.node_def(ref.node).device
        readers = sorted({v for v, _ in graph.consumers(ref)
                          if v in analysis.split.gradient_flow})
        suffix = ref.node if ref.port == 0 else f"{ref.node}_{ref.port}"
        out_name = graph.unique_name(suffix + SWAP_OUT_SUFFIX)
        in_name = graph.unique_name(suffix + SWAP_IN_SUFFIX)
        if options.form == "grappler":
            colocate = {"_class": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                s=[f"loc:@{ref.node}".encode()]))}
            dtype = {"T": attr_value_pb2.AttrValue(type=info.dtype)}
            graph.add_node(out_name, "_CopyFromGpuToHost", [ref], {**dtype, **colocate}, device)
            graph.add_node(in_name, "_CopyFromHostToGpu", [TensorRef(out_name)],
                           {**dtype, **colocate}, device)
        else:
            # Kept through Grappler, which would otherwise fold the pair away on a CPU-only
            # machine and regroup the backward arithmetic around it.
            attrs = {"T": attr_value_pb2.AttrValue(type=info.dtype),
                     "_grappler_do_not_remove": attr_value_pb2.AttrValue(b=True)}
            graph.add_node(out_name, "Identity", [ref], attrs, HOST_DEVICE)
            graph.add_node(in_name, "Identity", [TensorRef(out_name)], attrs, device)
        graph.replace_uses(ref, TensorRef(in_name), readers)
        trigger = _trigger(ctx.graph, analysis, order, position, seconds, readers,
                           (info.nbytes or 0) / options.bandwidth)
        if trigger:
            graph.add_control(trigger, in_name)
        for name in (out_name, in_name):
            shapes.tensors[TensorRef(name)] = TensorInfo(info.dtype, info.shape)
        moved += info.nbytes or 0
    pads = pad_readers(graph, ctx.graph, analysis, {})
    return graph, shapes, moved, pads


def _node_seconds(ctx: policies.Context, order: list[str]) -> dict[str, float]:
    """Modelled device time of each node (see DEVICE_FLOPS)."""
    graph, shapes = ctx.graph, ctx.analysis.shapes
    seconds = {}
    for name in order:
        traffic = sum(shapes.nbytes(r) or 0
                      for r in graph.data_inputs(name) + shapes.outputs(name))
        seconds[name] = NODE_OVERHEAD + max(flops.node_flops(graph, shapes, name) / DEVICE_FLOPS,
                                            traffic / DEVICE_BANDWIDTH)
    return seconds


def _trigger(original: Graph, analysis: Analysis, order, position, seconds, readers,
             transfer: float):
    """The latest gradient-flow node scheduled early enough for the copy to finish in time, and
    one whose new control output Grappler ignores."""
    first_use = min(position[r] for r in readers if r in position)
    elapsed = 0.0
    for index in range(first_use - 1, -1, -1):
        name = order[index]
        elapsed += seconds[name]
        if (name in analysis.split.gradient_flow and elapsed >= transfer
                and can_gate(original, name)):
            return name
    return None
