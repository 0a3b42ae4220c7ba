"""The largest batch that fits a device's memory, for a graph exported with an unknown batch
dimension (`inspect --device-memory`, and `optimize`'s report for the rewritten graph).

Every fed input whose first dimension is unknown is the batch. The step is modelled at batch
sizes doubling from 1, then bisected, each time with those inputs fixed (shape inference
again: a few seconds a probe) and its peak taken as the allocator's (`memory`'s BFC replay of
the schedule), of the step as TensorFlow runs it (after Grappler: a Grappler run a probe) or,
without `as_run`, as written. The two can be far apart: a Keras transformer of unknown batch
modelled 253.5 MiB as written at batch 53 and 176.5 MiB as run, which TensorFlow measured
(176.5); within 200 MiB the as-written search answered 50, the as-run one 60 (measured 194.6
MiB; README). The answer is the largest batch whose modelled peak is within the limit; the
next one up is not. A rewrite keeps its structure at every batch size (copies and triggers do
not depend on it), so the rewritten graph is probed the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from ..analysis import bind, parameters
from ..analysis import shapes as shapes_mod
from ..analysis import step as analysis_mod
from ..analysis.step import AnalysisOptions
from ..core.errors import GraphRewriteError
from ..core.once import each_warning_once
from ..core.graph import Graph
from ..core.ops import PLACEHOLDER_OPS
from ..core.tensor_ref import TensorRef

__all__ = ["CAP", "Fit", "batch_inputs", "largest_batch"]

log = logging.getLogger(__name__)

CAP = 1 << 20  # the largest batch tried


@dataclass
class Fit:
    """The largest batch within `limit` bytes, its modelled peak and the next batch's."""

    limit: int
    batch: int                # 0: not even one example fits
    peak_bytes: int           # at `batch` (at 1 when nothing fits)
    next_peak_bytes: int | None  # at `batch + 1` (None at the cap)
    inputs: list[str] = field(default_factory=list)  # the inputs whose first dimension varied
    model: str = "as_run"     # the step probed: as_run (after Grappler) or as_written
    device: str = "gpu"       # whose allocator and kernel scratch: gpu or cpu

    def to_json(self) -> dict:
        return {"device_memory": self.limit, "batch": self.batch, "peak_bytes": self.peak_bytes,
                "next_peak_bytes": self.next_peak_bytes, "inputs": self.inputs,
                "model": self.model, "device": self.device}


def batch_inputs(graph: Graph, shapes: shapes_mod.Shapes) -> dict[str, tuple]:
    """Fed inputs (placeholders other than a TF2 step's captured variables) whose first
    dimension is unknown, with their shapes; an error for one with another unknown dimension
    (the batch alone is searched)."""
    found = {}
    for name in graph.nodes():
        if graph.op(name) not in PLACEHOLDER_OPS or parameters.is_variable(graph, name) or \
                bind.is_resource_placeholder(graph.node_def(name)):
            continue
        info = shapes[TensorRef(name)]
        if info is None or info.shape is None or not info.shape or info.shape[0] is not None:
            continue
        if None in info.shape[1:]:
            dims = ",".join("?" if d is None else str(d) for d in info.shape)
            raise GraphRewriteError(f"input '{name}' ({dims}) has unknown dimensions besides "
                                    "the first: give them with ${input_shapes}, the batch "
                                    "left unknown")
        found[name] = tuple(info.shape)
    return found


def largest_batch(model, limit: int, graph: Graph | None = None,
                  analysis: AnalysisOptions | None = None, as_run: bool = True) -> Fit:
    """The largest batch whose modelled step peak is within `limit` bytes (see the module's
    docstring), analysed as `analysis` says, on a device of its kind (its allocator and kernel
    scratch: by default a GPU's, one region of device memory), as run unless `as_run` is
    False or Grappler cannot process the graph. Its `input_shapes` fix other unknown
    dimensions; their first dimension is the batch too."""
    graph = graph or model.graph
    analysis = analysis or AnalysisOptions()
    input_shapes, fetches = analysis.input_shapes, analysis.fetches
    device = analysis.device or "gpu"
    base = shapes_mod.infer(graph, {k: (None, *v[1:]) for k, v in (input_shapes or {}).items()})
    inputs = batch_inputs(graph, base)
    if not inputs:
        raise GraphRewriteError("${device_memory}: no input has an unknown batch dimension, so "
                                "the step's peak does not depend on a batch size")
    peaks: dict[int, int] = {}
    probed = {"model": "as_run" if as_run else "as_written"}

    def peak(batch: int) -> int:
        nonlocal fetches
        if batch not in peaks:
            fixed = {name: (batch, *shape[1:]) for name, shape in inputs.items()}
            found = analysis_mod.analyse(model, graph, dataclasses.replace(
                analysis, input_shapes=fixed, fetches=fetches, device=device),
                planned=fetches is None)
            fetches = found.fetches  # the step's own, found once
            run = analysis_mod.as_run(model, graph, found) if as_run else None
            if as_run and run is None:
                probed["model"] = "as_written"  # Grappler failed: every probe as written
            peaks[batch] = (run or found.memory).allocated_peak()
            log.info("batch %d: modelled peak %d bytes", batch, peaks[batch])
        return peaks[batch]

    with each_warning_once():
        found = _search(limit, peak)
    return dataclasses.replace(found, inputs=sorted(inputs), model=probed["model"],
                               device=device)


def _search(limit: int, peak) -> Fit:
    """Doubling, then bisection, over `peak` (batch -> modelled bytes)."""
    if peak(1) > limit:
        return Fit(limit, 0, peak(1), peak(1))
    low = 1  # fits
    while low * 2 <= CAP and peak(low * 2) <= limit:
        low *= 2
    high = min(low * 2, CAP + 1)  # does not fit (or past the cap)
    while high - low > 1:
        middle = (low + high) // 2
        if peak(middle) <= limit:
            low = middle
        else:
            high = middle
    following = peak(low + 1) if low < CAP else None
    return Fit(limit, low, peak(low), following)
