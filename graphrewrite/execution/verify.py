"""`verify`: run the original and the rewritten model on the same inputs and compare.

Both are imported into separate sessions with TensorFlow's default configuration, fed the same
seeded inputs (MetaGraphDefs: variables initialised the same way, the `train_op` run; TF2 steps:
each resource placeholder bound to a fresh variable holding the same seeded value, see
`bind.py`), and run for two steps: every output of both steps and every variable after them
(weights, optimizer slots, batch-norm statistics, step counters) is compared, bitwise by default,
within `rtol`/`atol` when asked. Each model's peak memory is measured in a fresh process of its
own; their step times in one more process that holds both and times their steps in turns (see
`measure.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..analysis import bind, inline, loops
from ..analysis import shapes as shapes_mod
from ..analysis import split as split_mod
from ..analysis import step as analysis
from ..core import dtypes
from ..core.errors import GraphRewriteError
from ..core.io import Model
from ..core.graph import Graph
from ..core.names import DIET_ATTR, SLOT_OF_ATTR, SWAP_OUT_SUFFIX
from ..core.tensor_ref import TensorRef
from . import measure, mismatch

__all__ = ["VARIABLE_PREFIX", "Comparison", "VerifyResult", "VerifyOptions", "load_feeds",
           "load_data", "data_batches", "verify", "without_saver", "SPREAD_RUNS", "SPREAD_SLACK",
           "training_schedule", "loss_trend", "training_start", "LEARNING_RATE", "SCALE_READERS",
           "own_variables", "compare", "not_finite", "state_at_zero", "GPU_ONLY_OPS", "LEARNED",
           "learned_as_well"]

log = logging.getLogger(__name__)


VARIABLE_PREFIX = "variable:"
# With --batches, how far the rewritten loss must fall, as a share of the original's fall: a
# lean diet that left a TF2 MLP's loss at ln 10 (2.3267 -> 2.3027 while the original fell to
# 2.2502) "fell" and ended within 2.3% of it.
LEARNED = 0.5


@dataclass
class Comparison:
    name: str          # an output tensor, or `variable:<name>`
    equal: bool
    max_abs_diff: float
    step: int | None = None  # which step's output (1, 2); None for a variable after the steps
    finite: bool = True  # the original's value holds no NaN or inf
    # one graph lacks it, or holds it in another shape or non-float type (diet's new slots,
    # its int16 weights): unequal, and no difference counted (`max_abs_diff` leaves it out)
    incomparable: bool = False


@dataclass
class VerifyResult:
    match: bool
    comparisons: list[Comparison]
    original: measure.StepMeasurement
    rewritten: measure.StepMeasurement
    fetches: list[str] = field(default_factory=list)
    steps: int = 0
    cause: str = ""  # why they differ, when a mismatch was traced to Grappler (mismatch.py)
    curves: dict = field(default_factory=dict)  # --steps: {"loss", "original", "rewritten"}
    swapped: int = 0  # tensors the rewritten graph sends to the host and back
    dieted: int = 0  # variables the rewritten graph stores in 16 bits (lossy: never bitwise)
    peak_runs: dict = field(default_factory=dict)  # {"original", "rewritten"}: every peak
    # an original that differs from itself: each output's largest difference over its own runs,
    # by (name, step); None when it repeated itself (or was not asked)
    spread: dict | None = None

    @property
    def within_spread(self) -> bool:
        """A mismatch within SPREAD_SLACK times the original's own from run to run, output by
        output: bitwise cannot be decided, and the rewrite is as close as another run of the
        original would be."""
        return bool(self.spread) and not self.match and all(
            c.equal or (not c.incomparable and c.max_abs_diff <= SPREAD_SLACK * self.spread.get(
                (c.name, c.step), 0.0)) for c in self.comparisons)

    @property
    def max_abs_diff(self) -> float:
        return max((c.max_abs_diff for c in self.comparisons if not c.incomparable),
                   default=0.0)

    def to_json(self) -> dict:
        if self.curves:
            return self._curves_json()
        return {
            "match": self.match,
            "max_abs_diff": self.max_abs_diff,
            "steps": self.steps,
            "outputs_compared": len({c.name for c in self.comparisons if c.step is not None}),
            "variables_compared": sum(c.step is None for c in self.comparisons),
            "mismatched": list(dict.fromkeys(c.name for c in self.comparisons if not c.equal)),
            "not_finite": not_finite(self.comparisons),
            "incomparable": [c.name for c in self.comparisons if c.incomparable],
            "cause": self.cause or None,
            "original_spread": max(self.spread.values(), default=0.0) if self.spread else None,
            "within_spread": self.within_spread,
            "peak_bytes": {"original": self.original.peak_bytes,
                           "rewritten": self.rewritten.peak_bytes},
            "peak_bytes_runs": self.peak_runs,
            "step_seconds": {"original": self.original.median_seconds,
                             "rewritten": self.rewritten.median_seconds},
            "device": self.original.device,
            "onednn": measure.onednn_on(),
            "swapped": self.swapped,
            "dieted": self.dieted,
        }


    def _curves_json(self) -> dict:
        """A lossy rewrite's report: the loss after each of the N steps, for both graphs."""
        first, second = self.curves["original"], self.curves["rewritten"]
        return {
            "match": self.match,
            "steps": self.steps,
            "loss": self.curves["loss"],
            "loss_curves": {"original": first, "rewritten": second},
            "final_loss": {"original": first[-1], "rewritten": second[-1]},
            "compared": self.curves.get("compared", {}),
            "rtol": self.curves["rtol"],
            "batches": self.curves.get("batches", 0),
            "trend": self.curves.get("trend", {}),
            "peak_bytes": {"original": self.original.peak_bytes,
                           "rewritten": self.rewritten.peak_bytes},
            "peak_bytes_runs": self.peak_runs,
            "step_seconds": {"original": self.original.median_seconds,
                             "rewritten": self.rewritten.median_seconds},
            "device": self.original.device,
            "onednn": measure.onednn_on(),
        }


