"""The defer pass on a TF2 step with Keras SGD momentum, whose `momentum * m` products depend
on no data: computed at the step's start as written, they wait for their gradient once deferred,
and the step stays bitwise equal."""

import sys

import pytest

from graphrewrite.analysis import memory
from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
from graphrewrite.execution import verify
from graphrewrite.passes.defer import DeferResult
from graphrewrite.pipeline import run as pipeline

from conftest import FIXTURES

pytestmark = pytest.mark.tf


def assert_bitwise(model, graph, path):
    """`graph` written as `model`'s format to `path` runs two steps bitwise equal to `model`."""
    io.save(model, graph, path)
    checked = verify.verify(model, io.load(path), verify.VerifyOptions(runs=0), isolated=False)
    assert checked.match, checked.to_json()["mismatched"]


def fetching_grad(graph, path):
    """`graph` written to `path` and loaded; the options fetching its "grad" (not the unused
    gradients' sinks), and the analysis they give."""
    path.write_bytes(graph.to_graph_def().SerializeToString())
    model = io.load(path)
    fetched = analysis.AnalysisOptions(fetches=["grad"])
    return model, fetched, analysis.analyse(model, options=fetched)


@pytest.fixture(scope="module")
def momentum_step(tmp_path_factory):
    sys.path.insert(0, str(FIXTURES))
    import keras_training as kt
    spec = kt.TrainingSpec("build_fixtures:keras_step_mlp",
                           [("x", "float32", [512, 64]), ("labels", "int32", [512])],
                           ("momentum", 0.01, 0.9), seed=3, from_logits=True)
    path = tmp_path_factory.mktemp("defer") / "momentum_step.pb"
    kt.in_fresh_process(kt.export_tf2_step, spec, str(path))
    return io.load(path)


def test_momentum_products_wait_for_their_gradients(momentum_step, tmp_path):
    result = pipeline.optimize(momentum_step, "none", passes="defer(min_bytes=16384)")
    deferred = result.of(DeferResult).deferred
    found = analysis.analyse(momentum_step)
    graph, flow = result.graph, found.split.gradient_flow
    # dense_0 (64x128) and dense_1 (128x64) kernels: 32 KiB momentum slots each
    assert len(deferred) == 2
    for name in deferred:
        assert not [r for r in graph.data_inputs(name) if r.node in flow]
        assert graph.control_inputs(name) and all(c in flow for c in graph.control_inputs(name))
    before = memory.simulate(momentum_step.graph, found.shapes, found.fetches)
    after = memory.simulate(graph, found.shapes, found.fetches)
    assert after.peak() < before.peak()
    assert_bitwise(momentum_step, graph, tmp_path / "deferred.pb")


def test_small_values_are_left_alone(momentum_step):
    result = pipeline.optimize(momentum_step, "none", passes="defer")
    assert not result.of(DeferResult).deferred and not result.of(DeferResult).modified
    assert result.graph is momentum_step.graph or len(result.graph) == len(momentum_step.graph)


def swish_step():
    """Four dense layers with a custom-gradient swish (Keras's, with its `beta`): its gradient
    function's `beta * x` reads forward values only, not the incoming gradient; so do `x * x`,
    for `beta`'s gradient, and the gradients of each layer's division by a constant, which the
    fetched weight gradients do not need."""
    import tensorflow as tf

    from graphrewrite.core.graph import Graph

    @tf.custom_gradient
    def swish(x, beta):
        def grad(dy):
            with tf.control_dependencies([dy]):
                sigmoid = tf.sigmoid(beta * x)
            dx = dy * sigmoid * (1 + beta * x * (1 - sigmoid))
            return dx, tf.reduce_sum(dy * tf.square(x) * sigmoid * (1 - sigmoid))
        return x * tf.sigmoid(beta * x), grad

    with tf.Graph().as_default() as g:
        h = tf.compat.v1.placeholder(tf.float32, (512, 64), name="x")
        weights = [tf.compat.v1.placeholder(tf.float32, (64, 64), name=f"w{k}") for k in range(4)]
        for w in weights:
            # `/ 2`: its gradient by the constant (`Neg(x)`, `RealDiv`s of x's size) is never run
            h = swish(tf.matmul(h, w), tf.constant(1.0)) / tf.constant(2.0)
        grads = tf.gradients(tf.reduce_sum(tf.nn.relu(h)), weights)  # ReluGrad: a backward
        tf.identity(tf.add_n(grads), name="grad")
    return Graph.from_graph_def(g.as_graph_def(add_shapes=True))


