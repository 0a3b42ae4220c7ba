"""`optimize`: run a pipeline (text, `grammar`) on a loaded model.

Analyses are recomputed between passes, so each pass sees the graph as the previous one left it.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..analysis import bind, fusions, memory, parameters
from ..analysis import step as analysis_mod
from ..analysis.step import AnalysisOptions
from ..core.errors import GraphError, GraphRewriteError, PassError
from ..core.graph import Graph
from ..core.io import Model
from ..passes import PASSES, running_sums
from ..passes.base import PassResult
from ..planning.budget import parse_budget
from . import importable
from . import plan as plan_mod
from .grammar import compose, format_pipeline, parse_pipeline, pass_options

__all__ = ["OptimizeResult", "AUTOMATIC_MODES", "AS_RUN_SLACK", "WRITTEN_GAIN", "optimize",
           "rises_as_run"]

log = logging.getLogger(__name__)


@dataclass
class OptimizeResult:
    graph: Graph
    mode: str
    pipeline: str
    nodes_before: int
    nodes_after: int
    peak_before: int
    peak_after: int
    seconds: float
    results: dict[str, PassResult] = field(default_factory=dict)  # pass -> what it did
    run_reports: tuple = (None, None)  # (before, after) memory reports of the steps as
    # TensorFlow runs them, after Grappler (None where Grappler failed)
    reverted: str = ""  # why the passes' rewrite was dropped (it rose as run)
    serialized: bytes | None = None  # the binary GraphDef the import check read, if it did
    budget: int | None = None  # the modelled peak the passes were asked to reach, in bytes
    analyses: tuple = (None, None)  # (original, rewritten) steps as written (`analysis.step`)
    levers: list = field(default_factory=list)  # the lever sets a budget tried (`levers.fit`)
    budget_of: str = "as_written"  # the peak `budget` is for: or "predicted" (`levers.fit`)
    dropped_run: object = None  # the dropped rewrite's memory report as run (`reverted`)

    @property
    def budget_met(self) -> bool | None:
        """Whether the rewritten step as written (what the passes plan on; the predicted peak
        where `budget_of` says so) is within the budget; None without one."""
        if self.budget is None:
            return None
        return (self.predicted_peaks[1] if self.budget_of == "predicted"
                else self.peak_after) <= self.budget

    @functools.cached_property  # each replays two steps through the allocator's model
    def run_peaks(self) -> tuple:
        """(before, after) allocator peaks of `run_reports`."""
        return tuple(None if r is None else r.allocated_peak() for r in self.run_reports)

    @property
    def predicted_peaks(self) -> tuple[int, int, str]:
        """(before, after, model): the peaks `verify` should measure. The steps as run (after
        Grappler, as TensorFlow's allocator counts them: model "as_run") where both were
        modelled, else as written (what the passes plan on: "as_written")."""
        before, after = self.run_peaks
        if before and after is not None:
            return before, after, "as_run"
        return self.peak_before, self.peak_after, "as_written"

    @property
    def predicted_on(self) -> str | None:
        """The device kind the steps as run were modelled on ("cpu", "gpu"), None as written: a
        swap is modelled on a device with memory of its own, the original with it (`_as_run`)."""
        if self.predicted_peaks[2] != "as_run":
            return None
        return "gpu" if getattr(self.run_reports[0], "accelerator", False) else "cpu"

    @property
    def changed(self) -> bool:
        """Whether any pass changed the graph."""
        return any(r.modified for r in self.results.values())

    def of(self, kind: type[PassResult]):
        """The result of the pass that returns `kind` (its runs combined), else an empty one."""
        return next((r for r in self.results.values() if isinstance(r, kind)), kind())


# Modes whose passes choose what to rewrite: their rewrite is dropped if the step as run
# (after Grappler, what `verify` measures) needs more memory. Not when it merely stays level:
# as run on this machine's kind of device, a small step's peak is often a convolution's
# scratch, which the same rewrite does lower on another device. Diet too: a triplet network
# built outside the repo, four small kernels stored 16-bit, modelled 13% higher as run and
# measured 22% higher.
AUTOMATIC_MODES = frozenset({"memory", "speed", "swap", "diet"})


# A rewrite's peak as run within the memory model's accuracy (its target, ±10% of the measured
# peak) above the original's is no rise: on a CPU the model runs two threads taking turns, a
# race it resolves one way. A 2 MiB MLP step's rewrite modelled 6% higher measured 0.86x, an
# EfficientNet step's modelled 8% higher measured 0.95x.
AS_RUN_SLACK = 0.10
# The loop passes, which keep each change only where the modelled step as run falls, and the
# inline pass they read the calls through: their rewrite stands alone when the whole
# pipeline's is dropped and it does not raise the step as run itself (a hand-written RNN's
# serial gradient loop, lost with two deferred zeros that raised its step as run by 3%).
CHECKED_AS_RUN = ("inline", "loop_recompute", "rerun")
# A rewrite lowering the step as written by less than this has no gain for the slack to protect:
# a hand-written RNN's only change, two deferred zeros, modelled 3% higher as run measured 1.05x.
WRITTEN_GAIN = 0.01


def rises_as_run(run_reports: tuple, written: tuple[int, int]) -> bool:
    """Whether both steps were modelled as run and the rewrite's peak is higher: by more than
    AS_RUN_SLACK where it lowers the step as written (`written`: before, after) by
    WRITTEN_GAIN, else at all. Modelled on a GPU (a swap's steps), at all: one kernel runs
    after another there, no race for the slack to cover (a CNN's swap built outside the repo
    was kept at 31.4 -> 31.7 MiB on the GPU it is for)."""
    before, after = run_reports
    if before is None or after is None:
        return False
    gains = written[1] < written[0] * (1 - WRITTEN_GAIN) and not after.accelerator
    return after.allocated_peak() > before.allocated_peak() * (1 + AS_RUN_SLACK * gains)


def optimize(model: Model, mode: str, analysis: AnalysisOptions | None = None,
             composed: str | None = None, plan: dict | None = None, as_run: bool = True,
             progress: Callable[[str], None] | None = None, automatic: bool | None = None,
             **options) -> OptimizeResult:
    """Run the pipeline `composed` (by default `compose(mode, **options)`) on a copy of the
    model's graph, analysed as `analysis` says (and each rewrite with the fetches found for the
    original); with `as_run`, also model both steps as TensorFlow runs them (after
    Grappler: about a third of the time on large graphs, for the report only). `progress` is
    told each stage as it begins (a minute of work on a 100k-node graph). `automatic`: the
    passes are the mode's (by default, when no `composed` text is given), so their rewrite is
    dropped if the step as run models higher than the original's (`AUTOMATIC_MODES`).

    A budget that is a share is of the original's modelled peak, for every pass alike. A pass
    that raises (other than a GraphRewriteError about the input; a GraphError, a node looked up
    or changed wrongly, is the pass's own) or leaves a graph
    `check()` rejects is a PassError naming it and the passes before it."""
    start = time.perf_counter()
    text = compose(mode, **options) if composed is None else composed
    if plan is not None:
        text = plan_mod.pipeline_of(plan)
    steps = [(name, pass_options(name, raw)) for name, raw in parse_pipeline(text)]
    stage = progress or (lambda text: None)
    graph = model.graph.copy()
    stage("analysing the step")
    found = analysis_mod.analyse(model, graph, analysis)
    if steps:
        _refuse_unshaped(graph, found)
    # The rewrites' analyses: the same options, the original's fetches.
    again = dataclasses.replace(found.options, fetches=found.fetches)
    peak_before = found.memory.peak()
    steps = [(name, _budget_in_bytes(opts, peak_before)) for name, opts in steps]
    original = found
    # No backward pass: nothing to rewrite, so no as-run model beside the passes (most of a
    # minute at 100k nodes); it is made after them only if a pass changed the graph anyway.
    backward = bool(found.split.seeds)
    # Grappler on the original runs beside the passes (it releases the GIL), unless the
    # inline pass may splice its calls: then it is the spliced step's (`_as_run`).
    grappled = (analysis_mod.start_as_run(model, model.graph, original)
                if as_run and backward and not model.graph.shell.library.function else None)
    try:
        graph, found, results, serialized, inlined = _run_passes(model, steps, found, again,
                                                                 stage, graph)
    except GraphRewriteError as err:
        if plan is None or isinstance(err, PassError):
            raise
        # a name the plan gives that no pass before its own made (`plan.load` let it pass)
        raise GraphRewriteError(f"${{plan}}: {err}") from None
    if as_run and plan is None:
        other = _reads_again(model, steps, results, graph, found, again, stage, analysis)
        if other is not None:
            steps, graph, found, results, serialized, inlined = other
            text = format_pipeline([(name, {**raw, "reads": steps[i][1].reads} if name == "diet"
                                     else raw) for i, (name, raw) in
                                    enumerate(parse_pipeline(text))])
    changed = any(r.modified for r in results.values())  # else Grappler's run repeats
    run_steps = (None, None)
    if as_run and (backward or changed):
        stage("modelling both steps as run (after Grappler)")
        run_steps = _as_run(model, inlined or (model.graph, original), grappled, graph, found,
                            changed)
    automatic = composed is None if automatic is None else automatic
    refused = _refused(run_steps) if automatic and plan is None and changed else []
    if refused and any(name == "recompute" for name, _ in steps):
        log.info("the rewrite changes how Grappler fuses %s (it would round differently): "
                 "planned again without copying them", ", ".join(refused))
        steps = [(name, _never_copied(opts, refused) if name == "recompute" else opts)
                 for name, opts in steps]
        # the pipeline that ran, so that its plan replays as planned (`optimize --plan`)
        text = format_pipeline([(name, {**raw, "pin_never": ",".join(filter(None, (
            raw.get("pin_never"), *refused)))} if name == "recompute" else raw)
            for name, raw in parse_pipeline(text)])
        analysed = model.graph.copy()
        graph, found, results, serialized, inlined = _run_passes(
            model, steps, analysis_mod.analyse(model, analysed, analysis), again, stage,
            analysed)
        changed = any(r.modified for r in results.values())
        run_steps = _as_run(model, inlined or (model.graph, original), run_steps[0], graph,
                            found, changed)
        refused = _refused(run_steps) if changed else []
    run_reports = tuple(None if step is None else step[2] for step in run_steps)
    if inlined is not None:
        peak_before = inlined[1].memory.peak()  # the step as the passes saw it, calls spliced
    reverted, kept = "", None
    if refused:
        reverted = (f"the rewrite makes Grappler fuse {refused[0]} otherwise than the original "
                    "step does, which rounds differently: graph left unchanged")
    elif automatic and plan is None and mode in AUTOMATIC_MODES and changed and \
            rises_as_run(run_reports, (peak_before, found.memory.peak())):
        before, after = (r.allocated_peak() for r in run_reports)
        written = found.memory.peak()
        lowers = ("lowers" if written < peak_before else "raises" if written > peak_before
                  else "does not lower")
        but = "and" if lowers == "raises" else "but"
        reverted = (f"the rewrite {lowers} the step as written ({_mib_apart(peak_before, written)}"
                    f" MiB) {but} raises it as TensorFlow runs it "
                    f"({_mib_apart(before, after)} MiB after Grappler): "
                    "graph left unchanged (--passes runs the same passes and keeps their "
                    "rewrite)")
        kept = _checked_alone(model, steps, results, (original, run_steps[0], peak_before),
                              analysis, again, stage)
        if kept is not None:
            graph, found, results, serialized, run_reports = kept
            reverted = ""
            names = ", ".join(name for name, _ in steps if name in CHECKED_AS_RUN)
            last = results[next(n for n, _ in reversed(steps) if n in CHECKED_AS_RUN)]
            last.note = "; ".join(filter(None, (
                last.note, f"only the rewrite of {names} kept: with the other passes' it "
                f"raised the step as TensorFlow runs it ({before / 2**20:.1f} -> "
                f"{after / 2**20:.1f} MiB after Grappler)")))
    dropped_run = None
    if reverted:
        graph, found, serialized = model.graph.copy(), original, None
        results = {name: type(r)(graph, False, note=r.note) for name, r in results.items()}
        dropped_run, run_reports = run_reports[1], (run_reports[0], run_reports[0])
    if not reverted and changed and run_steps[0] is not None:
        summed = _summed_as_original(model, run_steps[0][0], graph, found,
                                     run_steps[1] if kept is None else None, again)
        if summed is not None:
            graph, found, serialized, after, names = summed
            run_reports = run_reports[0], None if after is None else after[2]
            last = results[steps[-1][0]]
            which = names[0] if len(names) == 1 else f"{len(names)} sums ({names[0]}, ...)"
            last.note = "; ".join(filter(None, (last.note, (
                f"{which} written as Grappler runs it in the original step: a running sum, "
                "its terms added as they arrive (a sum adds them in another order)"))))
    budgets = [int(opts.budget) for _, opts in steps if getattr(opts, "budget", None)]
    result = OptimizeResult(graph, mode, text, len(model.graph), len(graph), peak_before,
                            found.memory.peak(), time.perf_counter() - start, results,
                            run_reports, reverted, serialized, min(budgets, default=None),
                            (original, found), dropped_run=dropped_run)
    if plan is not None:
        plan_mod.check_followed(plan, result, model.graph)
    return result


def _summed_as_original(model: Model, original_run: Graph, graph: Graph, found, rewritten_run,
                        again):
    """`graph` with the sums Grappler makes running sums of in the original step as run
    (`original_run`) and not in `graph`'s (`rewritten_run`, made here when None) written as
    those running sums (`passes.running_sums`), with its analysis, import check, step as run
    and the sums' names; None when there are none (without a Grappler call when the original
    has none, the common case)."""
    if not running_sums.running_sums(original_run):
        return None
    rewritten_run = rewritten_run or analysis_mod.as_run_step(model, graph, found)
    sums = {} if rewritten_run is None else \
        running_sums.missing(original_run, rewritten_run[0], graph)
    if not sums:
        return None
    graph = graph.copy()
    names = running_sums.make_running(graph, sums)
    log.info("summed %s as the original step as run sums them", ", ".join(names))
    found = analysis_mod.analyse(model, graph, again)
    serialized = importable.check(model, [("running_sums", [], graph)])
    return graph, found, serialized, analysis_mod.as_run_step(model, graph, found), names


def _refuse_unshaped(graph: Graph, found) -> None:
    """A TF2 step exported without shapes: its captured variables' sizes are nowhere, so the
    memory model counts them and most of what they make as 0 bytes, and a plan made on that
    means nothing (a CTC step built outside the repo: 120 of its 311 MiB seen, a plan of other
    checkpoints written, which verify then refused to run)."""
    blind = parameters.unknown_variables(graph, found.shapes)
    if blind and bind.export_hint(graph, blind[0]) == bind.EXPORT_HINT:
        raise GraphRewriteError(
            f"{len(blind)} captured variables (e.g. '{blind[0]}') have no recorded shape: the "
            f"step was exported without shapes, so its memory cannot be modelled; "
            f"{bind.EXPORT_HINT}")


def _mib_apart(before: int, after: int) -> str:
    """"before -> after" in MiB, with the decimals that tell them apart (an unrolled LSTM's
    rise read "44.7 -> 44.7")."""
    digits = 1
    while digits < 4 and f"{before / 2**20:.{digits}f}" == f"{after / 2**20:.{digits}f}":
        digits += 1
    return f"{before / 2**20:.{digits}f} -> {after / 2**20:.{digits}f}"


def _checked_alone(model: Model, steps: list, results: dict, original_steps: tuple, analysis,
                   again, stage):
    """The passes of `steps` that keep each change only where the step as run falls
    (`CHECKED_AS_RUN`), run again alone when the whole rewrite raised the step as run:
    (graph, analysis, results, serialized, run reports), the other passes' results unchanged
    and unmodified; None when they changed nothing or raise it too. `original_steps`: the
    original's analysis, its step as run and its peak as written."""
    original, original_run, peak_before = original_steps
    alone = [(name, opts) for name, opts in steps if name in CHECKED_AS_RUN]
    if not alone or len(alone) == len(steps) or not any(
            results[name].modified for name, _ in alone if name in results):
        return None
    analysed = model.graph.copy()
    graph, found, kept, serialized, _ = _run_passes(
        model, alone, analysis_mod.analyse(model, analysed, analysis), again, stage, analysed)
    run_steps = _as_run(model, (model.graph, original), original_run, graph, found, True)
    reports = tuple(None if step is None else step[2] for step in run_steps)
    if rises_as_run(reports, (peak_before, found.memory.peak())):
        return None
    results = {name: kept.get(name, type(r)(graph, False, note=r.note))
               for name, r in results.items()}
    return graph, found, results, serialized, reports


def _reads_again(model: Model, steps: list, results: dict, graph: Graph, found, again,
                 stage, analysis):
    """The pipeline run again with diet's forward reads in the other order, when diet priced
    the two orders and recomputation follows it: (steps, then `_run_passes`'s first four
    results) if that step peaks lower as run, else None. Diet prices them on its own rewrite,
    whose peak recomputation then lowers, and the dequantized copies' order matters more the
    lower it is (a 224x224 ResNet-50 with a 16-bit first moment: 346 MiB modelled ungated,
    chosen before recomputation, 314 gated; measured 347 and 309)."""
    names = [name for name, _ in steps]
    diet = results.get("diet")
    if diet is None or len(diet.read_peaks) != 2 or "recompute" not in \
            names[names.index("diet"):]:
        return None
    other = "ungated" if diet.forward_reads == "gated" else "gated"
    stage(f"pass diet again: its forward reads {other}, priced after the passes after it")
    swapped = [(name, dataclasses.replace(opts, reads=other) if name == "diet" else opts)
               for name, opts in steps]
    peaks = [_as_run_peak(model, graph, found)]  # each priced alone: two Grappler graphs of
    analysed = model.graph.copy()                # a ResNet-50 are gigabytes
    rerun = _run_passes(model, swapped, analysis_mod.analyse(model, analysed, analysis), again,
                        stage, analysed)
    peaks.append(_as_run_peak(model, *rerun[:2]))
    if None in peaks or peaks[1] >= peaks[0]:
        return None
    log.info("diet: forward reads %s after all: the step peaks at %.1f MiB as run, against "
             "%.1f MiB %s", other, peaks[1] / 2**20, peaks[0] / 2**20, diet.forward_reads)
    return (swapped, *rerun)


def _as_run_peak(model: Model, graph: Graph, found) -> int | None:
    """The allocator peak of `graph`'s step as run, its model's cycles collected at once (a
    ResNet-50's `--budget --lossy` held 17 GB without, 3.1 GB with)."""
    report = analysis_mod.as_run(model, graph, found)
    peak = None if report is None else report.allocated_peak()
    del report
    gc.collect()
    return peak


def _run_passes(model: Model, steps: list, found, again: AnalysisOptions, stage,
                analysed: Graph):
    """Run `steps` on a copy of `analysed` (a copy of the model's graph, analysed as `found`),
    each rewrite analysed again (`again`); check that TensorFlow imports what they made.
    Returns the last graph, its analysis, each pass's result (runs of one pass combined), what
    `importable.check` returns (the output's bytes as written, when it made them) and the
    step the inline pass made, with its analysis: the original as the passes see it (None
    without one that changed it). A copy
    of the analysed graph, not of the model's: it shares the topological order and the input
    lists the analysis cached (rebuilt for a fresh copy: 2 s at 99k nodes)."""
    graph = analysed.copy()
    results: dict[str, PassResult] = {}
    made = []  # (pass, the passes before it, its output graph), for `importable.check`
    inlined = None
    # after any rewrite, reads racing the updates as the original's schedule ordered them
    tail = [] if any(name == "reads_first" for name, _ in steps) else \
        [("reads_first", PASSES["reads_first"].options())]
    for index, (name, pass_opts) in enumerate(steps + tail):
        if index == len(steps) and not made:
            break
        before = [n for n, _ in steps[:index]]
        stage(f"pass {name}")
        try:
            result = PASSES[name].run(graph, found, pass_opts, model)
        except GraphError as err:  # a node the pass looked up or changed wrongly: its bug
            raise PassError(name, before, f"failed: {err}") from err
        except GraphRewriteError:
            raise
        except Exception as err:  # noqa: BLE001  (anything else is a bug in the pass)
            raise PassError(name, before, f"failed: {type(err).__name__}: {err}") from err
        earlier = name == "recompute" and not result.modified and result.note and list(
            dict.fromkeys(n for n, _, _ in made if n != "inline"))
        if earlier:  # recompute's note is of the step the passes before it made
            result.note = f"after {', '.join(earlier)} changed the step: {result.note}"
        unchanged = result.graph is graph and not result.modified  # checked when loaded
        problems = [] if unchanged else result.graph.check()
        if problems:
            raise PassError(name, before, f"left an invalid graph: {problems[0]}")
        results[name] = results[name].then(result) if name in results else result
        if result.modified:
            graph = result.graph
            made.append((name, before, graph))
            found = analysis_mod.analyse(model, graph, again, shapes=result.shapes,
                                         planned=index < len(steps) - 1,  # a pass follows
                                         report=result.memory)
            if name == "inline":  # the original as the passes see it (a SavedModel's step, one
                # call node as written, models a fraction of it)
                inlined = graph, found
    serialized = None
    if made:  # nothing is written that TensorFlow cannot import or its init ops initialise
        stage("checking that TensorFlow imports the rewritten graph")
        serialized = importable.check(model, made)
    return graph, found, results, serialized, inlined


def _budget_in_bytes(opts, peak_before: int):
    """A pass's options with its budget in bytes: a share is of the original's modelled peak,
    for every pass alike (not of the peak the passes before it left)."""
    if not getattr(opts, "budget", None):
        return opts
    return dataclasses.replace(opts, budget=str(max(1, parse_budget(opts.budget, peak_before))))


def _as_run(model: Model, base: tuple, before, graph: Graph, found, changed: bool) -> tuple:
    """(before, after) steps as run (`analysis.as_run_step`, None where Grappler failed).
    `base`: the original as the passes saw it (its graph, calls spliced where the inline pass
    spliced them, and analysis: left to Grappler, a SavedModel's call bodies' recorded shapes
    disagreed with what Grappler made of them, and an EfficientNetV2 step modelled 69 MiB
    where it holds 273). `before`: the original's step as run, made (a tuple), begun earlier
    (a Future) or not yet (None)."""
    started = analysis_mod.start_as_run(model, graph, found) if changed else None
    original = base[1]
    if not isinstance(before, tuple):
        before = analysis_mod.as_run_step(model, *base, before)
    after = analysis_mod.as_run_step(model, graph, found, started) if changed else before
    if before is not None and after is not before and original.options.device is None \
            and memory.cpu_is_host(graph) and not memory.cpu_is_host(model.graph):
        # The rewrite keeps tensors in host memory (swap): it is modelled on a device with
        # memory of its own, and so is the original, to compare like with like (the original
        # on this machine's CPU, with its convolutions' scratch, made a swap 0.08x).
        optimized, shapes, _ = before
        fetched = [f for f in original.fetches if f.split(":")[0] in optimized]
        before = optimized, shapes, memory.simulate(optimized, shapes, fetched, "gpu",
                                                    executor=True)
    return before, after


def _refused(run_steps: tuple) -> list[str]:
    """The original's nodes the rewrite makes Grappler fuse otherwise (`fusions.refused`), on
    the shapes of the original's step as run (its calls inlined, as the rewrite's are)."""
    if None in run_steps:
        return []
    return fusions.refused(run_steps[0][0], run_steps[1][0], run_steps[0][1])


def _never_copied(options, names: list[str]):
    """Recompute's options with `names` added to its never-copied pins."""
    return dataclasses.replace(options, pin_never=",".join(filter(None, (
        options.pin_never, *names))))
