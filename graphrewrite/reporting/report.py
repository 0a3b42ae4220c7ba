"""The optimize report (plain data with stable keys) and `--explain`'s answer for one node."""

from __future__ import annotations

from ..analysis import optimizers, parameters
from ..analysis.memory import DEVICE
from ..core.graph import Graph
from ..core.names import AHEAD_SUFFIX, COPY_SUFFIX, PAD_PREFIX, SWAP_OUT_SUFFIX, TRIGGER_PREFIX
from ..core.tensor_ref import TensorRef
from ..passes import PASSES, chunk_loss
from ..passes.base import EXAMPLES, merged
from ..passes.recompute import RecomputeResult
from ..passes.swap import SwapResult
from ..pipeline.grammar import parse_pipeline
from ..pipeline.run import OptimizeResult
from .summary import floor_facts

__all__ = ["optimize_report", "explain"]



def optimize_report(source, output, fmt, result: OptimizeResult) -> dict:
    """The report's plain data: the run, its peaks, then every registered pass's section (an
    empty one for passes that did not run, so the keys are the same for every mode)."""
    sections = merged(result.results.get(name, entry.result()).section()
                      for name, entry in PASSES.items())
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
        "peak_bytes_as_run": dict(zip(("before", "after"), result.run_peaks)),
        "peak_bytes_predicted": {**dict(zip(("before", "after", "model"), result.predicted_peaks)),
                                 "device": result.predicted_on},
        "lossless_floor": _floor(result),
        "budget_bytes": result.budget,
        "budget_met": result.budget_met,
        "levers": result.levers,
        **sections,
        "note": _note(result),
        "seconds": round(result.seconds, 3),
    }


def explain(result: OptimizeResult, original: Graph, name: str) -> str:
    """One sentence on why `name`'s output was kept or recomputed."""
    recompute, swap = result.of(RecomputeResult), result.of(SwapResult)
    graph = result.graph
    if name in recompute.recomputed:
        copy = name + COPY_SUFFIX
        readers = sorted({v for v, _ in graph.consumers(copy)
                          if not v.endswith(COPY_SUFFIX) and not v.startswith(PAD_PREFIX)})
        gate = next((n for n in graph.nodes() if n.startswith(TRIGGER_PREFIX)
                     and n in graph.control_inputs(copy)), None)
        when = f", after trigger {gate}" if gate else ""
        return (f"{name}: recomputed as {copy}{when}; backward readers: "
                f"{', '.join(readers[:EXAMPLES]) or 'none'}"
                + (" ..." if len(readers) > EXAMPLES else ""))
    if name in swap.swapped:
        out = next(v for v, _ in graph.consumers(TensorRef(name)) if v.endswith(SWAP_OUT_SUFFIX))
        back = next(w for w, _ in graph.consumers(TensorRef(out)))
        gate = graph.control_inputs(back)
        return (f"{name}: swapped to host memory as {out}, back as {back}"
                + (f" after trigger {gate[0]}" if gate else ""))
    if name in recompute.recomputed_ahead:
        return (f"{name}: a checkpoint, computed again ({name}{AHEAD_SUFFIX}) when "
                "back-propagation reaches the first segment that reads it, instead of held "
                "from the forward pass")
    if name in recompute.checkpoints:
        return f"{name}: kept (a checkpoint chosen by mode {result.mode})"
    if recompute.reuse_ahead and name + AHEAD_SUFFIX in graph:
        return (f"{name}: recomputed ahead as {name}{AHEAD_SUFFIX}, with the checkpoints "
                "recomputed ahead, and read from there by back-propagation")
    for reason, nodes in recompute.kept_because.items():
        if name in nodes:
            return f"{name}: kept, it cannot be recomputed ({reason})"
    for reason, tensors in swap.skipped.items():
        if name in tensors:
            return f"{name}: not swapped ({reason})"
    if name not in original:
        return f"{name}: not a node of the input graph"
    if recompute.recomputed or swap.swapped:
        return (f"{name}: left alone (the backward pass reads none of its outputs worth "
                "recomputing (none, or only small ones: side outputs, scalars), or it is "
                "backward itself)")
    return f"{name}: left alone ({_note(result) or 'mode ' + result.mode + ' rewrote nothing'})"


