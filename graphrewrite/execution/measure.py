"""Running a graph in a TensorFlow session: outputs, measured peak memory, step time.

Peak memory is the allocator's own count: its `peak_bytes_in_use` over a traced step (the
statistics reset just before it), minus what was in use before the session existed; the median
over TRACED_STEPS steps. That peak counts every allocation, a kernel's temporaries too (the CPU's
column buffers of convolution gradients, cuDNN's workspace). The `allocator_bytes_in_use` that
`RunMetadata` reports per node does not: TensorFlow samples it as a node finishes, after the
node freed its temporaries, so their sampled maximum misses them, except for those of another
node still running at that moment. A Keras CNN training step measured 59.6 MiB by the
allocator's peak, 27.6-35.2 MiB by the samples, and the samples fell to 3.3 MiB (the peak to
35.2) when the convolutions' two gradients ran one after the other. On a GPU the allocator is the
BFC allocator, which always keeps these statistics; on a CPU it only does when
`TF_CPU_ALLOCATOR_USE_BFC=true` was set before TensorFlow started (the CLI and the benchmark set
it; `measurement_environment()` says whether it is in force). Without it, the peak falls back to
the sum of the step's own allocation records, which misses constants.

What the peak includes: everything the session holds at the step's high point that it did not
hold before it existed: the step's transient tensors, the feeds, constants, and every variable
(a MetaGraphDef's weights, optimizer slots and batch-norm statistics, created by its initialisers;
the fresh variables bound to a TF2 step's resource placeholders, see `bind.py`). Both kinds of
variable are made after the base is read, so they count alike, once: each is assigned a copy of
its fed initial value made by the allocator (`bind.fed_copy`; TensorFlow borrows an aligned fed
array's own memory, which the allocator never sees). Not included: what importing the graph
allocated (shape inference evaluates small constants).

Training steps change state: outputs are kept for the first STEPS_COMPARED steps (the warm-up and
the first traced one) and every variable is read right after them, so two models run from equal
initial variables can be compared step by step and on the state they leave.

The session uses TensorFlow's default `ConfigProto` (Grappler on), which is what users run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import statistics
import threading
import time
import weakref
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from ..core import ops

__all__ = ["BFC_FLAG", "ONEDNN_FLAG", "TRACED_STEPS", "STEPS_COMPARED", "RESTORE_FROM",
           "measurement_environment", "measurement_caveats", "StepMeasurement", "run_step_isolated",
           "time_interleaved", "deaf_to_ctrl_c", "time_steps", "compute_device", "run_step",
           "seeded", "LossCurve", "loss_curve", "random_feeds", "upstream", "allocator_in_use",
           "allocator_peak"]

log = logging.getLogger(__name__)

BFC_FLAG = "TF_CPU_ALLOCATOR_USE_BFC"
ONEDNN_FLAG = "TF_ENABLE_ONEDNN_OPTS"
# Traced steps whose peaks give the median: two inter-op threads interleave a rewritten graph's
# recomputation with back-propagation differently from step to step, and the allocator hands out
# whole free chunks up to twice the size asked for, so one step's peak varies by several %.
TRACED_STEPS = 3
STEPS_COMPARED = 2
RESTORE_FROM = "graphrewrite_restore_from"  # as `io.RESTORE_FROM` (io imports TensorFlow)


def measurement_environment() -> None:
    """Set up CPU measurement; must run before TensorFlow is imported.

    `TF_CPU_ALLOCATOR_USE_BFC=true`: an allocator that counts its bytes. `TF_ENABLE_ONEDNN_OPTS=0`:
    oneDNN's kernels keep private re-laid-out copies of constant weights (frozen graphs double
    their weight memory on the CPU, and run slower); neither happens on a GPU, so measuring
    without them measures what the graph itself needs.
    """
    os.environ.setdefault(BFC_FLAG, "true")
    os.environ.setdefault(ONEDNN_FLAG, "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def onednn_on() -> bool:
    """Whether oneDNN's CPU kernels and graph rewrites are on in this process (the flag as
    `measurement_environment` left it: off unless the user set it)."""
    return os.environ.get(ONEDNN_FLAG, "0").lower() not in ("0", "false")


def measurement_caveats() -> list[str]:
    """Why a measurement in this environment is not the step the memory model models: flags the
    user set otherwise, which `measurement_environment` leaves alone. With oneDNN's CPU kernels
    on (`TF_ENABLE_ONEDNN_OPTS=1`, which some TensorFlow images set) TensorFlow rewrites the
    graph after Grappler and the kernels allocate buffers of their own: the model's error
    against the measured peak goes from within 1% to -16..-21% on frozen Keras ResNet-50,
    MobileNetV2 and the transformer encoder (batch 8), to -40..-62% on the frozen LSTMs, and to
    +92% on a small MetaGraphDef CNN (no column buffers for its convolution gradients)."""
    caveats = []
    if onednn_on():
        caveats.append(f"{ONEDNN_FLAG}={os.environ[ONEDNN_FLAG]}: oneDNN's CPU kernels are on, "
                       "so the measured peak is not the step the memory model (inspect, "
                       f"optimize) models; set {ONEDNN_FLAG}=0 to measure that step")
    if os.environ.get(BFC_FLAG, "true").lower() not in ("1", "true"):
        caveats.append(f"{BFC_FLAG}={os.environ[BFC_FLAG]}: the CPU allocator keeps no "
                       "statistics, so the measured peak is the step's own allocation records, "
                       "without constants")
    return caveats


@dataclass
class StepMeasurement:
    outputs: dict[str, np.ndarray]    # the fetched outputs of the last compared step
    peak_bytes: int                   # allocator peak during the step, above the pre-session base
    step_seconds: list[float] = field(default_factory=list)
    device: str = ""
    step_outputs: list[dict[str, np.ndarray]] = field(default_factory=list)  # steps 1, 2
    variables: dict[str, np.ndarray] = field(default_factory=dict)  # after the compared steps
    # The first traced step's allocator_bytes_in_use over time: (microseconds, bytes above base)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    run_metadata: bytes = b""  # the first traced step's RunMetadata, serialized

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else float("nan")


def run_step_isolated(message, feeds: dict[str, np.ndarray], fetches: list[str],
                      runs: int = 3, config=None) -> StepMeasurement:
    """`run_step` in a fresh Python process: the allocator starts empty, so two models measured
    one after the other are measured alike (in one process the second reads a few % higher)."""
    return _in_fresh_process(_run_serialized, [_serialize(message, config)], feeds, fetches, runs)


def time_interleaved(runnables: list, fetches: list[str], runs: int,
                     isolated: bool = True) -> list[list[float]]:
    """Step times of several `(message, config, feeds)` triples, each in its own session of one
    process (a fresh one when `isolated`), timed in turns: round r times one step of each,
    starting with model r mod n. A shared machine's load drifts over seconds; timed one after
    the other, two models can differ by 20% from that alone, timed in turns both see the same.
    Each model gets its own feeds (a dieted TF2 step's variables are stored in 16 bits). If
    they do not fit in the device's memory together, each is timed alone."""
    if isolated:
        seconds = _in_fresh_process(_time_serialized, [_serialize(m, c) for m, c, _ in runnables],
                                    [f for _, _, f in runnables], fetches, runs)
    else:
        seconds = time_steps(runnables, fetches, runs)
    if seconds is None:
        log.warning("the models do not fit in memory together: each timed alone")
        run = run_step_isolated if isolated else run_step
        seconds = [run(m, f, fetches, runs, c).step_seconds for m, c, f in runnables]
    return seconds


def _serialize(message, config) -> tuple:
    return (message.DESCRIPTOR.full_name, message.SerializeToString(),
            config.SerializeToString() if config is not None else None)


def _in_fresh_process(function, payloads, feeds, fetches, runs):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from ..core.errors import GraphRewriteError

    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            with deaf_to_ctrl_c():
                future = pool.submit(_reporting, function, payloads, feeds, fetches, runs)
            try:
                failure, result = future.result()
            except KeyboardInterrupt:  # reported by this process; its worker just stops
                for process in list(pool._processes.values()):
                    process.terminate()
                raise
    except BrokenProcessPool:
        raise GraphRewriteError(
            "TensorFlow's process died running the step (a kernel abort: often an integer "
            "input out of range, such as a class id past the last class; see ${int_high} and "
            "${feeds})") from None
    if failure:
        hint = ("; integer inputs not fed are drawn from [0, ${int_high}): give the number of "
                "classes there, or the values with ${feeds}"
                if "outside the valid range" in failure else "")
        failure = failure.rstrip(".") if hint else failure
        raise GraphRewriteError(f"running the step failed: {failure}{hint}")
    return result


@contextlib.contextmanager
def deaf_to_ctrl_c():
    """SIGINT ignored while a worker process starts, which keeps it so: on Ctrl-C the whole
    terminal's process group gets it, and a worker would print a traceback of its own beside
    the one line the command reports (exit 130). The parent stops the worker instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _reporting(function, *args) -> tuple[str, object]:
    """(failure, result) of `function(*args)` in the child, a failure as one line of text:
    TensorFlow's errors hold the failing Operation, which cannot be sent back to the parent
    (the pool would break and print a traceback)."""
    try:
        return "", function(*args)
    except Exception as err:  # noqa: BLE001  (anything TensorFlow raises running the step)
        noise = ("Graph execution error", "Detected at node", "Original stack trace", "File ",
                 "Node:", "[[", "Stack trace", "Traceback")
        lines = [line.strip() for line in str(getattr(err, "message", err)).splitlines()]
        first = next((line for line in lines if line and not line.startswith(noise)), "")
        return f"{type(err).__name__}: {first.split('  ')[0][:200]}", None


def _deserialize(payload) -> tuple:
    from tensorflow.core.framework import graph_pb2
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2

    kind, data, config_data = payload
    message = (meta_graph_pb2.MetaGraphDef() if kind.endswith("MetaGraphDef")
               else graph_pb2.GraphDef())
    message.ParseFromString(data)
    return message, config_pb2.ConfigProto.FromString(config_data) if config_data else None


def _run_serialized(payloads, feeds, fetches, runs) -> StepMeasurement:
    measurement_environment()
    message, config = _deserialize(payloads[0])
    return run_step(message, feeds, fetches, runs, config)


def _time_serialized(payloads, feeds, fetches, runs) -> list[list[float]]:
    measurement_environment()
    return time_steps([(*_deserialize(p), f) for p, f in zip(payloads, feeds)], fetches, runs)


def time_steps(runnables, fetches, runs) -> list[list[float]] | None:
    import tensorflow as tf

    opened = []
    try:
        opened.extend(_open_session(_import(m, f), f, fetches, c) for m, c, f in runnables)
        for session, run_list, feed_dict, _ in opened:
            session.run(run_list, feed_dict)  # warm-up: Grappler, kernel creation, allocations
        seconds = [[] for _ in opened]
        for round_ in range(runs):
            for k in range(len(opened)):
                i = (round_ + k) % len(opened)
                session, run_list, feed_dict, _ = opened[i]
                start = time.perf_counter()
                session.run(run_list, feed_dict)
                seconds[i].append(time.perf_counter() - start)
        return seconds
    except tf.errors.ResourceExhaustedError:
        return None
    finally:
        for session, *_ in opened:
            session.close()


def _import(message, feeds: dict[str, np.ndarray]):
    """A GraphDef or MetaGraphDef imported into a new graph (`Bound.graph`), with what
    initialises its variables and reads them: a MetaGraphDef's global variables; for a GraphDef,
    a fresh variable bound to each resource placeholder that `feeds` gives a value for."""
    import tensorflow as tf

    from ..analysis import bind  # not at the top: this module loads before TensorFlow may

    message = seeded(message)
    graph = tf.Graph()
    with graph.as_default():
        if message.DESCRIPTOR.name == "MetaGraphDef":
            tf.compat.v1.train.import_meta_graph(message, clear_devices=False)
            checkpoint = message.collection_def[RESTORE_FROM].bytes_list.value \
                if RESTORE_FROM in message.collection_def else []
            imported = (_restored(graph, message, checkpoint[0].decode()) if checkpoint else
                        _assigned_from_initial_values(graph, tf.compat.v1.global_variables()))
        else:
            resources = bind.resource_placeholder_names(message) & set(feeds)
            imported = bind.bind(message, {k: feeds[k] for k in resources})
            tf.graph_util.import_graph_def(message, input_map=imported.input_map, name="")
            _initialised_by_structure(graph, imported)
    imported.graph = graph
    return imported


def seeded(message):
    """`message` (a GraphDef or MetaGraphDef), or a copy whose random ops without a seed (`seed`
    and `seed2` 0: TensorFlow draws one per session) have one made from their name: two runs,
    and an original and its rewrite, which keeps such ops and their names, then start from the
    same initial weights and draw the same dropout masks (a TF1 graph built without
    `set_random_seed` differed from itself by 1.0 in verify, and the rewrite was blamed). The
    name is taken below the calls it is inside (`_seed_name`): the inline pass renames a
    function's node `<call>/<node>`, and a SavedModel's dropouts are in functions."""
    copy = type(message)()
    copy.CopyFrom(message)
    graph_def = copy.graph_def if copy.DESCRIPTOR.name == "MetaGraphDef" else copy
    functions = {f.signature.name for f in graph_def.library.function}
    found = 0
    for nodes in (graph_def.node, *(f.node_def for f in graph_def.library.function)):
        unseeded = [n for n in nodes if ops.unseeded(n)]
        if not unseeded:
            continue
        found += len(unseeded)
        calls = {n.name for n in nodes if n.op in SEED_SCOPE_OPS or n.op in functions}
        for node in unseeded:
            name = _seed_name(node.name, calls)
            node.attr["seed2"].i = zlib.crc32(name.encode()) % (2**31 - 1) + 1
    return copy if found else message


# A call's node, or what the inline pass leaves under its name (results gathered by an
# IdentityN, or a NoOp its dependants wait on): the nodes named below one came from a body.
SEED_SCOPE_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "IdentityN", "NoOp"})


def _seed_name(name: str, calls: set[str]) -> str:
    """`name` below the longest of its scopes that is in `calls`: the same for a function's
    node and for its copy spliced in under the call's name."""
    parts = name.split("/")
    for cut in range(len(parts) - 1, 0, -1):
        if "/".join(parts[:cut]) in calls:
            return "/".join(parts[cut:])
    return name


def _restored(graph, meta, checkpoint: str):
    """A SavedModel's variables, restored from `checkpoint` by its own saver (and its init op
    run, which sets up tables), as TensorFlow's loader does; every variable read after the
    steps, TF1 ones and a TF2 model's `VarHandleOp`s alike."""
    import tensorflow as tf

    from ..analysis import bind

    saver = meta.saver_def
    init = [graph.get_operation_by_name(saver.restore_op_name)]
    for key in ("saved_model_main_op", "legacy_init_op"):
        if key in meta.collection_def:
            init += [graph.as_graph_element(n) for n in meta.collection_def[key].node_list.value]
    if "__saved_model_init_op" in meta.signature_def:
        for output in meta.signature_def["__saved_model_init_op"].outputs.values():
            init.append(graph.as_graph_element(output.name.split(":")[0]))
    reads = {}
    with tf.name_scope(bind.BIND_SCOPE + "_reads/"):
        for op in graph.get_operations():
            if op.type == "VarHandleOp":
                reads[op.name] = tf.raw_ops.ReadVariableOp(resource=op.outputs[0],
                                                           dtype=op.get_attr("dtype"))
            elif op.type in ("VariableV2", "Variable"):
                reads[op.name] = tf.identity(op.outputs[0])
    filename = graph.get_tensor_by_name(saver.filename_tensor_name)
    return bind.Bound({}, init, {filename: checkpoint}, reads)


def _assigned_from_initial_values(graph, variables):
    """A MetaGraphDef's variables, to be assigned the values its initialisers give, computed in
    a throwaway session. Run in the measuring session, the initialisers would leave their
    constants there (Grappler folds `zeros` slot initialisers into constants that the cached
    initialiser keeps; an optimizer's first update then copies each slot out of that shared
    buffer), and every Adam slot would count twice between steps."""
    import tensorflow as tf

    from ..analysis import bind

    with tf.compat.v1.Session(graph=graph) as scratch:
        for wave in _initialiser_waves(variables):
            scratch.run(wave)
        values = scratch.run([v.read_value() for v in variables])
    bound = bind.Bound({}, [], {}, {v.op.name: v.read_value() for v in variables})
    with tf.name_scope(bind.BIND_SCOPE + "_initial/"):
        for i, (variable, value) in enumerate(zip(variables, values)):
            initial = bind.fed_copy(bound, value, f"initial_{i}")
            bound.init_ops.append(tf.compat.v1.assign(variable, initial))
    return bound


def _initialiser_waves(variables) -> list[list]:
    """The variables' initialisers in waves, each after those of the variables it reads.
    `global_variables_initializer()` runs them all at once, so an initial value read from
    another variable (Keras's learning rate variable in TF1 graph mode starts as its schedule
    of `iteration`) races that variable's initialiser and fails at random."""
    import graphlib

    index = {v.op: i for i, v in enumerate(variables)}  # (variables are unhashable)
    order = graphlib.TopologicalSorter()
    for i, variable in enumerate(variables):
        seen, stack = set(), [variable.initializer]
        while stack:
            op = stack.pop()
            for before in [t.op for t in op.inputs] + list(op.control_inputs):
                if before in index and before is not variable.op:
                    order.add(i, index[before])
                elif before not in seen and before not in index:
                    seen.add(before)
                    stack.append(before)
        order.add(i)
    try:
        order.prepare()
    except graphlib.CycleError:  # initial values reading each other: TensorFlow's own order
        return [[v.initializer for v in variables]]
    waves = []
    while order.is_active():
        ready = sorted(order.get_ready())
        waves.append([variables[i].initializer for i in ready])
        order.done(*ready)
    return waves


INITIALISING_OPS = ("AssignVariableOp", "Assign")  # an initialiser sets the whole value


def _initialised_by_structure(graph, bound) -> None:
    """A GraphDef's own variables (a TF1 session's `graph_def` written out: no collection says
    which they are or what initialises them), added to `bound` as `_assigned_from_initial_values`
    adds a MetaGraphDef's: each takes the value its initialiser gives, an assign of it from a
    value computed from no placeholder and no variable, run in a throwaway session. A variable
    without one is left as it is (TensorFlow then names it uninitialised)."""
    import tensorflow as tf

    from ..analysis import bind, parameters

    initial = {}  # variable op -> its initialiser
    for op in graph.get_operations():
        if op.type in parameters.VARIABLE_OPS:
            found = [c for c in op.outputs[0].consumers() if c.type in INITIALISING_OPS
                     and c.inputs[0] is op.outputs[0]
                     and _from_constants(c.inputs[1].op, parameters.VARIABLE_OPS)]
            if found:
                initial[op] = found[0]
    if not initial:
        return
    with graph.as_default():
        reads = {op.name: (tf.raw_ops.ReadVariableOp(resource=op.outputs[0],
                                                     dtype=op.get_attr("dtype"))
                           if op.type == "VarHandleOp" else tf.identity(op.outputs[0]))
                 for op in initial}
    with tf.compat.v1.Session(graph=graph) as scratch:
        scratch.run(list(initial.values()))
        values = scratch.run(reads)
    with graph.as_default(), tf.name_scope(bind.BIND_SCOPE + "_initial/"):
        for i, op in enumerate(initial):
            value = bind.fed_copy(bound, values[op.name], f"own_{i}")
            bound.init_ops.append(
                tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=value)
                if op.type == "VarHandleOp" else tf.compat.v1.assign(op.outputs[0], value))
    bound.reads.update(reads)