def test_a_custom_gradients_factors_of_forward_values_wait_for_the_gradient(tmp_path):
    graph = swish_step()
    path = tmp_path / "swish.pb"
    path.write_bytes(graph.to_graph_def().SerializeToString())
    model = io.load(path)
    fetched = analysis.AnalysisOptions(fetches=["grad"])  # not the unused gradients' sinks
    found = analysis.analyse(model, options=fetched)
    result = pipeline.optimize(model, "none", fetched, passes="defer(min_bytes=16384)")
    deferred = result.of(DeferResult).deferred
    # `beta * x` of each layer; not what the step never runs (`Square`, `Neg`, `RealDiv`)
    assert {model.graph.op(n) for n in deferred} == {"Mul"} and len(deferred) == 4
    flow = found.split.gradient_flow
    assert all(n in found.split.early_backward for n in deferred)
    assert all(result.graph.control_inputs(n) and set(result.graph.control_inputs(n)) <= flow
               for n in deferred)
    before = memory.simulate(model.graph, found.shapes, found.fetches)
    after = memory.simulate(result.graph, found.shapes, found.fetches)
    assert after.peak() < before.peak()
    assert_bitwise(model, result.graph, tmp_path / "deferred.pb")


def test_a_tanh_gelus_cube_is_left_to_grappler(tmp_path):
    """A tanh-approximated GELU's gradient reads `x ** 2`, a value of the forward pass alone.
    Grappler's arithmetic optimizer expands the forward `x ** 3` into products, and common
    subgraph elimination shares one of them with that `x ** 2`, but not with an `x ** 2` that
    waits on a control edge: deferred, the step rounded otherwise (a BERT step's weights
    7e-9 apart). It is left where it is, and the step stays bitwise equal."""
    import tensorflow as tf

    from graphrewrite.core.graph import Graph

    with tf.Graph().as_default() as g:
        h = tf.compat.v1.placeholder(tf.float32, (512, 64), name="x")
        weights = [tf.compat.v1.placeholder(tf.float32, (64, 64), name=f"w{k}") for k in range(3)]
        for w in weights:
            h = tf.nn.gelu(tf.matmul(h, w), approximate=True)
        loss = tf.reduce_mean(tf.square(h))
        tf.identity(tf.add_n(tf.gradients(loss, weights)), name="grad")
    path = tmp_path / "gelu.pb"
    path.write_bytes(Graph.from_graph_def(g.as_graph_def(add_shapes=True)).to_graph_def()
                     .SerializeToString())
    model = io.load(path)
    fetched = analysis.AnalysisOptions(fetches=["grad"])
    result = pipeline.optimize(model, "none", fetched, passes="defer(min_bytes=16384)")
    assert not any(model.graph.op(n) == "Pow" for n in result.of(DeferResult).deferred)
    assert_bitwise(model, result.graph, tmp_path / "deferred.pb")


def test_an_accumulators_power_waits_for_its_gradient(tmp_path):
    """Ftrl's `accum ** -0.5` reads the accumulator alone, so it is computed at the step's start
    and held until its gradient arrives (a Siamese MLP's five 4 MiB powers at the backward
    pass's peak). No other power reads its base, so Grappler shares nothing with it: it waits
    like any slot arithmetic, and the step stays bitwise equal."""
    import tensorflow as tf

    from graphrewrite.core.graph import Graph

    with tf.Graph().as_default() as g:
        h = tf.compat.v1.placeholder(tf.float32, (512, 64), name="x")
        weights = [tf.compat.v1.placeholder(tf.float32, (64, 64), name=f"w{k}") for k in range(3)]
        accums = [tf.exp(tf.compat.v1.placeholder(tf.float32, (64, 64), name=f"a{k}"))
                  for k in range(3)]
        for w in weights:
            h = tf.nn.relu(tf.matmul(h, w))
        grads = tf.gradients(tf.reduce_mean(tf.square(h)), weights)
        steps = [g - (tf.pow(a + g * g, -0.5) - tf.pow(a, -0.5)) * w
                 for g, a, w in zip(grads, accums, weights)]
        tf.identity(tf.add_n(steps), name="grad")
    model, fetched, _ = fetching_grad(Graph.from_graph_def(g.as_graph_def(add_shapes=True)),
                                      tmp_path / "ftrl.pb")
    result = pipeline.optimize(model, "none", fetched, passes="defer(min_bytes=16384)")
    powers = [n for n in result.of(DeferResult).deferred if model.graph.op(n) == "Pow"]
    assert len(powers) == 3
    assert_bitwise(model, result.graph, tmp_path / "deferred.pb")


