"""`graphrewrite.tf2.rewrite`: a TF2 step rewritten in the program that runs it, on its own
variables, trains bitwise as the original does."""

import numpy as np
import pytest
import tensorflow as tf

from graphrewrite import tf2
from graphrewrite.core.errors import GraphRewriteError

pytestmark = pytest.mark.tf

BATCH, FEATURES, CLASSES = 256, 32, 10
SPECS = [tf.TensorSpec([BATCH, FEATURES], tf.float32, name="x"),
         tf.TensorSpec([BATCH], tf.int32, name="y")]


def _step(with_signature=True):
    """A Keras GELU MLP with batch norm and dropout, Keras Adam, and its training step."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(128, activation="gelu") for _ in range(4)]
        + [tf.keras.layers.BatchNormalization(), tf.keras.layers.Dropout(0.2),
           tf.keras.layers.Dense(CLASSES)])
    model.build((None, FEATURES))
    optimizer = tf.keras.optimizers.Adam(1e-3)
    optimizer.build(model.trainable_variables)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=True), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return {"loss": loss}

    step = tf.function(train_step, input_signature=SPECS if with_signature else None)
    step.keras_model = model
    return step, model.variables + optimizer.variables(), optimizer


def _batch():
    rng = np.random.RandomState(0)
    return (rng.standard_normal([BATCH, FEATURES]).astype(np.float32),
            rng.randint(0, CLASSES, [BATCH]).astype(np.int32))


def test_rewritten_step_trains_the_programs_own_variables_bitwise():
    step, state, optimizer = _step()
    rewritten = tf2.rewrite(step)
    assert rewritten.report["recomputed"]
    assert rewritten.report["peak_bytes"]["after"] < rewritten.report["peak_bytes"]["before"]
    x, y = _batch()
    start = [v.numpy() for v in state]
    tf.random.set_seed(7)
    original = [step(x, y)["loss"].numpy() for _ in range(2)]
    after_original = [v.numpy() for v in state]
    for variable, value in zip(state, start):
        variable.assign(value)
    tf.random.set_seed(7)
    again = [rewritten(x, y)["loss"].numpy() for _ in range(2)]
    assert int(optimizer.iterations.numpy()) == 2  # the updates landed in the same variables
    assert [a.tobytes() for a in again] == [a.tobytes() for a in original]
    assert all(a.tobytes() == v.numpy().tobytes() for a, v in zip(after_original, state))


def test_rewritten_step_runs_inside_another_tf_function():
    step, _, optimizer = _step()
    rewritten = tf2.rewrite(step)

    @tf.function(input_signature=SPECS)
    def two_steps(x, y):
        first = rewritten(x, y)["loss"]
        with tf.control_dependencies([first]):
            return first, rewritten(x, y)["loss"]

    first, second = two_steps(*_batch())
    assert int(optimizer.iterations.numpy()) == 2 and first.numpy() != second.numpy()


def test_signature_given_at_rewrite_time():
    step, _, _ = _step(with_signature=False)
    rewritten = tf2.rewrite(step, *SPECS)
    assert np.isfinite(rewritten(*_batch())["loss"].numpy())


def _batch_step(form):
    """The training step of `_step`'s model, taking its batch as `form`: "dict" ({"x", "y"})
    or "tuple" ((x, y)), with a Python flag traced as True."""
    step, state, optimizer = _step()
    model = step.keras_model

    def train_step(batch, training=True):
        x, y = (batch["x"], batch["y"]) if form == "dict" else batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x, training=training), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, {"loss": loss}

    specs = {"x": SPECS[0], "y": SPECS[1]} if form == "dict" else tuple(SPECS)
    return tf.function(train_step, input_signature=[specs]), state


@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_rewritten_step_is_called_as_the_step_is(form):
    """Issue 32: a dict or tuple batch, positional or by keyword, as the original takes it."""
    step, state = _batch_step(form)
    rewritten = tf2.rewrite(step)
    x, y = _batch()
    batch = {"x": x, "y": y} if form == "dict" else (x, y)
    start = [v.numpy() for v in state]
    runs = {}
    for label, train, calls in (
            ("original", step, [lambda: step(batch), lambda: step(batch=batch)]),
            ("rewritten", rewritten, [lambda: rewritten(batch), lambda: rewritten(batch=batch),
                                      lambda: rewritten(batch, training=True)])):
        for variable, value in zip(state, start):
            variable.assign(value)
        tf.random.set_seed(7)
        outputs = [call() for call in calls[:2]]
        runs[label] = [(a.numpy().tobytes(), b["loss"].numpy().tobytes()) for a, b in outputs]
        runs[label].append([v.numpy().tobytes() for v in state])
    assert runs["original"] == runs["rewritten"]
    assert np.isfinite(calls[2]()[0].numpy())
    with pytest.raises(TypeError, match="traced as True"):
        rewritten(batch, training=False)
    with pytest.raises(TypeError, match="missing a required argument: 'batch'"):
        rewritten(training=True)


def test_concrete_function_with_keyword_specs():
    step, _, _ = _step(with_signature=False)
    concrete = step.get_concrete_function(x=SPECS[0], y=SPECS[1])
    rewritten = tf2.rewrite(concrete)
    x, y = _batch()
    assert np.isfinite(rewritten(y=y, x=x)["loss"].numpy())


def test_step_without_signature_says_how_to_give_one():
    step, _, _ = _step(with_signature=False)
    with pytest.raises(tf2.StepError, match=r"cannot trace the step: .*missing a required "
                       r"argument.*input_signature.*TensorSpec.*get_concrete_function"):
        tf2.rewrite(step)


def test_xla_step_warns_that_it_runs_without_xla(caplog):
    """Issue 32: jit_compile=True cannot survive the rewrite (XLA would merge the recomputed
    copies back): a warning names XLA and what is lost; a step without it gets none."""
    step, _, _ = _step()
    xla_step = tf.function(step.python_function, input_signature=SPECS, jit_compile=True)
    with caplog.at_level("WARNING", logger="graphrewrite.tf2"):
        tf2.rewrite(step)
        assert not [r for r in caplog.records if "XLA" in r.getMessage()]
        rewritten = tf2.rewrite(xla_step)
    (warning,) = [r for r in caplog.records if "XLA" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert "jit_compile=True" in warning.getMessage() and "without XLA" in warning.getMessage()
    assert "fused kernels" in warning.getMessage()
    assert np.isfinite(rewritten(*_batch())["loss"].numpy())


def test_inference_function_is_refused():
    model = tf.keras.Sequential([tf.keras.layers.Dense(4)])
    model.build((None, FEATURES))
    predict = tf.function(lambda x: model(x), input_signature=SPECS[:1])
    with pytest.raises(tf2.StepError, match=r"^'__inference_\S+' computes no gradient"):
        tf2.rewrite(predict)


def test_unknown_batch_size_is_refused():
    step, _, _ = _step(with_signature=False)
    with pytest.raises(GraphRewriteError, match="fully defined"):
        tf2.rewrite(step, tf.TensorSpec([None, FEATURES], tf.float32, name="x"),
                    tf.TensorSpec([None], tf.int32, name="y"))


def test_not_a_function_is_refused():
    with pytest.raises(tf2.StepError, match="tf.function"):
        tf2.rewrite(lambda x: x)


def test_keras_fit_trains_with_the_rewritten_step_as_with_the_original():
    """`model.fit` calls `model.train_step` inside its own tf.function: set it to the rewritten
    step (the batches must have the traced shape: drop_remainder=True)."""
    step, state, optimizer = _step()
    rewritten = tf2.rewrite(step)
    model = step.keras_model
    model.compile(optimizer=optimizer)
    x, y = _batch()
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat(3).batch(BATCH, drop_remainder=True)
    start = [v.numpy() for v in state]
    trained = {}
    for name, train in (("original", step), ("rewritten", rewritten)):
        for variable, value in zip(state, start):
            variable.assign(value)
        tf.random.set_seed(7)
        model.train_step = lambda batch, train=train: train(*batch)
        model.make_train_function(force=True)
        history = model.fit(data, epochs=1, verbose=0).history
        trained[name] = (history["loss"], [v.numpy().tobytes() for v in state])
    assert int(optimizer.iterations.numpy()) == 3
    assert trained["original"] == trained["rewritten"]


def test_readme_example_prints_what_the_readme_says(tmp_path):
    """Issue 32: the README's TF2 example, run as written (its 100 training steps left out:
    they print nothing), prints peaks within the ranges the README gives."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("### TF2: rewrite the step in the program that trains")[1]
    code = section.split("```python\n")[1].split("```")[0]
    assert "for _ in range(100):" in code
    (tmp_path / "example.py").write_text(code.replace("range(100)", "range(0)"))
    ran = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-2000:]
    before, after = (float(v) for v in re.search(r"([\d.]+) MiB -> ([\d.]+) MiB",
                                                 ran.stdout).groups())
    stated = re.search(r"this prints (\d+)-(\d+) MiB -> (\d+)-(\d+) MiB",
                       " ".join(section.split())).groups()
    low_before, high_before, low_after, high_after = (float(v) for v in stated)
    assert 0.95 * low_before <= before <= 1.05 * high_before, (before, stated)
    assert 0.9 * low_after <= after <= 1.1 * high_after, (after, stated)


def test_a_budget_on_a_named_device_with_a_host_tries_swapping_too():
    """`device_profile` gives the library's budget the CLI's levers: on an H200 moving kept
    tensors to host memory is planned beside recomputation alone, each timed on its figures."""
    step, _, _ = _step()
    rewritten = tf2.rewrite(step, budget="60%", device_profile="h200")
    assert [row["levers"] for row in rewritten.report["levers"]][:2] == [[], ["swap"]]
    assert sum(row["chosen"] for row in rewritten.report["levers"]) == 1