def _from_constants(op, variable_ops) -> bool:
    """Whether `op`'s value is computed from no placeholder and no variable."""
    seen, todo = set(), [op]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in variable_ops or op.type.startswith("Placeholder"):
            return False
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return True


def _open_session(imported, feeds, fetches, config):
    """A session on an imported graph, variables initialised. Returns it, what to run (fetched
    tensors, then targets), the feed dict and the variables' reads."""
    import tensorflow as tf

    graph = imported.graph
    fetch_tensors, targets = _resolve(graph, fetches)
    bound = {k.split(":")[0] for k in imported.input_map}
    feed_dict = {graph.get_tensor_by_name(_tensor_name(k)): v for k, v in feeds.items()
                 if k not in bound}
    session = tf.compat.v1.Session(graph=graph, config=config)
    if imported.init_ops:
        session.run(imported.init_ops, imported.init_feeds)
    return session, fetch_tensors + targets, feed_dict, imported.reads


def compute_device() -> str:
    """`/device:GPU:0` when TensorFlow sees a GPU, else `/device:CPU:0`."""
    import tensorflow as tf

    return "/device:GPU:0" if tf.config.list_physical_devices("GPU") else "/device:CPU:0"


def run_step(message, feeds: dict[str, np.ndarray], fetches: list[str],
             runs: int = 3, config=None) -> StepMeasurement:
    """Import a GraphDef or MetaGraphDef (whose variables are then initialised, see `_import`),
    run the fetches once as a warm-up, TRACED_STEPS times traced (the median of their peaks is
    the peak), and `runs` times timed. Fetches are node names (output 0) or `node:port`; nodes
    without outputs run as targets. Keeps the outputs of the first STEPS_COMPARED steps and
    every variable's value after them."""
    import tensorflow as tf

    device = compute_device()
    imported = _import(message, feeds)
    # Importing may allocate (shape inference evaluates small constants); not the step's memory.
    base = allocator_in_use(device)
    session, run_list, feed_dict, reads = _open_session(imported, feeds, fetches, config)
    fetched = [t for t in run_list if isinstance(t, tf.Tensor)]
    steps, variables = [], {}

    def keep(result):
        # Fetched arrays may share the allocator's buffers, which would then count in the
        # next steps' peaks: keep owned copies, drop the rest.
        steps.append({t.name: np.array(v, copy=True) for t, v in zip(fetched, result)})
        if len(steps) == STEPS_COMPARED and reads:
            names = sorted(reads)
            values = session.run([reads[n] for n in names])
            variables.update((n, np.array(v, copy=True)) for n, v in zip(names, values))

    with session:
        keep(session.run(run_list, feed_dict))
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        peaks, timeline, traced_metadata = [], [], b""
        for _ in range(TRACED_STEPS):
            _reset_peak(device)
            metadata = tf.compat.v1.RunMetadata()
            traced = session.run(run_list, feed_dict, options=options, run_metadata=metadata)
            if len(steps) < STEPS_COMPARED:
                keep(traced)
            del traced
            peak = allocator_peak(device)
            peaks.append(_records_peak(metadata, device) if peak is None or base is None
                         else peak - base)
            if not timeline:
                timeline = _in_use_over_time(metadata, device, base or 0)
                traced_metadata = metadata.SerializeToString()
        seconds = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(run_list, feed_dict)
            seconds.append(time.perf_counter() - start)
    return StepMeasurement(steps[-1], int(statistics.median(peaks)), seconds, device, steps,
                           variables, timeline, traced_metadata)


