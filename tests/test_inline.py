"""Inlining the calls of functions that run a loop (a TF2 Keras RNN's forward and backward)."""

import json

import numpy as np
import pytest
import tensorflow as tf

from graphrewrite.analysis import inline


def traced():
    @tf.function
    def doubling(x):
        return tf.while_loop(lambda i, h: i < 5, lambda i, h: (i + 1, h * 2.0), [0, x])[1]

    @tf.function
    def plain(x):
        return x * 3.0

    @tf.function(input_signature=[tf.TensorSpec([4], tf.float32, name="x")])
    def step(x):
        return doubling(x) + plain(x)

    return step.get_concrete_function().graph.as_graph_def()


def run(graph_def, fetch):
    with tf.Graph().as_default() as g:
        tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=g) as session:
            return session.run(fetch, {"x:0": np.arange(4, dtype=np.float32)})


def test_calls_of_looping_functions_become_their_bodies():
    original = traced()
    calls = [n for n in original.node if n.op in inline.CALL_OPS]
    assert len(calls) == 2
    inlined = inline.inline_calls(original)
    remaining = [n for n in inlined.node if n.op in inline.CALL_OPS]
    assert len(remaining) == 1  # the loop-free call stays a call
    looping = next(c for c in calls if c.name not in {n.name for n in remaining})
    assert next(n for n in inlined.node if n.name == looping.name).op == "IdentityN"
    assert any(n.op in inline.LOOP_OPS and n.name.startswith(looping.name + "/")
               for n in inlined.node)


@pytest.mark.tf
def test_inlined_graph_computes_the_same():
    original = traced()
    fetch = next(n.name for n in original.node if n.op == "Identity" and "Identity" in n.name)
    expected = run(original, fetch + ":0")
    assert np.array_equal(run(inline.inline_calls(original), fetch + ":0"), expected)
    assert np.array_equal(expected, np.arange(4) * 32.0 + np.arange(4) * 3.0)


def test_graphs_without_looping_calls_are_left_alone():
    with tf.Graph().as_default() as g:
        tf.identity(tf.constant(1.0), name="y")
    assert inline.inline_calls(g.as_graph_def()) is None


def nested_step() -> bytes:
    """A TF2 step whose model runs in its own `tf.function`: a forward call returning the
    activations, a backward call reading them."""
    tf.keras.utils.set_random_seed(5)
    model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu")
                                 for _ in range(6)] + [tf.keras.layers.Dense(10)])
    model.build((None, 64))
    opt = tf.keras.optimizers.SGD(0.01)

    @tf.function
    def forward(x, y):
        return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True), from_logits=True))

    @tf.function(input_signature=[tf.TensorSpec([512, 64], tf.float32, name="x"),
                                  tf.TensorSpec([512], tf.int32, name="y")])
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = forward(x, y)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        return loss

    return step.get_concrete_function().graph.as_graph_def(add_shapes=True).SerializeToString()


@pytest.fixture(scope="module")
def nested(tmp_path_factory):
    path = tmp_path_factory.mktemp("nested") / "nested_step.pb"
    path.write_bytes(nested_step())
    return path


def test_a_nested_tf_function_step_is_inlined_and_its_activations_recomputed(nested, tmp_path):
    from conftest import run_cli

    out = tmp_path / "opt.pb"
    result = run_cli("optimize", nested, "-o", out, "--json", "--no-as-run")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert sorted(facts["inlined"]) == ["PartitionedCall", "StatefulPartitionedCall"]
    assert facts["recomputed"] and facts["peak_bytes"]["after"] < facts["peak_bytes"]["before"]
    # The forward body's results are read directly: no IdentityN between activations and
    # their backward readers.
    from graphrewrite.core import io

    graph = io.load(out).graph
    assert graph.op("StatefulPartitionedCall") == "NoOp"
    assert not any(r.node in facts["inlined"] for n in graph.nodes()
                   for r in graph.data_inputs(n))
    # Looking for calls wrote no empty `f` into other nodes (TensorFlow warned on import).
    assert not [n for n in graph.nodes() if "f" in graph.node_def(n).attr
                and graph.op(n) not in ("PartitionedCall", "StatefulPartitionedCall")]


