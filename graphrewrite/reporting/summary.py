"""What `inspect` reports about a model: a plain dict with stable keys (documented in the README)."""

from __future__ import annotations

from ..analysis import parameters
from ..analysis.memory import DEVICE, HOST, HOST_BANDWIDTH
from ..analysis.step import Analysis
from ..core.graph import Graph, op_histogram
from ..core.io import Model
from ..core.ops import FUNCTIONAL_CONTROL_OPS, PLACEHOLDER_OPS, V1_LOOP_OPS
from ..core.text import dtype_name, format_shape

__all__ = ["summarize", "memory_facts", "floor_facts"]


def summarize(model: Model, outputs: list[str]) -> dict:
    """Counts, inputs, `outputs` (what one step fetches, `Analysis.fetches`), control flow and
    variables of the model's graph."""
    graph = model.graph
    histogram = op_histogram(graph)
    meta = model.meta_graph
    return {
        "file": str(model.path),
        "format": str(model.format),
        "nodes": len(graph),
        "ops": dict(sorted(histogram.items())),
        "inputs": [_placeholder(graph, n) for n in sorted(graph.nodes())
                   if graph.op(n) in PLACEHOLDER_OPS and not parameters.is_variable(graph, n)],
        "outputs": sorted(outputs),
        "train_op": _collection_nodes(meta, "train_op"),
        "signatures": _signatures(meta),
        "functions": len(graph.shell.library.function),
        "control_flow": {
            "v1_loop_nodes": sum(histogram[op] for op in V1_LOOP_OPS),
            "functional": sorted(op for op in FUNCTIONAL_CONTROL_OPS if histogram[op] or op in {
                n.op for f in graph.shell.library.function for n in f.node_def}),  # calls' too
        },
        "variables": sorted(parameters.variables(graph)),
        "warnings": list(model.warnings),
    }


def memory_facts(analysis: Analysis, top: int = 10, as_run=None) -> dict:
    """The memory-model keys of `inspect --json`: the step as TensorFlow runs it (`as_run`, the
    graph after Grappler) when given, else as written; `peak_bytes_as_written` either way. Peaks
    are the allocator's (`MemoryReport.allocated_peak`); `live_peak_bytes` is the tensors'."""
    report = as_run or analysis.memory
    unknown = [r for r in analysis.memory.unknown if r not in set(analysis.sized_by_data)]
    return {
        "peak_bytes": report.allocated_peak(DEVICE),
        "live_peak_bytes": report.peak(DEVICE),
        "peak_bytes_as_written": analysis.memory.allocated_peak(DEVICE),
        # a loop's iterations racing ahead of the sums it carries (`loops._lagging_sums`)
        "peak_bytes_bound": report.allocated_peak_bound(DEVICE),
        "modelled_as": "run" if as_run else "written",
        "modelled_on": "gpu" if report.accelerator else "cpu",  # its scratch and allocator
        "host_peak_bytes": report.peak(HOST),
        "bytes_moved": report.transfer_bytes,
        "transfer_seconds": report.transfer_bytes / HOST_BANDWIDTH,
        "persistent_bytes": report.persistent_bytes.get(DEVICE, 0),
        "peak_node": report.peak_node.get(DEVICE, ""),
        "lossless_floor": floor_facts(report),
        "live_at_peak": [{"tensor": str(ref), "bytes": size}
                         for ref, size in report.live_at_peak.get(DEVICE, [])[:top]],
        "forward_nodes": len(analysis.split.forward),
        "backward_nodes": len(analysis.split.backward),
        "gradient_seeds": list(analysis.split.seeds),
        "flops": analysis.flops,
        "fetches": analysis.fetches,
        "unknown_shapes": {"count": len(unknown), "examples": [str(r) for r in unknown[:5]],
                           "hint": analysis.unknown_hint},
        "sized_by_data": {"count": len(analysis.sized_by_data),
                          "examples": [str(r) for r in analysis.sized_by_data[:5]]},
        "estimated_sizes": {"count": len(analysis.shapes.estimated),
                            "examples": analysis.shapes.estimated[:5]},
    }


def floor_facts(report) -> dict:
    """`MemoryReport.floor` as plain data: the bytes no lossless rewrite goes below, the
    constants' and variables' share of them, and the kernel whose operands and scratch are
    the rest."""
    total, node = report.floor()
    return {"bytes": total, "state_bytes": report.persistent_bytes.get(DEVICE, 0), "at": node}


def _placeholder(graph: Graph, name: str) -> dict:
    attrs = graph.node_def(name).attr
    return {"name": name,
            "dtype": dtype_name(attrs["dtype"].type) if "dtype" in attrs else "?",
            "shape": format_shape(attrs["shape"].shape) if "shape" in attrs else "<?>"}


def _collection_nodes(meta, key: str) -> list[str]:
    if meta is None or key not in meta.collection_def:
        return []
    return list(dict.fromkeys(meta.collection_def[key].node_list.value))


def _signatures(meta) -> dict:
    if meta is None:
        return {}
    return {key: {"inputs": {k: sig.inputs[k].name for k in sorted(sig.inputs)},
                  "outputs": {k: sig.outputs[k].name for k in sorted(sig.outputs)}}
            for key, sig in sorted(meta.signature_def.items())}
