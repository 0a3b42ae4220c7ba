"""The README's recipe: a TF2 step rewritten offline, run in the same program on the function's
own variables, trains bitwise as the original step does."""

import numpy as np
import pytest
import tensorflow as tf

from graphrewrite import io, pipeline
from graphrewrite.passes.base import RecomputeResult

pytestmark = pytest.mark.tf


def test_rewritten_step_runs_on_the_programs_own_variables(tmp_path):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(128, activation="gelu")
                                 for _ in range(4)] + [tf.keras.layers.Dense(10)])
    model.build((None, 32))
    opt = tf.keras.optimizers.Adam(1e-3)
    opt.build(model.trainable_variables)
    specs = [tf.TensorSpec([256, 32], tf.float32, name="x"),
             tf.TensorSpec([256], tf.int32, name="y")]

    @tf.function(input_signature=specs)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step_fn = train_step.get_concrete_function()
    (tmp_path / "step.pb").write_bytes(
        step_fn.graph.as_graph_def(add_shapes=True).SerializeToString())
    loaded = io.load(tmp_path / "step.pb")
    result = pipeline.optimize(loaded, "memory")
    assert result.of(RecomputeResult).recomputed
    graph_def = result.graph.to_graph_def()

    captures = {ph.op.name + ":0": handle for ph, handle in
                zip(step_fn.graph.internal_captures, step_fn.captured_inputs)}
    output = step_fn.graph.outputs[0].op.name + ":0"

    def imported(x, y):
        graph = tf.compat.v1.get_default_graph()
        bound = {name: graph.capture(handle) for name, handle in captures.items()}
        return tf.graph_util.import_graph_def(graph_def, input_map={**bound, "x:0": x, "y:0": y},
                                              return_elements=[output], name="")[0]

    train_step_opt = tf.compat.v1.wrap_function(imported, specs)
    rng = np.random.RandomState(0)
    x = rng.standard_normal([256, 32]).astype(np.float32)
    y = rng.randint(0, 10, [256]).astype(np.int32)
    state = model.variables + opt.variables()
    start = [v.numpy() for v in state]
    original = [train_step(x, y).numpy() for _ in range(2)]
    after_original = [v.numpy() for v in state]
    for variable, value in zip(state, start):
        variable.assign(value)
    rewritten = [train_step_opt(x, y).numpy() for _ in range(2)]
    assert original == rewritten and original[0] != original[1]
    assert int(opt.iterations.numpy()) == 2
    for a, b in zip(after_original, [v.numpy() for v in state]):
        assert a.tobytes() == b.tobytes()