@pytest.mark.tf
def test_the_inlined_nested_step_is_bitwise_the_original(nested, tmp_path):
    from conftest import run_cli

    out = tmp_path / "opt.pb"
    assert run_cli("optimize", nested, "-o", out, "--no-as-run").exit_code == 0
    result = run_cli("verify", nested, out, "--json", "--runs", "1")
    assert result.exit_code == 0, result.output


def test_a_plan_naming_inlined_nodes_replays_to_the_same_bytes(nested, tmp_path):
    """The recompute decision names nodes the inline pass made (`call/node`): not refused as
    unknown, and the replay gives the same bytes; an unknown name there is still refused."""
    import json

    from conftest import run_cli

    searched = run_cli("optimize", nested, "-o", tmp_path / "searched.pb", "--no-as-run",
                       "--plan-out", tmp_path / "plan.json")
    assert searched.exit_code == 0, searched.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert any(name.startswith("StatefulPartitionedCall/")
               for name in plan["recompute"]["checkpoints"])
    replayed = run_cli("optimize", nested, "-o", tmp_path / "replayed.pb", "--no-as-run",
                       "--plan", tmp_path / "plan.json")
    assert replayed.exit_code == 0, replayed.stderr
    assert (tmp_path / "replayed.pb").read_bytes() == (tmp_path / "searched.pb").read_bytes()
    plan["recompute"]["checkpoints"].append("StatefulPartitionedCall/no/such/node")
    (tmp_path / "bad.json").write_text(json.dumps(plan))
    refused = run_cli("optimize", nested, "-o", tmp_path / "bad.pb", "--no-as-run",
                      "--plan", tmp_path / "bad.json")
    assert refused.exit_code == 2 and "not in the graph" in refused.stderr
    assert refused.stderr.startswith("graphrewrite: error: --plan")
    assert not (tmp_path / "bad.pb").exists()


def test_a_step_inside_a_call_xla_compiles_is_left_and_the_note_says_so(tmp_path):
    """A whole step traced with `jit_compile=True`, called from an outer `tf.function`: the
    call is left whole (XLA would merge recomputed copies back), the analysis warns that XLA
    plans the memory inside it (the model was 90% under the measured peak, silently), and the
    note names the call instead of 'no backward pass found'."""
    from conftest import run_cli

    weights = tf.Variable(tf.ones([64, 512]))

    @tf.function(jit_compile=True)
    def inner(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, tf.nn.relu(x @ weights), from_logits=True))
        weights.assign_sub(0.1 * tape.gradient(loss, weights))
        return loss

    @tf.function(input_signature=[tf.TensorSpec([32, 64], tf.float32, name="x"),
                                  tf.TensorSpec([32], tf.int32, name="y")])
    def step(x, y):
        return inner(x, y)

    path = tmp_path / "xla_step.pb"
    path.write_bytes(step.get_concrete_function().graph.as_graph_def(
        add_shapes=True).SerializeToString())
    result = run_cli("optimize", path, "-o", tmp_path / "opt.pb", "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert "a call XLA compiles (jit_compile=True)" in facts["note"], facts["note"]
    assert "XLA plans the memory inside them" in result.stderr
    # as run, the body is modelled as the executor runs it (its shapes, which Grappler drops,
    # from the inlined body): the logits and their gradient beside the call's inputs
    shown = json.loads(run_cli("inspect", path, "--json").stdout)
    assert shown["modelled_as"] == "run"
    assert shown["peak_bytes"] >= shown["peak_bytes_as_written"] + 2 * 32 * 512 * 4, shown
