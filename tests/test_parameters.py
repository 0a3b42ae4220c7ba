"""Variables and parameters: what every pass asks instead of testing op types."""

import dataclasses
import logging

import pytest
import tensorflow as tf

from graphrewrite.analysis import parameters, split
from graphrewrite.analysis import step as analysis
from graphrewrite.analysis.shapes import infer
from graphrewrite.core import io
from graphrewrite.core.graph import Graph
from graphrewrite.planning.checkpoints import bottlenecks
from graphrewrite.planning.context import Context

from conftest import fixture_path
from tfgraphs import build


def test_weights_are_parameters_and_activations_are_not():
    graph = io.load(fixture_path("keras_train")).graph
    found = parameters.parameter_nodes(graph, split.constant_valued(graph))
    reads = [n for n in graph.nodes() if graph.op(n) == "ReadVariableOp"]
    assert reads and all(n in found for n in reads)
    convolutions = [n for n in graph.nodes() if graph.op(n) == "Conv2D"]
    assert convolutions and not any(n in found for n in convolutions)


def test_a_tf2_steps_captured_variables_have_their_value_shapes():
    graph = io.load(fixture_path("keras_step_tf2")).graph
    shapes = infer(graph)
    captured = parameters.variables(graph)
    assert len(captured) == 34 and all(graph.op(n) == "Placeholder" for n in captured)
    sizes = {n: parameters.value_info(graph, shapes, n) for n in captured}
    assert all(info is not None and info.nbytes is not None for info in sizes.values())
    assert {(64, 128), (128, 64)} <= {info.shape for info in sizes.values()}
    assert parameters.unknown_variables(graph, shapes) == []


def test_a_step_exported_without_shapes_says_how_to_export(caplog):
    model = io.load(fixture_path("keras_step_tf2"))
    graph_def = model.graph.to_graph_def()
    for node in graph_def.node:
        node.attr.pop("_output_shapes", None)
    stripped = dataclasses.replace(model, graph=Graph.from_graph_def(graph_def))
    with caplog.at_level(logging.WARNING, logger="graphrewrite"):
        analysis.analyse(stripped)
    assert any("add_shapes=True" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("table_dtype", ["float32", "int16"])
def test_an_embedding_lookup_through_a_variable_starts_the_activations(tmp_path, table_dtype):
    """A float table's gathered rows are the first activation; so are an int16 table's (what
    the diet pass makes of an embedding) once dequantized: the int16 rows themselves are not."""
    def embed_and_classify():
        ids = tf.compat.v1.placeholder(tf.int32, [64, 32], name="ids")
        labels = tf.compat.v1.placeholder(tf.int32, [64], name="labels")
        table = tf.compat.v1.get_variable("table", [1000, 64], dtype=table_dtype,
                                          initializer=tf.zeros_initializer(), use_resource=True)
        h = tf.nn.embedding_lookup(table, ids)
        if table_dtype == "int16":
            h = tf.cast(h, tf.float32) * 0.001 + 1.0
        for i in range(4):
            w = tf.compat.v1.get_variable(f"w{i}", [64, 64], use_resource=True)
            h = tf.nn.relu(tf.einsum("bsd,de->bse", h, w))
        logits = tf.reduce_mean(h, axis=1)[:, :10]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")

    path = tmp_path / "embedding.pb"
    path.write_bytes(build(embed_and_classify).to_graph_def().SerializeToString())
    model = io.load(path)
    graph = model.graph
    chain = bottlenecks(Context.build(graph, analysis.analyse(
        model, options=analysis.AnalysisOptions(fetches=["train"]))))
    assert len(chain) >= 4 and all(graph.op(n) not in ("ReadVariableOp", "VarHandleOp")
                                   for n in chain)


@pytest.fixture(scope="module")
def loss_scaled_step():
    """A TF2 step under `mixed_float16` with `LossScaleOptimizer`: the Adam update, and the
    only reads of its slots, sit inside the branches of a functional `If`."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu"),
                                     tf.keras.layers.Dense(10, dtype="float32")])
        model.build((None, 32))
        opt = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(1e-3))
        opt.build(model.trainable_variables)

        @tf.function(input_signature=[tf.TensorSpec([16, 32], tf.float32, name="x")])
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True)))
                scaled = opt.get_scaled_loss(loss)
            grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        graph_def = step.get_concrete_function().graph.as_graph_def(add_shapes=True)
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    return Graph.from_graph_def(graph_def)


def test_variables_read_only_inside_a_cond_have_their_value_shapes(loss_scaled_step):
    graph = loss_scaled_step
    shapes = infer(graph)
    slots = [n for n in graph.nodes() if graph.op(n) == "Placeholder"
             and any(graph.op(u) == "If" for u, _ in graph.consumers(n))
             and not any(graph.op(u) != "If" for u, _ in graph.consumers(n))]
    assert slots  # Adam's slots: read by nothing but the cond
    assert parameters.unknown_variables(graph, shapes) == []
    kernel = next(n for n in slots if parameters.value_info(graph, shapes, n).shape == (32, 64))
    assert kernel


@pytest.mark.tf
def test_variables_inside_a_cond_grappler_lowered_are_still_counted(loss_scaled_step, tmp_path):
    """Grappler lowers the `If` to `Switch`es: the handles reach their readers through them."""
    path = tmp_path / "step.pb"
    path.write_bytes(loss_scaled_step.to_graph_def().SerializeToString())
    model = io.load(path)
    found = analysis.analyse(model)
    lowered, shapes, _ = analysis.as_run_step(model, model.graph, found)
    assert any(lowered.op(n) == "Switch" for n in lowered.nodes())
    assert parameters.unknown_variables(lowered, shapes) == []


@pytest.mark.parametrize("optimizer, slots", [
    (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True), 1),
    (lambda: tf.keras.optimizers.RMSprop(1e-3), 1), (lambda: tf.keras.optimizers.Adagrad(0.1), 1),
    (lambda: tf.keras.optimizers.Adam(1e-3), 2)])
def test_weights_and_their_state_are_found_whatever_the_optimizer(optimizer, slots):
    """A weight is what the step writes from the gradient and the loss is computed from; its
    optimizer state what it writes from the gradient otherwise: the facts held only for the
    updates `optimizers` reads (a SimCLR step with Nesterov momentum: 0 parameters)."""
    from graphrewrite.analysis.state import parameter_facts
    from test_split import tf2_step

    model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="relu"),
                                 tf.keras.layers.Dense(4)])
    model.build((None, 16))
    opt = optimizer()
    opt.build(model.trainable_variables)
    graph = tf2_step(model, opt, [8, 16])
    facts = parameter_facts(graph, infer(graph))
    assert facts["trainable_parameters"] == 16 * 32 + 32 + 32 * 4 + 4
    assert facts["bytes_per_parameter"] == 4 * (1 + slots)
