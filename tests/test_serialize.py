"""The serialize pass: a convolution's input gradient waits for its weights' gradient."""

import networkx as nx
import pytest
import tensorflow as tf

from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
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


def test_each_input_gradient_waits_for_the_weights_gradient_of_its_incoming_gradient(tmp_path):
    model = io.load(_cnn_step(tmp_path))
    result = serialize.run(model.graph, analysis.analyse(model), serialize.SerializeOptions())
    graph = result.graph
    # both convolutions' pairs (the tape also writes the first one's gradient of x)
    assert len(result.serialized) == 2
    for first, then in result.serialized:
        assert (graph.op(first), graph.op(then)) == ("Conv2DBackpropFilter",
                                                     "Conv2DBackpropInput")
        assert graph.data_inputs(first)[2] == graph.data_inputs(then)[2]
        assert first in graph.control_inputs(then)
    assert nx.is_directed_acyclic_graph(graph.nx)
    again = serialize.run(graph, analysis.analyse(model, graph), serialize.SerializeOptions())
    assert not again.modified  # the edge is not added twice


def test_a_serialized_step_is_bitwise_the_original(tmp_path):
    path = _cnn_step(tmp_path)
    out = tmp_path / "serial.pb"
    made = run_cli("optimize", path, "-o", out, "--passes", "serialize", "--no-as-run")
    assert made.exit_code == 0 and "serialized      2 convolutions'" in made.stdout, made.output
    checked = run_cli("verify", path, out, "--runs", "1")
    assert checked.exit_code == 0 and "MATCH" in checked.stdout and "bitwise" in checked.stdout