def _floor(result: OptimizeResult) -> dict | None:
    """The original's `floor_facts`, on the model `predicted_peaks` compares (as run where it
    can: the kernels Grappler runs, their scratch as the allocator holds it)."""
    report = result.run_reports[0] if result.predicted_peaks[2] == "as_run" else \
        getattr(result.analyses[0], "memory", None)
    return None if report is None else floor_facts(report)


LITTLE = 0.05  # a saving under this share is worth explaining


def _note(result: OptimizeResult) -> str:
    """What the passes say they did not do, in the order they ran, and whether the rewrite is
    kept although the step as run (what `verify` measures) needs more memory."""
    dropped = result.dropped_run
    notes = [r.note for r in result.results.values()] + [
        result.reverted, dropped and _peak_as_run(dropped, dropped.allocated_peak()),
        _levers(result), _lean_diet(result), _little_as_run(result), _swap_on_a_cpu(result),
        _loops_unseen_as_written(result)]
    before, after = result.run_peaks
    if result.changed and before and after is not None and after > before:
        where = _peak_as_run(result.run_reports[1], after)
        by = f" by {(after - before) / 1024:.1f} KiB" if after - before < 2**20 / 10 else ""
        notes.append(f"the rewrite is kept although its modelled peak as run rises{by} "
                     f"({_mib(before)} -> {_mib(after)}, after Grappler): the passes plan on "
                     f"the step as written ({_mib(result.peak_before)} -> "
                     f"{_mib(result.peak_after)})" + (f"; {where}" if where else ""))
    return "; ".join(filter(None, notes))


def _lean_diet(result: OptimizeResult) -> str:
    """A budget met with diet's lean default, which drops Adam's first moment: of the lossy
    levers the one that changes training most. The zoo's ResNet-50 (Adam, `--budget 25%
    --lossy`, 0.26x measured) ended 20 steps on 4 batches at 3x its original's loss, and 50
    steps far below it (0.002 against 0.665); the zoo's transformer ended 1.4% over."""
    chosen = next((row for row in result.levers if row.get("chosen")), None)
    if chosen is None or not any(name == "diet" and options.get("momentum", "drop") == "drop"
                                 for lever in chosen["levers"]
                                 for name, options in parse_pipeline(lever)):
        return ""
    met = "is met" if result.budget_met else "is approached"  # out of reach: its lowest peak
    return (f"the budget {met} by dropping the optimizer's first moment (diet's lean default), "
            "the lossy lever that changes training most (a ResNet-50's loss was 3x its "
            "original's after 20 steps, below it after 50): check the rewrite with verify "
            "--steps 50 --batches 4, or give a higher budget")


UNSEEN = 1.5  # the step as run this far over the step as written: the notes' shares mislead


def _loops_unseen_as_written(result: OptimizeResult) -> str:
    """The original as run peaks far over the step as written the passes plan on, whose
    function calls hold loops: as written a call counts by what it returns, so the shares of
    the peak the notes give leave the loops' values out. A speech step built outside the repo
    (two bidirectional LSTMs in Keras's calls) planned on 16.9 MiB, its peak as run 48.1 (72-89
    measured): the note said the variables, 7.2 MiB, hold it, and advised diet."""
    before, written = result.run_peaks[0], result.peak_before
    if not before or not written or before < UNSEEN * written or result.graph is None \
            or not any(node.op in ("While", "StatelessWhile")
                       for f in result.graph.shell.library.function for node in f.node_def):
        return ""
    state = result.run_reports[0].persistent_bytes.get(DEVICE, 0)
    return (f"as run (after Grappler, each call's loops inlined) the original peaks at "
            f"{_mib(before)}, {before / written:.1f}x the {_mib(written)} the passes plan on, "
            f"where a function call's loops count only by what the call returns, so shares of "
            f"that peak leave them out: the variables hold {_mib(state)} of the peak as run "
            f"({state / before:.0%})")