def v1_cond_step():
    """Four layers whose activation a v1 cond (control flow v2 off, as `disable_v2_behavior()`
    leaves it) picks by an unfed phase, as a Keras batch norm's training and inference forms.
    The cond's gradient holds a `zeros` of each layer's product per branch (the one of the
    branch not taken is live); both Grappler and TensorFlow's own folding make them constants, held for the whole session."""
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    from graphrewrite.core.graph import Graph

    was = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        with tf.Graph().as_default() as g:
            phase = tf.compat.v1.placeholder_with_default(False, (), name="phase")
            h = tf.compat.v1.placeholder(tf.float32, (512, 64), name="x")
            weights = [tf.compat.v1.placeholder(tf.float32, (64, 64), name=f"w{k}")
                       for k in range(4)]
            for w in weights:
                z = tf.matmul(h, w)
                h = tf.compat.v1.cond(phase, lambda: tf.nn.relu(z), lambda: tf.tanh(z))
            tf.identity(tf.add_n(tf.gradients(tf.reduce_mean(h * h), weights)), name="grad")
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = was
    return Graph.from_graph_def(g.as_graph_def(add_shapes=True))


def test_a_v1_conds_zeros_wait_for_the_gradient_and_are_never_folded(tmp_path):
    """Deferred, each `zeros` becomes an `Empty` initialised to zeros (stateful: neither
    folding makes it a constant) that waits for the gradient outside every branch: the step as
    TensorFlow runs it holds them no longer, and stays bitwise equal."""
    model, fetched, found = fetching_grad(v1_cond_step(), tmp_path / "cond.pb")
    result = pipeline.optimize(model, "none", fetched, passes="defer(min_bytes=16384)")
    zeros = [n for n in result.of(DeferResult).deferred if model.graph.op(n) == "Fill"]
    assert len(zeros) == 8
    for name in zeros:
        assert result.graph.op(name) == "Empty"
        assert result.graph.node_def(name).attr["init"].b
        # the Fill's recorded shape stays: else its size was unknown, and the warning blamed
        # the user's graph for it (a masked LSTM step built outside the repo)
        assert result.graph.node_def(name).attr["_output_shapes"] == \
            model.graph.node_def(name).attr["_output_shapes"]
        assert set(result.graph.control_inputs(name)) <= found.split.gradient_flow
    before = analysis.as_run(model, model.graph, found)
    after = analysis.as_run(model, result.graph, analysis.analyse(model, result.graph, fetched))
    assert after.allocated_peak() < before.allocated_peak()
    assert_bitwise(model, result.graph, tmp_path / "deferred.pb")


def test_a_sparse_adams_slot_decay_waits_with_its_read(tmp_path):
    """TF1 Adam on an embedding writes `m * beta1` to the slot before it scatter-adds the
    gradient's rows: computed at the step's start, the slot then holds a second buffer (and a
    read copies it: the variable is copied on read once a sparse update touched it) until the
    end. Deferred, the product and the read of the slot it is computed from wait for the
    gradient, and the step stays bitwise equal."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        ids = v1.placeholder(tf.int32, [64], name="ids")
        labels = v1.placeholder(tf.int32, [64], name="labels")
        table = v1.get_variable("table", [4096, 64], use_resource=True)
        weights = v1.get_variable("weights", [64, 10], use_resource=True)
        logits = tf.matmul(tf.nn.embedding_lookup(table, ids), weights)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), name="loss")
        v1.add_to_collection("train_op", v1.train.AdamOptimizer(1e-3).minimize(loss))
        path = tmp_path / "embedding_adam.meta"
        v1.train.export_meta_graph(str(path), graph=graph)
    model = io.load(path)
    found = analysis.analyse(model)
    result = pipeline.optimize(model, "none", passes="defer")
    deferred = result.of(DeferResult).deferred
    decays = [n for n in deferred if any(model.graph.op(w) == "AssignVariableOp"
                                         for w in model.graph.successors(n))]
    assert len(decays) == 2  # m * beta1 and v * beta2, 1 MiB each
    for name in decays:
        read = model.graph.data_inputs(name)[0].node
        assert model.graph.op(read) == "ReadVariableOp"
        assert set(result.graph.control_inputs(read)) == set(result.graph.control_inputs(name))
        assert set(result.graph.control_inputs(name)) <= found.split.gradient_flow
    assert_bitwise(model, result.graph, tmp_path / "deferred.meta")


def skip_sum_step(layers: int = 6):
    """A WaveNet's shape on matrices: each layer's gated output adds to the residual stream and,
    through its own weight, to one skip sum read at the end. The gradient of every layer's
    output is a sum of two terms: the skip path's, ready as soon as the sum's gradient is, and
    the residual path's, ready only when the backward pass reaches the layer."""
    import tensorflow as tf

    from graphrewrite.core.graph import Graph

    with tf.Graph().as_default() as g:
        h = tf.compat.v1.placeholder(tf.float32, (512, 64), name="x")
        weights, skips = [], []
        for k in range(layers):
            parts = ("gate", "skip", "residual")[:3 if k < layers - 1 else 2]  # the last: no
            made = [tf.compat.v1.placeholder(tf.float32, (64, 64), name=f"w{k}_{part}")
                    for part in parts]  # residual path (nothing would read it)
            weights += made
            out = tf.tanh(tf.matmul(h, made[0]))
            skips.append(tf.matmul(out, made[1]))
            h = h + tf.matmul(out, made[2]) if k < layers - 1 else h
        loss = tf.reduce_sum(tf.nn.relu(tf.add_n(skips)))
        tf.identity(tf.add_n(tf.gradients(loss, weights)), name="grad")
    return Graph.from_graph_def(g.as_graph_def(add_shapes=True))


