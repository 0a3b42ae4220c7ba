"""The optimize report (plain data with stable keys) and `--explain`'s answer for one node."""

from __future__ import annotations

from .graph import Graph
from .names import AHEAD_PREFIX, COPY_PREFIX, PAD_PREFIX, SWAP_OUT_SUFFIX, TRIGGER_PREFIX
from .pipeline import OptimizeResult
from .tensor_ref import TensorRef

EXAMPLES = 3
NOTES = ("recompute", "swap", "accumulate", "relax_assign")  # what each pass says it did not do


def optimize_report(source, output, fmt, result: OptimizeResult) -> dict:
    stats = result.stats
    kept_because = stats.get("kept_because", {})
    return {
        "input": str(source),
        "output": str(output),
        "format": str(fmt),
        "mode": result.mode,
        "pipeline": result.pipeline,
        "nodes_before": result.nodes_before,
        "nodes_after": result.nodes_after,
        "nodes_added": result.nodes_after - result.nodes_before,
        "peak_bytes": {"before": result.peak_before, "after": result.peak_after},
        "checkpoints": stats.get("checkpoints", []),
        "recomputed": stats.get("recomputed", []),
        "recomputed_ahead": stats.get("recomputed_ahead", []),
        "triggers": stats.get("triggers", 0),
        "ungated_segments": stats.get("ungated_segments", 0),
        "fanout_pads": stats.get("fanout_pads", 0),
        "extra_flops": stats.get("extra_flops", 0),
        "skipped": {reason: {"count": len(nodes), "examples": nodes[:EXAMPLES]}
                    for reason, nodes in {**kept_because,
                                          **stats.get("swap_skipped", {})}.items()},
        "swapped": stats.get("swapped", []),
        "bytes_moved": stats.get("bytes_moved", 0),
        "transfer_seconds": stats.get("transfer_seconds", 0.0),
        "accumulated": stats.get("accumulated", []),
        "relaxed_assigns": stats.get("relaxed_assigns", []),
        "note": _note(stats),
        "seconds": round(result.seconds, 3),
    }


def explain(result: OptimizeResult, original: Graph, name: str) -> str:
    """One sentence on why `name`'s output was kept or recomputed."""
    stats = result.stats
    graph = result.graph
    if name in stats.get("recomputed", []):
        copy = next(n for n in graph.nodes() if n.startswith(COPY_PREFIX)
                    and n[len(COPY_PREFIX):] == name)
        readers = sorted({v for v, _ in graph.consumers(copy)
                          if not v.startswith((COPY_PREFIX, PAD_PREFIX))})
        gate = next((n for n in graph.nodes() if n.startswith(TRIGGER_PREFIX)
                     and n in graph.control_inputs(copy)), None)
        when = f", after trigger {gate}" if gate else ""
        return (f"{name}: recomputed as {copy}{when}; backward readers: "
                f"{', '.join(readers[:EXAMPLES]) or 'none'}"
                + (" ..." if len(readers) > EXAMPLES else ""))
    if name in stats.get("swapped", []):
        out = next(v for v, _ in graph.consumers(TensorRef(name)) if v.endswith(SWAP_OUT_SUFFIX))
        back = next(w for w, _ in graph.consumers(TensorRef(out)))
        gate = graph.control_inputs(back)
        return (f"{name}: swapped to host memory as {out}, back as {back}"
                + (f" after trigger {gate[0]}" if gate else ""))
    if name in stats.get("recomputed_ahead", []):
        return (f"{name}: a checkpoint, computed again ({AHEAD_PREFIX}{name}) when "
                "back-propagation reaches the first segment that reads it, instead of held "
                "from the forward pass")
    if name in stats.get("checkpoints", []):
        return f"{name}: kept (a checkpoint chosen by mode {result.mode})"
    for reason, nodes in stats.get("kept_because", {}).items():
        if name in nodes:
            return f"{name}: kept, it cannot be recomputed ({reason})"
    for reason, tensors in stats.get("swap_skipped", {}).items():
        if name in tensors:
            return f"{name}: not swapped ({reason})"
    if name not in original:
        return f"{name}: not a node of the input graph"
    if stats.get("recomputed") or stats.get("swapped"):
        return (f"{name}: left alone (the backward pass does not read it, or it is backward "
                "itself)")
    return f"{name}: left alone ({_note(stats) or 'mode ' + result.mode + ' rewrote nothing'})"


def _note(stats: dict) -> str:
    return " ".join(filter(None, (stats.get(key, "") for key in NOTES)))
