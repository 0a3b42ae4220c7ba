"""`verify` on training steps: two steps from equal variables, every output and variable compared.

The graphs are built here, the way users build them: a TF2 `tf.function` step over a Keras model
and Keras Adam, exported with `as_graph_def(add_shapes=True)`, and a TF1 MetaGraphDef with
`AdamOptimizer`, batch-norm updates and `global_step`.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from graphrewrite.analysis import bind
from graphrewrite.core import io
from graphrewrite.execution import verify

from conftest import run_cli

pytestmark = pytest.mark.tf

BATCH, FEATURES, CLASSES = 32, 8, 4


def _train_step(model, optimizer):
    """The concrete function of a TF2 training step: squared error, one `apply_gradients`."""
    @tf.function(input_signature=[tf.TensorSpec([BATCH, FEATURES], tf.float32, name="x"),
                                  tf.TensorSpec([BATCH, CLASSES], tf.float32, name="y")])
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step.get_concrete_function()


@pytest.fixture(scope="module")
def keras_step(tmp_path_factory):
    """A Keras Dense+BatchNormalization+Dropout step with Adam: the GraphDef exported with and
    without shapes, and how many variables the step captures (TensorFlow's own count)."""
    tf.keras.backend.clear_session()  # Keras names layers by a process-wide count
    tf.random.set_seed(1)  # seeds the dropout op, so two sessions draw the same masks
    model = tf.keras.Sequential([
        tf.keras.Input(shape=(FEATURES,)),
        tf.keras.layers.Dense(16, activation="relu"),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Dense(CLASSES),
    ])
    optimizer = tf.keras.optimizers.Adam(1e-2)

    concrete = _train_step(model, optimizer)
    directory = tmp_path_factory.mktemp("keras_step")
    paths = {}
    for add_shapes in (True, False):
        paths[add_shapes] = directory / f"step_{add_shapes}.pb"
        paths[add_shapes].write_bytes(
            concrete.graph.as_graph_def(add_shapes=add_shapes).SerializeToString())
    # the model's 8, Adam's iteration counter and 12 slots, and its learning rate (a variable
    # that `optimizer.variables` does not list)
    assert len(concrete.captured_inputs) == len(model.variables) + len(optimizer.variables) + 1
    return paths, len(concrete.captured_inputs)


def _with_const(path, out, node_name, value):
    """A copy of the GraphDef (or MetaGraphDef) at `path` with one float constant changed."""
    model = io.load(path)
    graph = model.graph.copy()
    node = graph.node_def(node_name)
    assert node.op == "Const"
    changed = type(node.attr["value"])()
    changed.tensor.CopyFrom(tensor_util.make_tensor_proto(np.float32(value)))
    graph.set_attr(node_name, "value", changed)
    io.save(model, graph, out)
    return io.load(out)


def _resource_input(graph, node):
    """The resource placeholder a variable op reads, found through the graph's edges."""
    placeholders = bind.resource_placeholders(graph)
    return next(r.node for r in graph.data_inputs(node) if r.node in placeholders)


def test_tf2_step_matches_itself_over_two_steps_and_every_variable(keras_step):
    paths, keras_variables = keras_step
    model = io.load(paths[True])
    outcome = verify.verify(model, io.load(paths[True]), verify.VerifyOptions(runs=1),
                            isolated=False)
    facts = outcome.to_json()
    assert facts["match"] and facts["steps"] == 2 and facts["mismatched"] == []
    assert facts["variables_compared"] == keras_variables
    assert facts["peak_bytes"]["original"] > 0
    loss = _loss(model, outcome)
    first, second = (s[loss + ":0"] for s in outcome.original.step_outputs)
    assert first != second  # the second step ran on the variables the first one updated
    after = outcome.original.variables
    counters = [v for v in after.values() if v.dtype == np.int64]
    assert [int(c) for c in counters] == [2]  # Adam's iteration counter: from 0, two steps
    kernel = _resource_input(model.graph, "sequential/dense/MatMul/ReadVariableOp")
    start = bind.seeded_value(kernel, bind.value_spec(model.graph, _shapes(model), kernel), 0)
    assert after[kernel].shape == (FEATURES, 16) and not np.array_equal(after[kernel], start)


def _loss(model, outcome):
    """The step's returned value: the output Identity gated on the step's updates."""
    return next(o for o in outcome.fetches if model.graph.control_inputs(o))


def _shapes(model):
    from graphrewrite.analysis import shapes

    return shapes.infer(model.graph)


def test_tf2_step_changed_moving_average_is_a_variable_mismatch(keras_step, tmp_path):
    paths, _ = keras_step
    original = io.load(paths[True])
    decay = "sequential/batch_normalization/AssignMovingAvg/decay"  # 1 - momentum, for the mean
    changed = _with_const(paths[True], tmp_path / "changed.pb", decay, 0.5)
    outcome = verify.verify(original, changed, verify.VerifyOptions(runs=1), isolated=False)
    moving_mean = _resource_input(original.graph, "sequential/batch_normalization/AssignMovingAvg")
    # training-mode batch norm normalises by the batch's statistics: no output differs, only
    # the moving mean the step leaves behind
    assert not outcome.match
    assert outcome.to_json()["mismatched"] == [verify.VARIABLE_PREFIX + moving_mean]


def test_tf2_step_changed_optimizer_differs_from_the_second_step(keras_step, tmp_path):
    paths, _ = keras_step
    original = io.load(paths[True])
    changed = _with_const(paths[True], tmp_path / "changed.pb", "Adam/add_1/y", 0.5)  # epsilon
    outcome = verify.verify(original, changed, verify.VerifyOptions(runs=1), isolated=False)
    outputs = {(c.name, c.step): c.equal for c in outcome.comparisons if c.step is not None}
    loss = _loss(original, outcome) + ":0"
    assert outputs[(loss, 1)] and not outputs[(loss, 2)]
    mismatched = outcome.to_json()["mismatched"]
    assert any(m.startswith(verify.VARIABLE_PREFIX) for m in mismatched)
    assert "MISMATCH" in _format(outcome) and "22 variables" in _format(outcome)


def _format(outcome):
    from graphrewrite.cli.tables import format_verify

    return format_verify(outcome.to_json())


def test_tf2_step_exported_without_shapes_is_a_one_line_error(keras_step):
    paths, _ = keras_step
    bare = io.load(paths[False])
    assert not any("_output_shapes" in bare.graph.node_def(n).attr for n in bare.graph.nodes())
    shown = run_cli("verify", paths[False], paths[False], "--runs", "1")
    assert shown.exit_code == 2
    lines = shown.stderr.strip().splitlines()
    assert len(lines) == 1 and "as_graph_def(add_shapes=True)" in lines[0]
    assert "resource placeholder" in lines[0]


def test_tf2_step_missing_shape_on_a_stripped_reader(keras_step, tmp_path):
    """With shapes exported, removing its readers' records of a read-only variable (the
    learning rate) is enough to lose it."""
    paths, _ = keras_step
    model = io.load(paths[True])
    graph = model.graph.copy()
    unknown = next(n for n in bind.resource_placeholders(graph)
                   if {graph.op(u) for u, _ in graph.consumers(n)} == {"ReadVariableOp"})
    for reader, _ in graph.consumers(unknown):
        graph.node_def(reader).attr.pop("_output_shapes")
    io.save(model, graph, tmp_path / "stripped.pb")
    stripped = io.load(tmp_path / "stripped.pb")
    with pytest.raises(verify.GraphRewriteError, match=f"'{unknown}'.*add_shapes=True"):
        verify.verify(stripped, stripped, verify.VerifyOptions(runs=0), isolated=False)


@pytest.fixture(scope="module")
def tf1_adam(tmp_path_factory):
    """A TF1 training MetaGraphDef: dense, batch norm (updates under the train op), dense,
    AdamOptimizer with global_step; the train_op and losses collections. Returns its path and
    the names of its global variables."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(3)
        x = tf.compat.v1.placeholder(tf.float32, [16, FEATURES], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [16, 1], name="y")
        h = tf.compat.v1.layers.dense(x, 12, activation=tf.nn.relu, name="dense")
        h = tf.compat.v1.layers.batch_normalization(h, training=True, name="bn")
        loss = tf.reduce_mean(tf.square(tf.compat.v1.layers.dense(h, 1, name="out") - y),
                              name="loss")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        with tf.control_dependencies(tf.compat.v1.get_collection(
                tf.compat.v1.GraphKeys.UPDATE_OPS)):
            train = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss, global_step=global_step)
        tf.compat.v1.add_to_collection("train_op", train)
        tf.compat.v1.add_to_collection("losses", loss)
        names = [v.op.name for v in tf.compat.v1.global_variables()]
        meta = tf.compat.v1.train.export_meta_graph()
    path = tmp_path_factory.mktemp("tf1_adam") / "train.meta"
    path.write_bytes(meta.SerializeToString())
    return path, names


def test_tf1_adam_metagraph_compares_every_variable_after_two_steps(tf1_adam, tmp_path):
    path, names = tf1_adam
    same = verify.verify(io.load(path), io.load(path), verify.VerifyOptions(runs=1), isolated=False)
    compared = {c.name for c in same.comparisons if c.step is None}
    assert same.match and compared == {verify.VARIABLE_PREFIX + n for n in names}
    assert {"global_step", "bn/moving_mean", "dense/kernel/Adam_1", "beta1_power"} <= set(names)
    assert int(same.original.variables["global_step"]) == 2

    changed = _with_const(path, tmp_path / "changed.meta", "Adam/epsilon", 0.5)
    outcome = verify.verify(io.load(path), changed, verify.VerifyOptions(runs=1), isolated=False)
    outputs = {(c.name, c.step): c.equal for c in outcome.comparisons if c.step is not None}
    assert outputs == {("loss:0", 1): True, ("loss:0", 2): False}
    mismatched = outcome.to_json()["mismatched"]
    assert "variable:dense/kernel" in mismatched and "variable:out/bias/Adam" in mismatched
    assert "variable:bn/moving_mean" in mismatched  # the second step's batch saw new weights
    assert "variable:global_step" not in mismatched and "variable:beta1_power" not in mismatched



def test_bound_variable_holds_its_bytes_in_the_allocator():
    """TensorFlow borrows the memory of a fed array that is 64-byte aligned instead of copying
    it: a variable assigned straight from the feed would hold NumPy's buffer, and its bytes
    would be missing from every measured peak. The bound variable holds a copy."""
    from tensorflow.core.framework import graph_pb2

    from graphrewrite.execution import measure

    raw = np.empty(4 * 2**20 + 64, np.uint8)
    offset = (-raw.ctypes.data) % 64
    value = raw[offset:offset + 4 * 2**20].view(np.float32)
    value[:] = 1.0
    graph = tf.Graph()
    with graph.as_default():
        bound = bind.bind(graph_pb2.GraphDef(), {"w": value})
    before = measure.allocator_in_use("/device:CPU:0")
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(bound.init_ops, bound.init_feeds)
        held = measure.allocator_in_use("/device:CPU:0") - before
        assert session.run(bound.reads["w"]).tobytes() == value.tobytes()
    # One copy, not two; the process-wide count also sees what other threads of a long test
    # session allocate meanwhile (up to 1.3 MiB here), so the bound is the second copy.
    assert value.nbytes <= held < 2 * value.nbytes



def test_tf2_step_training_starts_from_keras_like_weights(tmp_path):
    """`verify --steps` starts a TF2 step's weights as Keras's layers do: kernels symmetric
    around zero within the Glorot-uniform limit, biases and betas zero, gammas one, Adam's slots
    zero; and the same seeded batch gives the same start in every run."""
    from graphrewrite.analysis import shapes as shapes_mod
    from graphrewrite.execution import measure

    tf.keras.backend.clear_session()
    model = tf.keras.Sequential([tf.keras.Input(shape=(FEATURES,)),
                                 tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.LayerNormalization(),
                                 tf.keras.layers.BatchNormalization(),
                                 tf.keras.layers.Dense(CLASSES)])
    optimizer = tf.keras.optimizers.Adam(tf.keras.optimizers.schedules.ExponentialDecay(
        1e-3, 1000, 1.0))

    concrete = _train_step(model, optimizer)
    (tmp_path / "step.pb").write_bytes(
        concrete.graph.as_graph_def(add_shapes=True).SerializeToString())
    handles = {id(v.handle): v for v in model.variables + optimizer.variables}
    variable_of = {placeholder.op.name: handles.get(id(captured))
                   for captured, placeholder in concrete.graph.captures}
    step = io.load(tmp_path / "step.pb")
    shapes = shapes_mod.infer(step.graph)
    seeded = measure.random_feeds(step.graph, shapes, 0, CLASSES, set())
    start = verify.training_start(step, seeded)
    assert verify.training_start(step, seeded).keys() == start.keys()
    checked = set()
    for name, variable in variable_of.items():
        if variable is None or not variable.dtype.is_floating:
            continue
        value, kind = start[name], variable.name.split("/")[-1].split(":")[0]
        if any(variable is v for v in optimizer.variables):
            assert not value.any(), variable.name  # an Adam slot
        elif kind == "kernel":
            limit = np.sqrt(6.0 / sum(value.shape))
            assert value.min() < 0 < value.max() and np.abs(value).max() <= limit, variable.name
        elif kind in ("bias", "beta"):
            assert not value.any(), variable.name
        elif kind == "gamma":
            assert (value == 1).all(), variable.name
        else:  # batch-norm statistics are not trained: they keep their seeded values
            assert (value == seeded[name]).all(), variable.name
            continue
        checked.add(kind)
    assert checked == {"kernel", "bias", "beta", "gamma"}