def test_a_skip_sums_early_gradient_terms_wait_for_the_residual_ones(tmp_path):
    model, fetched, found = fetching_grad(skip_sum_step(), tmp_path / "skips.pb")
    result = pipeline.optimize(model, "none", fetched, passes="defer(min_bytes=32768)")
    late = result.of(DeferResult).late_terms
    # the skip path's input gradient of every layer but the last (whose residual term is
    # ready as early), and beside each its twin, the skip weight's gradient (which reads the
    # layer's output): MatMuls reading the skip sum's gradient, waiting on the flow
    assert len(late) == 10 and {model.graph.op(n) for n in late} == {"MatMul"}
    weights = {n for n in late if any(r.node.startswith("w") for r in model.graph.data_inputs(n))}
    assert len(weights) == 5  # the input gradients read the skip weights; their twins do not
    flow = found.split.gradient_flow
    assert all(result.graph.control_inputs(n) and set(result.graph.control_inputs(n)) <= flow
               for n in late)
    assert_bitwise(model, result.graph, tmp_path / "deferred.pb")
    # recomputation then holds less: the terms no longer wait beside the recomputed layers
    peaks = [pipeline.optimize(model, "memory", fetched, as_run=False,
                               passes=f"defer(min_bytes=32768,terms={terms}) recompute")
             .peak_after for terms in ("false", "true")]
    assert peaks[1] < peaks[0] * 0.9, peaks


def test_a_weight_penaltys_gradient_terms_wait_for_their_weights_gradients(tmp_path):
    """An L2 penalty's gradient `w * 2wd` reads the weight and the seed alone: it is ready as
    the backward pass starts and was held until its weight's gradient (a ResNet50V2 step built
    outside the repo, 70 MiB of them at its peak). A product Grappler chains with nothing, it
    waits for the other term of its weight's gradient sum, and the step stays bitwise equal."""
    import tensorflow as tf

    from graphrewrite.core.graph import Graph

    with tf.Graph().as_default() as g:
        h = tf.compat.v1.placeholder(tf.float32, (64, 256), name="x")
        weights = [tf.compat.v1.placeholder(tf.float32, (256, 256), name=f"w{k}")
                   for k in range(4)]
        for w in weights:
            h = tf.nn.relu(tf.matmul(h, w))
        penalty = tf.add_n([tf.nn.l2_loss(w) for w in weights]) * 1e-4
        grads = tf.gradients(tf.reduce_mean(tf.square(h)) + penalty, weights)
        tf.identity(tf.add_n(grads), name="grad")
    model, fetched, found = fetching_grad(Graph.from_graph_def(g.as_graph_def(add_shapes=True)),
                                          tmp_path / "l2.pb")
    result = pipeline.optimize(model, "none", fetched, passes="defer(min_bytes=65536)")
    late = result.of(DeferResult).late_terms
    penalties = [n for n in late if any(r.node.startswith("w") for r in
                                        model.graph.data_inputs(n)) and model.graph.op(n) == "Mul"]
    assert len(penalties) >= 3, late  # the last layer's gradient is ready as early as its own
    before = memory.simulate(model.graph, found.shapes, found.fetches)
    after = memory.simulate(result.graph, found.shapes, found.fetches)
    assert after.peak() < before.peak()
    assert_bitwise(model, result.graph, tmp_path / "deferred.pb")