def _swap_on_a_cpu(result: OptimizeResult) -> str:
    """Swapped tensors, and TensorFlow sees no GPU here: what `verify` will measure."""
    if not result.of(SwapResult).swapped:
        return ""
    from ..execution import measure

    if "GPU" in measure.compute_device():
        return ""
    return ("the saving swapping models is of a device with memory of its own (a GPU); on this "
            "CPU-only machine host and device are one memory, so verify measures no fall here, "
            "and may measure a rise: the copies' buffers are new allocations (a ConvNeXt "
            "step built outside the repo: +12.5%)")


def _little_as_run(result: OptimizeResult) -> str:
    """A rewrite that lowers the step as written by 5% or more but as run (what `verify`
    measures) by under half as much: what holds the peak as run, and the kernel scratch at it
    (the CPU's convolution gradients' column buffers: about 30 MiB in a small CNN, which no
    rewrite moves). A Keras U-Net's rewrite saved 50% as written and 19% as run, unexplained."""
    before, after = result.run_peaks
    if not result.changed or not before or after is None or after > before \
            or result.peak_after > (1 - LITTLE) * result.peak_before \
            or 1 - after / before >= (1 - result.peak_after / result.peak_before) / 2:
        return ""
    where = _peak_as_run(result.run_reports[1], after)
    return (f"as written it saves {1 - result.peak_after / result.peak_before:.0%}, as run "
            f"(after Grappler) {1 - after / before:.0%}: {where}" if where else "")


def _peak_as_run(report, peak: int) -> str:
    """Where a modelled step as run peaks, and what of the `peak` is not live tensors when it
    is 5% or more of it: the kernel scratch there (the CPU's convolution gradients' column
    buffers, cuDNN's workspace), and the allocator's padding (on that U-Net, a 36 MiB column
    buffer was given a 67 MiB free chunk whole)."""
    at = report.allocated_peak_at()
    if at is None:
        return ""
    node, scratch = at
    held = (f"; {_mib(scratch)} of it is that kernel's scratch, which no rewrite moves (on a "
            "GPU, cuDNN's workspace takes its place)" if scratch >= LITTLE * peak else "")
    live = report.timeline[report.order.index(node)] if report.timeline else peak - scratch
    if peak - live - scratch >= LITTLE * peak:
        held += (f"; {_mib(peak - live - scratch)} of it is allocator padding (TensorFlow's "
                 "allocator hands out a free chunk whole when it is under twice the request)")
    return f"the peak as run is at {node} ({_mib(peak)}){held}"


def _levers(result: OptimizeResult) -> str:
    """With a budget the passes did not reach: the levers this run did not use, which go
    lower (issue 34: below what the allowed levers reach, say which would go further)."""
    if result.budget_met is not False:
        return ""
    ran = set(result.results) | {lever.split("(")[0] for row in result.levers
                                 for lever in row["levers"]}
    levers = []
    if "swap" not in ran:
        levers.append("moving what is kept to host memory (--swap-checkpoints, or --mode "
                      "swap), where the device has one")
    # Named only where they apply: a cross entropy of a projection's large logits, an optimizer
    # update diet reads or a frozen graph's constants (a SimCLR step's similarity logits and
    # Nadam have neither).
    rewritten = result.analyses[1]
    if "chunk_loss" not in ran and rewritten is not None and \
            chunk_loss.chunkable(result.graph, rewritten, chunk_loss.ChunkLossOptions())[0]:
        levers.append("computing a softmax cross entropy's logits a block of rows at a time "
                      "(--lossy)")
    if "diet" not in ran and (optimizers.updates(result.graph)
                              or not parameters.variables(result.graph)):  # its constants
        levers.append("16-bit parameters and optimizer state (--lossy with --budget, or "
                      "--mode diet)")
    peak = result.predicted_peaks[1] if result.budget_of == "predicted" else result.peak_after
    floor = _floor(result)
    below = (f"; the budget is under the lossless floor of {_mib(floor['bytes'])}: the "
             f"variables and constants, {_mib(floor['state_bytes'])}, and the fed inputs "
             f"beside {floor['at']}'s operands and scratch, which no lossless rewrite lowers"
             if floor and floor["at"] and result.budget < floor["bytes"] else "")
    return (f"budget {_mib(result.budget)} not met ({_mib(peak)} modelled){below}"
            + ("; levers not used here that go lower: " + "; ".join(levers) if levers else ""))


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"
