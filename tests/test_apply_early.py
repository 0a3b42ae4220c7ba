"""The apply_early pass, and defer through a TF2 tape's `IdentityN`, on a TF2 step of a deep MLP
with Keras's centered RMSprop (a graph built outside the repo this way measured 1.01x in mode
memory: the deferred `rho * v` products waited for every gradient, and the executor ran the
updates' element-wise kernels when a thread was free)."""

import pytest

from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
from graphrewrite.passes import apply_early
from graphrewrite.passes.apply_early import ApplyEarlyResult
from graphrewrite.passes.defer import DeferResult
from graphrewrite.pipeline import run as pipeline

from conftest import fixture_path
from test_defer import assert_bitwise

LAYERS, UNITS, BATCH = 4, 256, 64


def _mlp_step(clip: bool):
    """The step's GraphDef: LAYERS x Dense(UNITS, relu), logits; centered RMSprop, clipping by
    the global norm where `clip`."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(7)
    model = tf.keras.Sequential([tf.keras.Input((UNITS,))]
                                + [tf.keras.layers.Dense(UNITS, activation="relu")
                                   for _ in range(LAYERS)] + [tf.keras.layers.Dense(10)])
    options = {"global_clipnorm": 1.0} if clip else {}
    optimizer = tf.keras.optimizers.RMSprop(
        tf.keras.optimizers.schedules.ExponentialDecay(1e-3, 1000, 1.0), centered=True,
        jit_compile=False, **options)
    optimizer.build(model.trainable_variables)

    @tf.function(input_signature=[tf.TensorSpec([BATCH, UNITS], tf.float32, name="x"),
                                  tf.TensorSpec([BATCH], tf.int32, name="labels")])
    def step(x, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                labels, model(x, training=True), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step.get_concrete_function().graph.as_graph_def(add_shapes=True)


def test_a_tf1_steps_updates_are_found_by_structure():
    """TF1 Adam: one fused op per parameter; its `beta1_power` and `beta2_power`, written after
    every update, are no parameters (taken for one, they made every node lead to two), and the
    gradient `tuple`'s grouping edges do not make a weight gradient part of the backward."""
    model = io.load(fixture_path("adam_train"))
    found = analysis.analyse(model)
    stages = apply_early.stages(model.graph, found.split, found.memory.order)
    assert [params for params, _, _ in stages] == [
        ["logits/bias"], ["logits/kernel"], ["dense_0/bias", "dense_0/kernel"]]
    for params, writes, _ in stages:
        assert writes == [f"train_op/update_{p}/ResourceApplyAdam" for p in params]


@pytest.fixture(scope="module")
def mlp_step(tmp_path_factory):
    path = tmp_path_factory.mktemp("apply_early") / "mlp_step.pb"
    path.write_bytes(_mlp_step(clip=False).SerializeToString())
    return io.load(path)


def _kernel_gradients(graph):
    return sorted(n for n in graph.nodes() if n.endswith("/MatMul/MatMul_1"))


@pytest.mark.tf
def test_a_deferred_value_waits_for_its_own_gradient_not_for_all(mlp_step):
    result = pipeline.optimize(mlp_step, "none", passes="defer")
    graph = result.graph
    deferred = result.of(DeferResult).deferred
    assert len(deferred) == 2 * LAYERS  # `rho * v` and `rho * g_avg` of each hidden kernel
    gradients = set(_kernel_gradients(graph))
    for name in deferred:
        # through the tape's IdentityN over every gradient: one gradient, not all of them
        assert len(gradients & set(graph.control_inputs(name))) <= 1, name


@pytest.mark.tf
def test_each_layers_update_runs_before_the_backward_pass_goes_on(mlp_step, tmp_path):
    found = analysis.analyse(mlp_step)
    bypassed = mlp_step.graph.copy()
    assert apply_early.bypass_identities(bypassed, found.split.gradient_flow, found.fetches) == 1
    stages = apply_early.stages(bypassed, found.split, found.memory.order)
    # a kernel and its bias start from the same gradient: one stage per layer, last layer first
    assert [len(params) for params, _, _ in stages] == [2] * (LAYERS + 1)
    result = pipeline.optimize(mlp_step, "none", passes="defer apply_early")
    graph = result.graph
    assert len(result.of(ApplyEarlyResult).applied_early) == 2 * LAYERS
    for (_, writes, _), (_, _, entries) in zip(stages, stages[1:]):
        # the layer's weight, bias and input gradients all read its incoming gradient
        readers = {r for ref in entries for r, _ in graph.consumers(ref)}
        assert {graph.op(r) for r in readers} == {"MatMul", "BiasAddGrad"}
        for reader in readers:
            assert set(writes) <= set(graph.control_inputs(reader)), reader
    before = analysis.as_run(mlp_step, mlp_step.graph, found).allocated_peak()
    after = analysis.as_run(mlp_step, graph, found).allocated_peak()
    assert after < 0.9 * before
    assert_bitwise(mlp_step, graph, tmp_path / "early.pb")


@pytest.mark.tf
def test_no_wait_where_every_update_needs_every_gradient(tmp_path):
    path = tmp_path / "clipped.pb"
    path.write_bytes(_mlp_step(clip=True).SerializeToString())
    model = io.load(path)
    found = analysis.analyse(model)
    bypassed = model.graph.copy()
    apply_early.bypass_identities(bypassed, found.split.gradient_flow, found.fetches)
    # every update starts from the global norm: all of them are one stage, nothing to chain
    [(params, _, _)] = apply_early.stages(bypassed, found.split, found.memory.order)
    assert len(params) == 2 * (LAYERS + 1)
    result = pipeline.optimize(model, "none", passes="apply_early")
    assert not result.of(ApplyEarlyResult).applied_early
    assert result.graph is model.graph or len(result.graph) == len(model.graph)


@pytest.mark.tf
def test_a_step_training_convolutions_gets_no_waits():
    """On two TF2 CNN steps the waits measured 8-17% higher: a convolution's weights are small
    beside its activations, so an early update frees little."""
    model = io.load(fixture_path("cnn_step_tf2"))
    result = pipeline.optimize(model, "none", passes="apply_early").of(ApplyEarlyResult)
    assert not result.modified and not result.applied_early
    assert "convolutions" in result.note