class LossCurve(list):
    """The loss after each step, and whether the steps changed any variable (`trained`)."""

    trained: bool = True


def loss_curve(message, batches: list[dict[str, np.ndarray]], fetches: list[str],
               loss: str) -> LossCurve:
    """Run one training step per batch (variables initialised once, as `run_step` does) and
    return the loss tensor's value after each: what `verify --steps` compares for lossy
    rewrites. Resource placeholders are bound from the first batch's values."""
    imported = _import(message, batches[0])
    session, run_list, _, reads = _open_session(imported, batches[0], fetches, None)
    graph = imported.graph
    target = graph.get_tensor_by_name(loss)
    bound = {k.split(":")[0] for k in imported.input_map}
    losses = LossCurve()
    with session:
        before = session.run(list(reads.values()))
        for batch in batches:
            feed = {graph.get_tensor_by_name(_tensor_name(k)): v for k, v in batch.items()
                    if k not in bound}
            value = session.run([target] + [t for t in run_list if t is not target], feed)[0]
            losses.append(float(value))
        after = session.run(list(reads.values()))
    losses.trained = not reads or any(not np.array_equal(a, b) for a, b in zip(before, after))
    return losses


def random_feeds(graph, shapes, seed: int = 0, int_high: int = 10,
                 given: set[str] = frozenset(),
                 fetches: list[str] | None = None) -> dict[str, np.ndarray]:
    """Seeded inputs for every placeholder not `given`: normal floats (a target's in [0, 1),
    rows summing to 1: `_targets`), integers in [0, int_high)
    (below the class or row count of what they index, where smaller), False bools; the three
    of a sparse placeholder, a valid sparse tensor (`sparse_feeds`); for a resource placeholder
    (a TF2 step's captured variable), the initial value of the variable bound to it
    (`bind.seeded_value`). With `fetches`, only the placeholders
    they depend on are fed: a Keras model's own unused `input_1`, a SavedModel's
    `saver_filename` are not (TensorFlow would not run them; nothing says what they hold).

    The same seed gives the same arrays, so two graphs can be compared on equal inputs.
    """
    import tensorflow as tf

    from ..analysis import bind
    from ..core.errors import GraphRewriteError
    from ..core.tensor_ref import TensorRef
    from .sparse_feeds import sparse_feeds

    rng = np.random.RandomState(seed)
    try:
        feeds = bind.seeded_values(graph, shapes, seed, frozenset(given))
    except GraphRewriteError as err:
        raise ValueError(str(err)) from None
    needed = upstream(graph, fetches) if fetches is not None else None
    placeholders = [n for n in sorted(graph.nodes())
                    if graph.op(n) in ("Placeholder", "PlaceholderV2") and n not in given
                    and n not in feeds and (needed is None or n in needed)]
    from .sparse_feeds import sparse_members

    # a sparse tensor's dense shape is its rank long, its values as many as its entries
    batch = _shared_batch(shapes, [n for n in placeholders if n not in sparse_members(
        graph, shapes, set(given) | set(feeds))])
    targets = _targets(graph, shapes)
    unneeded = set() if needed is None else set(graph.nodes()) - needed
    feeds.update(sparse_feeds(graph, shapes, np.random.RandomState(seed + 1), int_high,
                              set(given) | unneeded | set(feeds), batch or 1))
    for name in placeholders:
        if name in feeds:
            continue
        info = shapes[TensorRef(name)]
        shape = None if info is None else info.shape
        if shape and shape[0] is None and None not in shape[1:] and batch:
            # A Keras model's own `Input`, which `model.updates` ran: its batch is the step's.
            log.warning("placeholder '%s' has an unknown batch dimension: fed with the other "
                        "inputs' batch, %d (${input_shapes} gives another)", name, batch)
            shape = (batch,) + tuple(shape[1:])
        if shape is None or None in shape:
            raise ValueError(_unknown_shape(name, info))
        dtype = tf.dtypes.as_dtype(info.dtype).as_numpy_dtype
        if np.issubdtype(dtype, np.floating) and name in targets:
            value = rng.uniform(0.0, 1.0, shape)
            if len(shape) >= 2 and shape[-1] > 1:  # rows of class probabilities
                value /= value.sum(-1, keepdims=True)
            feeds[name] = value.astype(dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif np.issubdtype(dtype, np.integer):
            high = min(int_high, bind.index_limit(graph, shapes, name) or int_high)
            feeds[name] = rng.randint(0, high, shape).astype(dtype)
        else:
            feeds[name] = np.zeros(shape, dtype)
    return feeds


def _shared_batch(shapes, placeholders: list[str]) -> int | None:
    """The leading dimension most of `placeholders` of known shape share (the batch), if any."""
    from ..core.tensor_ref import TensorRef

    found = [shapes[TensorRef(n)] for n in placeholders]
    leading = Counter(f.shape[0] for f in found if f is not None and f.shape
                      and None not in f.shape)
    return leading.most_common(1)[0][0] if leading else None


def _unknown_shape(name: str, info) -> str:
    """What to do about a placeholder of unknown shape: give the shape, or, for what looks like
    a sparse tensor's indices (int64, `[?, rank]`: `tf.compat.v1.sparse_placeholder`'s), feed
    the sparse tensor (how many entries it holds is data, and its ids must be ordered)."""
    import tensorflow as tf

    shape = None if info is None else info.shape
    if shape is not None and len(shape) == 2 and shape[1] is not None \
            and tf.dtypes.as_dtype(info.dtype) == tf.int64:
        return (f"placeholder '{name}' has an unknown shape and looks like a sparse tensor's "
                "indices (int64, [?, rank]): feed its indices, values and dense shape with "
                "--feed NAME=FILE.npy (how many entries it holds is data)")
    return f"placeholder '{name}' has an unknown shape; give it with --input-shape"


_TARGETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _targets(graph, shapes) -> frozenset:
    """`_find_targets` of `graph`'s placeholders, found once a graph (verify feeds a set of
    batches: each asked again)."""
    found = _TARGETS.get(graph)
    if found is None:
        placeholders = [n for n in graph.nodes() if graph.op(n) in ("Placeholder",
                                                                    "PlaceholderV2")]
        found = _TARGETS[graph] = frozenset(_find_targets(graph, shapes, placeholders))
    return found


def _find_targets(graph, shapes, placeholders: list[str]) -> set[str]:
    """The placeholders whose forward values never meet a parameter other than a scalar (the
    regularization losses' sum, added to the loss): what the loss compares the model's output
    with (labels, soft labels, regression targets), not what the model reads. Fed normal
    floats, a categorical cross entropy's labels made its loss unbounded below: a Keras
    `train_step` trained on them diverged (loss 0.6 -> -1.6 -> 12)."""
    from ..analysis import parameters, split
    from ..core.tensor_ref import TensorRef

    found = split.split(graph)
    if not found.seeds:  # no backward pass: no loss to compare with
        return set()
    params = parameters.parameter_nodes(graph, found.constant)
    out = set()
    for name in placeholders:
        seen, todo, meets = {name}, [name], False
        while todo and not meets:
            for user, slot in graph.consumers(TensorRef(todo.pop())):
                if slot is None or slot < 0 or user in seen or user not in found.forward or \
                        graph.op(user) in split.VARIABLE_WRITES:  # a metric's total, say
                    continue
                seen.add(user)
                todo.append(user)
                meets = meets or any(r.node in params and _sized(shapes, r)
                                     for r in graph.data_inputs(user))
        if not meets and len(seen) > 1:
            out.add(name)
    return out


def _sized(shapes, ref) -> bool:
    """Not known to be a scalar."""
    info = shapes[ref]
    return info is None or info.shape != ()


def upstream(graph, fetches: list[str]) -> set[str]:
    """The nodes running `fetches` runs: the fetched ones and everything they depend on, by
    data or control edges."""
    seen, todo = set(), [f.split(":")[0].lstrip("^") for f in fetches]
    while todo:
        name = todo.pop()
        if name in seen or name not in graph:
            continue
        seen.add(name)
        todo.extend(ref.node for ref in graph.inputs(name))
    return seen


def _tensor_name(name: str) -> str:
    return name if ":" in name else name + ":0"


def _resolve(graph, fetches):
    tensors, targets = [], []
    for name in fetches:
        op = graph.get_operation_by_name(name.split(":")[0])
        if ":" in name:
            tensors.append(graph.get_tensor_by_name(name))
        elif op.outputs:
            tensors.append(op.outputs[0])
        else:
            targets.append(op)
    return tensors, targets


def allocator_in_use(device: str) -> int | None:
    """The bytes `device`'s allocator holds now; None when it keeps no statistics."""
    return _memory_info(device, "current")


def allocator_peak(device: str) -> int | None:
    """The most bytes `device`'s allocator held at once since its statistics were reset."""
    return _memory_info(device, "peak")


def _memory_info(device: str, key: str) -> int | None:
    import tensorflow as tf

    try:
        return tf.config.experimental.get_memory_info(device.replace("/device:", ""))[key]
    except (ValueError, tf.errors.OpError):
        return None


def _reset_peak(device: str) -> None:
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats(device.replace("/device:", ""))
    except (ValueError, tf.errors.OpError):
        pass


def _device_memory(metadata, device: str):
    """(node stats, memory stats) of each traced node's allocations on `device`, the pinned
    host allocators (cuda_host, gpu_host) left out."""
    wanted = device.replace("/device:", "").upper()
    for dev in metadata.step_stats.dev_stats:
        if wanted in dev.device.upper():
            for node in dev.node_stats:
                for memory in node.memory:
                    if "host" not in memory.allocator_name:
                        yield node, memory


def _in_use_over_time(metadata, device: str, base: int) -> list[tuple[float, int]]:
    """(start microseconds, allocator_bytes_in_use - base) of each traced node on `device`."""
    return sorted((node.all_start_micros, memory.allocator_bytes_in_use - base)
                  for node, memory in _device_memory(metadata, device)
                  if memory.allocator_bytes_in_use)


def _records_peak(metadata, device: str) -> int:
    """The peak of the step's summed allocation records on `device` (an allocator without
    statistics: constants and temporaries are missed)."""
    records = []
    for _, memory in _device_memory(metadata, device):
        records.extend((r.alloc_micros, r.alloc_bytes) for r in memory.allocation_records)
    current = peak = 0
    for _, delta in sorted(records):
        current += delta
        peak = max(peak, current)
    return peak