def load_feeds(specs: dict[str, str]) -> dict[str, np.ndarray]:
    """`{name: path.npy}` -> arrays; a missing or unreadable file is an input error."""
    feeds = {}
    for name, path in specs.items():
        try:
            feeds[name] = np.load(Path(path), allow_pickle=False)
        except (OSError, ValueError) as err:
            raise GraphRewriteError(f"${{feeds}} {name}: cannot read {path}: {err}") from None
    return feeds


def load_data(path: str | Path) -> dict[str, np.ndarray]:
    """`--data FILE.npz`: a training set, one array per input placeholder (by node name), the
    examples along the first axis."""
    try:
        archive = np.load(Path(path), allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise GraphRewriteError(f"${{data}}: cannot read {path}: {err}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise GraphRewriteError(f"${{data}}: {path} is one array, not an .npz archive of arrays "
                                "named after the inputs (np.savez(FILE, x=..., labels=...))")
    with archive:
        try:
            return {name: archive[name] for name in archive.files}
        except (OSError, ValueError, zipfile.BadZipFile) as err:
            raise GraphRewriteError(f"${{data}}: cannot read {path}: {err}") from None


def data_batches(graph, shapes, data: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """`data` cut into consecutive batches of the graph's batch size (a last partial batch is
    dropped): the fixed set `--steps` trains on, in the placeholders' dtypes."""
    import tensorflow as tf

    if not data:
        raise GraphRewriteError("${data}: the file holds no arrays")
    cut = {}
    for name, array in sorted(data.items()):
        if name not in graph or graph.op(name) not in bind.PLACEHOLDERS:
            raise GraphRewriteError(f"${{data}} names '{name}', which is not an input placeholder")
        info = shapes[TensorRef(name)]
        if info is None or not info.shape or None in info.shape:
            raise GraphRewriteError(f"${{data}} {name}: the graph gives it no full shape (fix it "
                                    "with ${input_shapes})")
        dtype = tf.dtypes.as_dtype(info.dtype).as_numpy_dtype
        if tuple(array.shape[1:]) != tuple(info.shape[1:]) or array.ndim != len(info.shape):
            raise GraphRewriteError(f"${{data}} {name}: examples of shape {list(array.shape[1:])}, "
                                    f"the graph takes {list(info.shape[1:])}")
        if not np.can_cast(array.dtype, dtype, "same_kind"):
            raise GraphRewriteError(f"${{data}} {name}: {array.dtype} values, the graph takes "
                                    f"{np.dtype(dtype).name}")
        batch = info.shape[0]
        if len(array) < batch:
            raise GraphRewriteError(f"${{data}} {name}: {len(array)} examples, fewer than one "
                                    f"batch of {batch}")
        cut[name] = [array[k * batch:(k + 1) * batch].astype(dtype)
                     for k in range(len(array) // batch)]
    counts = {name: len(batches) for name, batches in cut.items()}
    if len(set(counts.values())) > 1:
        raise GraphRewriteError(f"${{data}}: the arrays make different numbers of batches "
                                f"({', '.join(f'{n}: {c}' for n, c in counts.items())})")
    return [{name: batches[k] for name, batches in cut.items()}
            for k in range(next(iter(counts.values())))]


@dataclass(frozen=True)
class VerifyOptions:
    """What `verify` feeds, fetches and compares, and how many times it runs each model.

    `fetches`: the outputs compared (default: the step's own, `analysis.default_fetches`);
    `input_shapes` fixes unknown input dimensions; `feeds` (arrays by input name) replace the
    seeded random inputs (`seed`; integer inputs drawn below `int_high`); `rtol`/`atol` allow a
    difference (default: bitwise); `runs` timed steps of each.

    `steps` > 0 is for lossy rewrites (diet): both run that many training steps, step k on the
    same seeded batch (seed + k), and match when their final losses agree within `rtol` (and
    `atol`); the variables, of other dtypes now, are not compared. `batches` > 0 makes the
    data a fixed small set instead: that many seeded batches, cycled over the steps, so a
    model can learn it (random labels drawn afresh each step cannot be learned); then the mean
    losses of the last pass over the set are compared, and the rewritten graph's loss must
    also fall where the original's does. `data` (arrays by input name, examples first) is such
    a set given by the user: its batches (the first `batches` of them, when given) are cycled,
    inputs it does not name are seeded as before.

    `repeat` > 1 measures each model's peak in that many processes, in turns: how the
    allocator's regions fall depends on the executor's threads, so the peak of one graph
    moves from process to process (a distillation step: 11.0 to 15.6 MiB over 17 runs); the
    peak reported is their median, `VerifyResult.peak_runs` holds them all."""

    fetches: list[str] | None = None
    input_shapes: dict | None = None
    feeds: dict[str, np.ndarray] | None = None
    rtol: float = 0.0
    atol: float = 0.0
    runs: int = 5
    seed: int = 0
    int_high: int = 10
    steps: int = 0
    batches: int = 0
    data: dict[str, np.ndarray] | None = None
    repeat: int = 1


def verify(original: Model, rewritten: Model, options: VerifyOptions | None = None, *,
           isolated: bool = True, progress: Callable[[str], None] | None = None
           ) -> VerifyResult:
    """Run both models on equal inputs for two steps (or `options.steps` training steps);
    compare every fetched output of each step and every variable after them, and measure both.

    `isolated` runs each model in a fresh process, so both are measured from an empty allocator,
    and times them in a third; otherwise all of it runs in this process (faster, for tests).
    `progress` is told each stage as it begins (each takes seconds, even on a tiny graph).
    """
    options = options or VerifyOptions()
    fetches, runs, seed = options.fetches, options.runs, options.seed
    rtol, atol, steps, batches = options.rtol, options.atol, options.steps, options.batches
    stage = progress or (lambda text: None)
    if batches and not steps or batches < 0:
        raise GraphRewriteError("${batches} K (K >= 1) is for ${steps} N: the fixed data set the "
                                "N steps cycle over")
    if options.data is not None and not steps:
        raise GraphRewriteError("${data} is for ${steps} N: the training set both graphs learn")
    shapes = shapes_mod.infer(original.graph, options.input_shapes)
    if not fetches:
        fetches = without_saver(original, analysis.default_fetches(original, shapes=shapes))
    for model, which in ((original, "original"), (rewritten, "rewritten")):
        missing = [f for f in fetches if f.split(":")[0] not in model.graph]
        if missing:  # the original first: a mistyped output is in neither
            raise GraphRewriteError(f"the {which} model has no node '{missing[0]}'")
    handles = [f for f in fetches if (info := shapes[TensorRef.parse(f)]) is not None
               and dtypes.base(info.dtype) in dtypes.HANDLES]
    if handles:  # a loop's TensorArray, a variable's handle: nothing to compare
        raise GraphRewriteError(f"output '{handles[0]}' is a handle (resource or variant), not "
                                "a value verify can compare: name others with ${fetches}")
    read = sorted(r for r in bind.iterators(original.graph) if r in measure.upstream(
        original.graph, fetches))
    if read:
        raise GraphRewriteError(
            f"the step reads its batches from a tf.data iterator ('{read[0]}', as Keras's "
            "model.train_function does); verify feeds placeholders: export a step over tensors "
            "(a tf.function with an input_signature calling model.train_step((x, y)))")
    given = options.feeds or {}
    unknown = sorted(set(given) - set(original.graph.nodes()))
    if unknown:
        raise GraphRewriteError(f"${{feeds}} names '{unknown[0]}', which is not a node")
    try:
        inputs = {**measure.random_feeds(original.graph, shapes, seed, options.int_high,
                                         set(given), fetches), **given}
    except ValueError as err:
        raise GraphRewriteError(str(err)) from None
    _require_kernels(rewritten)
    for caveat in measure.measurement_caveats():
        log.warning("%s", caveat)
    log.info("verify: %d inputs, %d outputs, %d timed runs each", len(inputs), len(fetches), runs)
    run = measure.run_step_isolated if isolated else measure.run_step
    if steps:
        return _verify_steps(original, rewritten, dataclasses.replace(options, fetches=fetches),
                             shapes, given, inputs, run, stage)
    stage("running the original")
    try:
        first = run(original.runnable(), inputs, fetches, 0)
    except GraphRewriteError as err:
        raise GraphRewriteError(_with_drawn(err.args[0], original, inputs, given)) from None
    if not _finite(first):
        inputs, first = _finite_start(original, inputs, first, set(given), fetches, run)
    stage("running the rewritten")
    own = own_variables(rewritten, inputs, seed)
    second = run(rewritten.runnable(), own, fetches, 0)
    if runs:
        stage("timing both in turns")
        first.step_seconds, second.step_seconds = measure.time_interleaved(
            [(original.runnable(), None, inputs), (rewritten.runnable(), None, own)], fetches,
            runs, isolated)
    peak_runs = _repeated_peaks(options.repeat, stage, run, fetches,
                                (original.runnable(), inputs, first),
                                (rewritten.runnable(), own, second))
    comparisons = compare(first, second, rtol, atol)
    match = all(c.equal for c in comparisons)
    overflowed = not_finite(comparisons)
    if overflowed:
        log.warning("%d of the %d outputs and variables compared hold NaN or inf in the "
                    "original (%s): equal NaNs say little of the rewrite; feed values the step "
                    "stays finite on (--feed NAME=FILE.npy: smaller weights, real data)",
                    len(overflowed), len({c.name for c in comparisons}),
                    ", ".join(overflowed[:3]))
    if not (match or rtol or atol):
        stage("looking for the cause of the mismatch")
    # A bitwise mismatch is run again under other Grappler settings, to name its cause.
    cause = "" if match or rtol or atol else mismatch.diagnose(
        original.runnable(), rewritten.runnable(), inputs, own, fetches,
        lambda a, b: all(c.equal for c in compare(a, b, 0.0, 0.0)), isolated)
    spread = None
    if cause.startswith((mismatch.ORIGINAL_CAUSE, mismatch.RACING_CAUSE)):
        stage(f"running the original {SPREAD_RUNS} times more, for its own spread")
        spread = _own_spread(first, [run(original.runnable(), inputs, fetches, 0)
                                     for _ in range(SPREAD_RUNS)])
    return VerifyResult(match, comparisons, first, second, fetches, len(first.step_outputs),
                        cause, spread=spread, swapped=_swapped(rewritten.graph),
                        peak_runs=peak_runs,
                        dieted=sum(DIET_ATTR in rewritten.graph.node_def(n).attr
                                   for n in rewritten.graph.nodes()))


# Runs of an original that differs from itself, compared with its first run: how far its outputs
# move from run to run, which a rewrite's difference is then weighed against, within a factor
# SPREAD_SLACK: the rewrite's run is one more draw of the same spread, and the largest of four
# draws is no bound on a fifth (a TF1 LSTM's racing dropout masks: one variable of eight beyond).
SPREAD_RUNS, SPREAD_SLACK = 4, 2.0


def _own_spread(first: measure.StepMeasurement, again: list) -> dict:
    """Each output's and variable's largest difference between the original's first run and
    its runs `again`, by (name, step)."""
    spread: dict = {}
    for measured in again:
        for c in compare(first, measured, 0.0, 0.0):
            key = (c.name, c.step)
            spread[key] = max(spread.get(key, 0.0), 0.0 if c.incomparable else c.max_abs_diff)
    return spread


def _with_drawn(failure: str, model: Model, inputs: dict, given: dict) -> str:
    """`failure` (the original's step refused its inputs) naming the data inputs verify drew
    at random, unless its own hint already names one: a sparse tensor's indices, values and
    dense shape fed as three placeholders drawn each on its own (a graph convolution built
    outside the repo: "cannot multiply A and B ... 3 vs. 2048", naming no input)."""
    drawn = sorted(n for n in set(inputs) - set(given) if n in model.graph
                   and not bind.is_resource_placeholder(model.graph.node_def(n)))
    if not drawn or "${" in failure:
        return failure
    names = ", ".join(drawn[:6]) + (f" and {len(drawn) - 6} more" if len(drawn) > 6 else "")
    return (f"{failure.rstrip('. ')}; verify drew these inputs at random: {names}: give the "
            "values they must hold (a sparse tensor's indices and dense shape, a mask) with "
            "${feeds} NAME=FILE.npy")


def _repeated_peaks(repeat: int, stage, run, fetches: list[str], *measured) -> dict:
    """Each (runnable, feeds, first measurement) measured `repeat` times in all, in turns; its
    measurement's peak becomes the median of them. The peaks, by "original"/"rewritten"."""
    peaks = [[m.peak_bytes] for _, _, m in measured]
    if repeat > 1:
        stage(f"measuring both peaks {repeat - 1} times more, in turns")
    for _ in range(repeat - 1):
        for held, (message, feeds, _) in zip(peaks, measured):
            held.append(run(message, feeds, fetches, 0).peak_bytes)
    for held, (_, _, first) in zip(peaks, measured):
        known = [p for p in held if p is not None]
        first.peak_bytes = int(statistics.median(known)) if known else None
    return dict(zip(("original", "rewritten"), peaks))


def _swapped(graph) -> int:
    """How many tensors `graph` swaps out (either swap form)."""
    return sum(name.endswith(SWAP_OUT_SUFFIX) or graph.op(name) == GPU_ONLY_OPS[0]
               for name in graph.nodes())


def without_saver(model: Model, fetches: list[str]) -> list[str]:
    """`fetches` less what saves or restores the model's checkpoint (a SavedModel's sinks): they
    need its `saver_filename` fed, and are not part of a step. The variables are restored before
    the step instead (`Model.runnable`)."""
    meta = model.meta_graph
    name = meta.saver_def.filename_tensor_name.split(":")[0] if meta is not None else ""
    if not name or name not in model.graph:
        return fetches
    reached, todo = set(), [name]
    while todo:
        node = todo.pop()
        if node not in reached:
            reached.add(node)
            todo.extend(model.graph.successors(node))
    return [f for f in fetches if f.split(":")[0] not in reached] or fetches


def training_schedule(graph, shapes, inputs: dict, steps: int, batches: int = 0,
                      data: dict | None = None, seed: int = 0, int_high: int = 10,
                      given: dict | None = None, fetches: list[str] | None = None
                      ) -> tuple[list[dict], int]:
    """The feeds of `steps` training steps (`inputs` the first's) and the size of the set they
    cycle over (0: a fresh seeded batch each step): `batches` seeded batches, or the batches of
    `data` (the first `batches` of them, when given), inputs it does not name seeded."""
    given = given or {}
    user = data_batches(graph, shapes, data) if data is not None else None
    if user:
        batches = min(batches or len(user), len(user))
    count = min(batches, steps) if batches else steps
    seeded = [inputs] + [{**measure.random_feeds(graph, shapes, seed + k, int_high, set(given),
                                                  fetches), **given} for k in range(1, count)]
    if user:
        seeded = [{**feeds, **batch} for feeds, batch in zip(seeded, user)]
    return [seeded[k % count] for k in range(steps)], batches


def _verify_steps(original, rewritten, options: VerifyOptions, shapes, given, inputs, run,
                  stage) -> VerifyResult:
    fetches, runs, seed, steps = options.fetches, options.runs, options.seed, options.steps
    rtol, atol = options.rtol, options.atol
    loss = _loss_output(original, fetches, shapes)
    schedule, batches = training_schedule(original.graph, shapes, inputs, steps, options.batches,
                                          options.data, seed, options.int_high, given, fetches)
    curves = {"loss": loss, "rtol": rtol, "batches": batches}
    import tensorflow as tf

    start = training_start(original, schedule[0], set(given))
    for label, model in (("original", original), ("rewritten", rewritten)):
        first = start if model is original else training_start(
            model, own_variables(model, start, seed), set(given))
        own = [first] + [{k: v for k, v in batch.items() if k in model.graph}
                         for batch in schedule[1:]]
        stage(f"training the {label} for {steps} steps")
        try:
            curves[label] = measure.loss_curve(model.runnable(), own, fetches, loss)
        except tf.errors.OpError as err:
            raise GraphRewriteError(_with_drawn(
                f"${{steps}}: the {label} graph failed at a training step: "
                f"{_first_cause(err.message)}", original, start, given)) from None
    if not curves["original"].trained:
        log.warning("verify: the original's steps changed no variable: the outputs fetched run "
                    "no update, so the steps train nothing and say nothing of the rewrite; give "
                    "the train op with ${fetches}")
    stage("measuring both")
    first = run(original.runnable(), inputs, fetches, runs)
    own = own_variables(rewritten, inputs, seed)
    second = run(rewritten.runnable(), own, fetches, runs)
    peak_runs = _repeated_peaks(options.repeat, stage, run, fetches,
                                (original.runnable(), inputs, first),
                                (rewritten.runnable(), own, second))
    trends = {label: loss_trend(curves[label], batches) for label in ("original", "rewritten")}
    curves["trend"] = trends
    # On a fixed set the last pass's mean is compared: one batch's loss says as much about the
    # batch as about the model (a model that memorised the set swings between near-0 values).
    key = "end" if batches else None
    a, b = ((trends[k]["end"] for k in ("original", "rewritten")) if key
            else (curves[k][-1] for k in ("original", "rewritten")))
    curves["compared"] = {"what": "end" if key else "final", "original": a, "rewritten": b,
                          "atol": atol}
    match = bool(np.isfinite(b) and abs(a - b) <= atol + rtol * abs(a))
    if batches and not learned_as_well(trends):
        match = False  # on a set it can learn, the rewritten graph did not (or barely)
    if not match and not rtol and not atol and np.isfinite(b):
        log.warning("verify: ${steps} compares the final losses exactly (%.6g and %.6g), as "
                    "${rtol} 0 says; a lossy rewrite rounds otherwise: give the tolerance it "
                    "may differ by (e.g. ${rtol} 0.05)", a, b)
    diverged = next((k for k, loss in enumerate(curves["original"], 1)
                     if not np.isfinite(loss)), None)
    if diverged is not None:
        log.warning("verify: the original's own loss is not finite from step %d on: it "
                    "diverges without the rewrite, so the comparison says nothing of the "
                    "rewrite; compare fewer ${steps} (under %d), or on other data (${data})",
                    diverged, diverged)
    elif batches and curves["original"].trained and not trends["original"]["fell"]:
        log.warning("verify: the original's loss did not fall over %d steps on %d fixed "
                    "batches (%.4g -> %.4g): the comparison says little of how the rewrite "
                    "trains; give more ${steps}, or a data set with ${data}", steps, batches,
                    trends["original"]["start"], trends["original"]["end"])
    return VerifyResult(match, [], first, second, fetches, steps, "", curves,
                        peak_runs=peak_runs)


def learned_as_well(trends: dict) -> bool:
    """Whether the rewritten loss fell at least `LEARNED` as far as the original's, where the
    original's fell (`loss_trend`s of both)."""
    original, rewritten = trends["original"], trends["rewritten"]
    return not original["fell"] or (rewritten["fell"] and rewritten["start"] - rewritten["end"]
                                    >= LEARNED * (original["start"] - original["end"]))


def loss_trend(curve: list[float], batches: int) -> dict:
    """Where a loss curve starts and ends, and whether it fell. On a fixed set of `batches`
    cycled batches, start and end are the mean loss over the first and the last pass over the
    set (one batch's loss says as much about the batch as about the model); otherwise the first
    and the last step's loss."""
    window = max(1, min(batches, len(curve) // 2)) if batches else 1
    start = float(np.mean(curve[:window]))
    end = float(np.mean(curve[-window:]))
    return {"start": start, "end": end, "fell": bool(np.isfinite(end) and end < start),
            "window": window}


def training_start(model: Model, feeds: dict, given: set = frozenset()) -> dict:
    """`feeds` with a TF2 step's captured optimizer state as a training run starts it, for
    `--steps`: every optimizer slot (the updates' own and the diet pass's) zero, and a captured
    learning-rate variable (a float scalar read by an update's rate) at LEARNING_RATE instead
    of a seeded value (up to 0.1, too large a rate for Adam). Values the user `given` stay.
    A MetaGraphDef starts from its own initialisers: nothing here applies to it. Updates made
    in function calls (Keras's XLA-compiled ones) are read through the calls: else a step diet
    inlined them for started from other weights than its original."""
    from ..analysis import optimizers

    captured = set(bind.resource_placeholders(model.graph))
    if not captured:
        return feeds
    spliced = inline.inline_update_calls(model.graph.to_graph_def()) \
        if model.graph.shell.library.function else None
    graph = model.graph if spliced is None else Graph.from_graph_def(spliced[0])
    updates = optimizers.updates(graph)
    slots = optimizers.slots_of(updates)
    slots |= {n for n in captured if SLOT_OF_ATTR in graph.node_def(n).attr}
    out = dict(feeds)
    for name in (slots & captured) - set(given):
        if name in out:
            out[name] = np.zeros_like(out[name])
    weights = {u.var for u in updates} & captured  # as `slots`: the updates' own handles
    for name in sorted(weights - slots - set(given)):
        if name in out and np.issubdtype(out[name].dtype, np.floating):
            out[name] = _initial_weight(graph, name, out[name])
    for name in _learning_rates(graph, updates, captured) - set(given):
        if name in out and out[name].shape == () and np.issubdtype(out[name].dtype, np.floating):
            log.info("--steps: captured learning rate %s starts at %g (give another with "
                     "--feed %s=FILE.npy)", name, LEARNING_RATE, name)
            out[name] = np.asarray(LEARNING_RATE, out[name].dtype)
    return out


LEARNING_RATE = 1e-3  # Keras Adam's default; a TF2 step's captured rate holds no value
# Ops that take a 1-D weight as a scale (a layer norm's or batch norm's gamma): it starts at one.
SCALE_READERS = {"Mul": None, "FusedBatchNorm": 1, "FusedBatchNormV2": 1, "FusedBatchNormV3": 1}


def _initial_weight(graph, name: str, seeded: np.ndarray) -> np.ndarray:
    """A trainable weight's value at the start of training, as Keras's layers initialise it:
    a kernel or embedding (2-D or more) Glorot-uniform, symmetric around zero; a 1-D or scalar
    weight zero (a bias) or one where an op takes it as a scale (a norm's gamma). The seeded
    value (all in [0, 0.1)) trains like no model a user has."""
    import zlib

    shape = seeded.shape
    if seeded.ndim < 2:
        return np.full(shape, 1.0 if _is_scale(graph, name) else 0.0, seeded.dtype)
    receptive = int(np.prod(shape[:-2]))
    limit = np.sqrt(6.0 / ((shape[-2] + shape[-1]) * receptive))
    rng = np.random.RandomState(zlib.crc32(f"init:{name}".encode()))
    return rng.uniform(-limit, limit, shape).astype(seeded.dtype)


def _is_scale(graph, name: str) -> bool:
    """Whether a read of the variable (through Identity and Cast) is taken as a scale."""
    return graph.read_as(name, SCALE_READERS, ("ReadVariableOp", "Identity", "Cast"))


def _learning_rates(graph, updates, captured: set, depth: int = 8) -> set[str]:
    """Captured variables read, within `depth` ops, by an update's rate term (Keras Adam's
    `alpha`, SGD's `lr`)."""
    found = set()
    for update in updates:
        todo = [(update.terms[k].node, 0) for k in ("rate_drop", "rate_keep", "lr")
                if update.terms.get(k) is not None]
        seen = set()
        while todo:
            name, level = todo.pop()
            if name in seen or level > depth:
                continue
            seen.add(name)
            if name in captured:
                found.add(name)
                continue
            todo += [(ref.node, level + 1) for ref in graph.data_inputs(name)]
    return found


def own_variables(model: Model, inputs: dict, seed: int) -> dict:
    """`inputs` (made for the original) for `model`: the TF2 step's captured variables that a
    lossy rewrite removed, added or stored in another dtype (diet's slots and 16-bit weights)
    get the model's own: a dieted weight the original's value in `inputs` quantized, a new
    slot its seeded value (`bind.seeded_value`)."""
    graph = model.graph
    changed = [n for n in bind.resource_placeholders(graph)
               if n not in inputs or bind.diet_mark(graph, n)]
    if not changed and all(n in graph for n in inputs):
        return inputs
    shapes = shapes_mod.infer(graph)
    own = {k: v for k, v in inputs.items() if k in graph}
    for name in changed:
        diet, given = bind.diet_mark(graph, name), inputs.get(name)
        if given is None:
            own[name] = bind.seeded_value(name, bind.value_spec(graph, shapes, name), seed, diet)
        elif given.dtype == np.float32:  # the original's weight; else already stored as diet's
            own[name] = bind.dieted(given, diet)
    return own


def _finite(measured: measure.StepMeasurement) -> bool:
    """Every compared float of one run, its steps' outputs and its variables, is finite."""
    values = [*(v for step in measured.step_outputs for v in step.values()),
              *measured.variables.values()]
    return all(np.isfinite(v).all() for v in values
               if isinstance(v, np.ndarray) and v.dtype.kind == "f")


def state_at_zero(model: Model, inputs: dict, given: set, fetches: list[str]) -> dict:
    """`inputs` with a TF2 step's captured optimizer state at zero, as training starts it: the
    captured float variables of more than one element that no forward op reads (slots; a
    learning rate, a scalar, keeps its value). A seeded centered RMSprop's mean square fell
    below its mean gradient's square and a deep MLP's step was NaN throughout. Values the user
    `given` stay; `inputs` itself when nothing changes."""
    graph = model.graph
    captured = set(bind.resource_placeholders(graph)) - given
    if not captured:
        return inputs
    found = analysis.analyse(model, options=analysis.AnalysisOptions(fetches=fetches))
    forward = found.split.forward
    read_forward = {name for name in captured for user, _ in graph.consumers(TensorRef(name))
                    if user in forward or any(reader in forward for reader, _ in
                                              graph.consumers(TensorRef(user)))}
    out = dict(inputs)
    for name in sorted(captured - read_forward):
        value = out.get(name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.size > 1:
            out[name] = np.zeros_like(value)
    return out if any(out[k] is not inputs[k] for k in out) else inputs


def _finite_start(original: Model, inputs: dict, first, given: set, fetches: list[str], run):
    """The inputs and run of the original's first finite start: its seeded values, or (a
    TF2 step's) its slots at zero, as training starts them (a seeded centered RMSprop's mean
    square), or also its kernels Glorot-uniform and its learning rate at LEARNING_RATE, as
    `--steps` starts them (a seeded rate up to 0.1 overflowed a VAE's `exp(log_var)`, built
    outside the repo, and its NaNs compared equal)."""
    starts = ((lambda: state_at_zero(original, inputs, given, fetches),
               "its slots start at zero, as training starts them"),
              (lambda: training_start(original, inputs, given),
               f"its slots start at zero, its kernels Glorot-uniform and its learning rate at "
               f"{LEARNING_RATE:g}, as --steps starts them"))
    for start, how in starts:
        started = start()
        if started is inputs:
            continue
        again = run(original.runnable(), started, fetches, 0)
        if _finite(again):  # its seeded values were no state training reaches
            log.info("verify: the original's step made NaN or inf from seeded values; %s", how)
            return started, again
    return inputs, first


def _first_cause(message: str) -> str:
    """The line of a TensorFlow error that says what went wrong (not where)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    useful = [line for line in lines if not line.startswith(
        ("Graph execution error", "Detected at", "File ", "[[", "Node:", "Original stack"))
        and not line.endswith(":")]
    return (useful or lines or ["unknown error"])[0]


def _loss_output(model: Model, fetches: list[str], shapes) -> str:
    """The loss: the fetched float scalar the gradient seeds differentiate (what the optimizer
    minimizes: an estimator's total loss, not the cross entropy its `losses` collection
    holds) or that it passes on, else one computed from it (Keras's `train_step` returns its
    loss tracker's mean, beside an accuracy), else the first fetched float scalar, with a
    warning. Where nothing fetched is either, the differentiated scalar itself, unfetched (an
    Estimator-style step fetches its train op and merged summary, the loss only through it)."""
    def scalar(name: str) -> bool:
        info = shapes[TensorRef.parse(name)]
        return info is not None and info.shape == () and dtypes.is_floating(info.dtype)

    scalars = [name if ":" in name else f"{name}:0" for name in fetches if scalar(name)]
    graph = model.graph
    inlined = inline.inline_gradient_calls(graph.to_graph_def()) \
        if graph.shell.library.function else None
    if inlined is not None:  # a SavedModel's signature calls the step: the seeds are inside
        graph = Graph.from_graph_def(inlined[0])  # (its call then passes the loss on)
    minimized = set(split_mod.split(graph).differentiated)
    # What a minimized Identity passes on (the zoo's `minimize(tf.identity(loss))`).
    minimized |= {loops.through(graph, TensorRef(n), ("Identity", "Snapshot")).node
                  for n in minimized}
    minimized |= _twins(graph, minimized)
    for among in (minimized, split_mod.fed_by(graph, minimized)):
        chosen = next((s for s in scalars if TensorRef.parse(s).node in among), None)
        if chosen is not None:
            return chosen
    unfetched = sorted(n for n in minimized if scalar(n))
    if unfetched:
        log.warning("verify: ${steps} follows the loss the gradient seeds differentiate, "
                    "'%s', which the step does not fetch", unfetched[0])
        return f"{unfetched[0]}:0"
    if not scalars:
        raise GraphRewriteError("${steps} needs a scalar float loss among the fetched outputs "
                                "(give it with ${fetches})")
    log.warning("verify: ${steps} follows '%s', the first scalar fetched, as the loss: nothing "
                "fetched is computed from the loss the gradient seeds differentiate; give the "
                "loss with ${fetches}", scalars[0])
    return scalars[0]


def _twins(graph, names: set[str]) -> set[str]:
    """Nodes computing what one of `names` computes: the same op and attributes on the same
    inputs (Keras's compiled loss sums the same losses twice, once for the gradient and once
    for its loss tracker, whose mean a `train_step` returns)."""
    out = set()
    for name in names:
        inputs = graph.data_inputs(name)
        if not inputs:
            continue
        node = graph.node_def(name)
        for user, _ in graph.consumers(inputs[0]):
            if user != name and graph.op(user) == node.op and \
                    graph.data_inputs(user) == inputs and graph.node_def(user).attr == node.attr:
                out.add(user)
    return out


def compare(first: measure.StepMeasurement, second: measure.StepMeasurement, rtol: float,
            atol: float) -> list[Comparison]:
    """Every output of every compared step, then every variable after them."""
    comparisons = [_compare(name, a[name], b[name], rtol, atol, step)
                   for step, (a, b) in enumerate(zip(first.step_outputs, second.step_outputs), 1)
                   for name in a]
    return comparisons + _compare_variables(first.variables, second.variables, rtol, atol)


def not_finite(comparisons: list[Comparison]) -> list[str]:
    """The outputs and variables whose original values hold NaN or inf, each named once."""
    return list(dict.fromkeys(c.name for c in comparisons if not c.finite))


def _compare_variables(first: dict, second: dict, rtol: float, atol: float) -> list[Comparison]:
    """Every variable of either model after the steps; one that only one model has differs."""
    out = []
    for name in sorted(set(first) | set(second)):
        label = VARIABLE_PREFIX + name
        if name in first and name in second:
            out.append(_compare(label, first[name], second[name], rtol, atol))
        else:
            out.append(Comparison(label, False, float("inf"), incomparable=True))
    return out


def _is_float(array: np.ndarray) -> bool:
    """A floating-point array, bfloat16 too (numpy knows it as a void kind): a diet's 16-bit
    weight is compared with its float32 original by value."""
    return array.dtype.kind == "f" or array.dtype.name == "bfloat16"


GPU_ONLY_OPS = ("_CopyFromGpuToHost", "_CopyFromHostToGpu")


def _require_kernels(model: Model) -> None:
    """Grappler's swap copies have GPU kernels only: say so rather than fail inside TensorFlow."""
    found = sorted({model.graph.op(n) for n in model.graph.nodes()} & set(GPU_ONLY_OPS))
    if found and "GPU" not in measure.compute_device():
        raise GraphRewriteError(f"the rewritten graph uses {', '.join(found)} (swap form "
                                "grappler), which have GPU kernels only, and there is no GPU "
                                "here; verify the portable form on this machine")


def _compare(name: str, a: np.ndarray, b: np.ndarray, rtol: float, atol: float,
             step: int | None = None) -> Comparison:
    if a.shape != b.shape or a.dtype != b.dtype and not (_is_float(a) and _is_float(b)):
        return Comparison(name, False, float("inf"), step, incomparable=True)
    numeric = bool((np.issubdtype(a.dtype, np.number) or _is_float(a)) and a.size)
    diff, finite = 0.0, True
    if numeric:
        wide, other = a.astype(np.float64), b.astype(np.float64)
        finite = bool(np.isfinite(wide).all())
        with np.errstate(invalid="ignore"):  # inf - inf: equal infinities differ by nothing
            delta = np.abs(wide - other)
        same = (wide == other) | np.isnan(wide) & np.isnan(other)
        delta = np.where(same, 0.0, delta)
        diff = float(np.max(delta)) if not np.isnan(delta).any() else float("inf")
    if rtol or atol:
        equal = bool(np.allclose(wide, other, rtol=rtol, atol=atol, equal_nan=True)) \
            if numeric else bool(np.array_equal(a, b))
    else:
        equal = a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return Comparison(name, equal, diff, step, finite)
