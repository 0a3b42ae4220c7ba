"""The step as TensorFlow runs it: the graph after Grappler's default optimizations.

A session does not run the GraphDef it is given. Grappler first prunes what the fetches do not
need, folds constants, simplifies arithmetic (a TF1 gradient's `Neg(x) / c / c` feeding a
gradient nobody fetches disappears, a division by a constant becomes a multiplication), fuses
kernels and drops control dependencies it can prove redundant. On a Keras GELU MLP trained
with `tf.compat.v1.train` that halves the nodes and removes a fifth of the tensors the
backward pass would hold, so a model of the graph as written overestimates the measured peak
by half. Modelling the graph Grappler returns, with the session's default `ConfigProto`, is
modelling what runs.

It is a model of one machine's Grappler: optimizations that depend on the device (layout,
remapper fusions) follow the devices this process sees, so on a CPU-only machine a GPU's
layout changes are not modelled. A session places every node before Grappler sees it, and the
remapper fuses only placed nodes (a MatMul and its BiasAdd into one `_FusedMatMul`), so on a
machine without a GPU the nodes that name no device are placed on its CPU first, as the
session does; with a GPU they are left as written (the session's placer splits them between
the devices by kernel).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

from ..core.graph import Graph

__all__ = ["as_run", "as_run_soon", "finish"]

log = logging.getLogger(__name__)
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"  # a session's name for it
_background: dict[int, ThreadPoolExecutor] = {}  # per process: a forked child has no threads


def as_run(graph: Graph, fetches: list[str], meta_graph=None) -> Graph | None:
    """`graph` as Grappler would hand it to the executor for a step fetching `fetches`; None
    (with a warning) when Grappler cannot process it."""
    return finish(as_run_soon(graph.to_graph_def(), fetches, meta_graph))


def as_run_soon(graph_def, fetches: list[str], meta_graph=None) -> Future:
    """Start `as_run`'s Grappler call on `graph_def` in a background thread and return at
    once; `finish` takes its result. Grappler's C++ releases the GIL, so on a machine with a
    core to spare the original step's optimization (3-4 s of a ResNet-50 training step)
    overlaps the planner."""
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2

    item = meta_graph_pb2.MetaGraphDef()
    if meta_graph is not None:
        item.meta_info_def.CopyFrom(meta_graph.meta_info_def)
    item.graph_def.CopyFrom(graph_def)
    placed = _place_on_cpu(item.graph_def)
    item.collection_def["train_op"].node_list.value.extend(fetches)
    pool = _background.get(os.getpid())
    if pool is None:
        pool = _background[os.getpid()] = ThreadPoolExecutor(1, thread_name_prefix="grappler")
    return pool.submit(_optimize, config_pb2.ConfigProto(), item, placed)


def _place_on_cpu(graph_def) -> set[str]:
    """Place the nodes that name no device on the CPU, as a session on a machine without a GPU
    does before Grappler runs (its remapper's fusions need the placement); returns their names
    (none with a GPU: its placer splits nodes between the devices by kernel)."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return set()
    placed = set()
    for node in graph_def.node:
        if not node.device:
            node.device = CPU
            placed.add(node.name)
    return placed


def _optimize(config, item, placed: set[str]):
    """Grappler's output for `item`, the nodes `placed` for it (and those it made from them)
    unplaced again: the memory model tells host from device by placement (`memory.cpu_is_host`),
    and a swapped-out copy pinned to the CPU is host memory beside unplaced nodes."""
    from tensorflow.python.grappler import tf_optimizer

    optimized = tf_optimizer.OptimizeGraph(config, item)
    given = {node.name for node in item.graph_def.node}
    for node in optimized.node:
        if node.device == CPU and (node.name in placed or node.name not in given):
            node.device = ""
    _specialized_shapes(optimized, item.graph_def.library)
    return optimized


SPECIALIZED = "_specialized_for_"  # Grappler's name for a copy of a function fitted to one call


def _specialized_shapes(optimized, library) -> None:
    """The recorded output shapes (`_output_shapes`) of each call of a function Grappler
    specialized, made to follow its outputs: a specialized function drops the outputs no one
    reads (a nested Keras GRU's gradient, the initial state's), but its calls keep the old
    list, and the model sized a kernel's gradient as the state's (a 2.1 MiB step measured
    11.1). Each kept output is found by its name among the function's outputs before."""
    before = {f.signature.name: [a.name for a in f.signature.output_arg]
              for f in library.function}
    after = {f.signature.name: [a.name for a in f.signature.output_arg]
             for f in optimized.library.function}
    nodes = list(optimized.node) + [n for f in optimized.library.function for n in f.node_def]
    for node in nodes:
        name = next((v.func.name for v in node.attr.values() if v.HasField("func")), "")
        if SPECIALIZED not in name or "_output_shapes" not in node.attr:
            continue
        recorded = list(node.attr["_output_shapes"].list.shape)
        names, old = after.get(name, []), before.get(name.split(SPECIALIZED)[0], [])
        if len(recorded) == len(names):
            continue
        del node.attr["_output_shapes"]
        if len(recorded) == len(old) and set(names) <= set(old):
            node.attr["_output_shapes"].list.shape.extend(recorded[old.index(n)] for n in names)


def finish(started: Future) -> Graph | None:
    """The graph an `as_run_soon` call returns; None (with a warning) when Grappler failed."""
    try:
        optimized = started.result()
    except Exception as err:  # noqa: BLE001  (Grappler's errors are many; the model falls back)
        log.warning("Grappler could not optimize the graph (%s); modelling it as written",
                    str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None
    return Graph.from_graph_def(optimized)
