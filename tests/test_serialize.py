"""The serialize pass: a convolution's input gradient waits for its weights' gradient."""

import itertools

import networkx as nx
import pytest
import tensorflow as tf

from graphrewrite.analysis import memory, scratch
from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
from graphrewrite.core.tensor_ref import CONTROL, TensorRef
from graphrewrite.passes import serialize

from conftest import run_cli
from test_split import tf2_step

pytestmark = pytest.mark.tf


def _cnn_step(tmp_path):
    model = tf.keras.Sequential([tf.keras.layers.Conv2D(8, 3, activation="relu"),
                                 tf.keras.layers.Conv2D(8, 3, activation="relu"),
                                 tf.keras.layers.GlobalAveragePooling2D(),
                                 tf.keras.layers.Dense(4)])
    model.build((None, 16, 16, 3))
    opt = tf.keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)
    path = tmp_path / "cnn.pb"
    path.write_bytes(tf2_step(model, opt, [4, 16, 16, 3]).to_graph_def().SerializeToString())
    return path


def test_the_convolution_gradients_run_one_at_a_time(tmp_path):
    model = io.load(_cnn_step(tmp_path))
    found = analysis.analyse(model)
    result = serialize.run(model.graph, found, serialize.SerializeOptions())
    graph = result.graph
    kernels = [n for n in found.memory.order if graph.op(n) in scratch.CONV_GRADIENTS]
    assert len(kernels) == 3  # both gradients of the second convolution, the weights' of the first
    for first, then in zip(kernels, kernels[1:]):  # a chain: each waits for the one before
        assert nx.has_path(graph.nx, first, then)
    assert all(first in graph.control_inputs(then) for first, then in result.serialized)
    assert nx.is_directed_acyclic_graph(graph.nx)
    again = serialize.run(graph, analysis.analyse(model, graph), serialize.SerializeOptions())
    assert not again.modified  # no edge is added twice
    modelled = [memory.simulate(g, found.shapes, found.fetches, "cpu").scratch
                for g in (model.graph, graph)]
    assert any(isinstance(v, tuple) for v in modelled[0].values())  # two at once before
    assert not any(isinstance(v, tuple) for v in modelled[1].values())  # one at a time after


def test_a_gradient_already_waiting_for_the_one_before_gets_no_edge(tmp_path):
    """Where a path already leads from one convolution gradient to the next (a recomputed
    input's trigger waiting on it), Grappler drops the edge from the weight gradient but not
    from its bias gradient, and oneDNN no longer merges the two as in the original (a TF2
    CNN's bias 0.23 apart after two steps): no edge is added there."""
    model = io.load(_cnn_step(tmp_path))
    kernels = [n for n in model.graph.nodes() if model.graph.op(n) in scratch.CONV_GRADIENTS]
    for first, then in itertools.permutations(kernels, 2):  # a bridge the schedule follows
        graph = model.graph.copy()
        graph.add_node("bridge", "NoOp", [TensorRef(first, CONTROL)])
        graph.add_control("bridge", then)
        bridged = analysis.analyse(model, graph)
        order = [n for n in bridged.memory.order if n in kernels]
        if (first, then) in zip(order, order[1:]):
            break
    else:
        pytest.fail("no bridged pair is scheduled one after the other")
    result = serialize.run(graph, bridged, serialize.SerializeOptions())
    assert (first, then) not in result.serialized
    assert first not in result.graph.control_inputs(then)


def test_a_serialized_step_is_bitwise_the_original(tmp_path):
    path = _cnn_step(tmp_path)
    out = tmp_path / "serial.pb"
    made = run_cli("optimize", path, "-o", out, "--passes", "serialize", "--no-as-run")
    assert made.exit_code == 0, made.output
    assert "serialized      2 convolution gradients wait" in made.stdout, made.output
    checked = run_cli("verify", path, out, "--runs", "1")
    assert checked.exit_code == 0 and "MATCH" in checked.stdout and "bitwise" in checked.stdout


def test_a_step_without_two_convolution_gradients_gets_no_note(tmp_path):
    """Nothing to chain, nothing to say (a transformer's report read "no two convolution
    gradients can run at once")."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(4)])
    model.build((None, 16))
    opt = tf.keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)
    path = tmp_path / "mlp.pb"
    path.write_bytes(tf2_step(model, opt, [4, 16]).to_graph_def().SerializeToString())
    loaded = io.load(path)
    result = serialize.run(loaded.graph, analysis.analyse(loaded), serialize.SerializeOptions())
    assert not result.modified and result.note == ""
