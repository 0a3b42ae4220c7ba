"""Micro-batches one after another (`micro_batches`): each forward pass after the previous
micro-batch's backward pass."""

import pytest

from graphrewrite.core import io
from graphrewrite.pipeline import run as pipeline

pytestmark = pytest.mark.tf


def _accumulating(path, micro=4, size=2048, towers=False):
    """A TF2 step that sums four micro-batches' gradients, sliced in a Python loop with a tape
    each (an MLP of four 256-wide layers: activations, not weights, hold its peak), then one
    SGD update; with `towers`, each micro-batch placed on a device of its own."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu")
                                 for _ in range(4)] + [tf.keras.layers.Dense(10)])
    model.build((None, 256))
    optimizer = tf.keras.optimizers.SGD(1e-4)
    optimizer.build(model.trainable_variables)

    @tf.function(input_signature=[tf.TensorSpec([micro * size, 256], tf.float32, name="x"),
                                  tf.TensorSpec([micro * size], tf.int32, name="y")])
    def step(x, y):
        total = None
        for i in range(micro):
            with tf.device(f"/device:CPU:{i}" if towers else None):  # towers: one each
                with tf.GradientTape() as tape:
                    logits = model(x[i * size:(i + 1) * size], training=True)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                        y[i * size:(i + 1) * size], logits))
                grads = tape.gradient(loss, model.trainable_variables)
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        optimizer.apply_gradients(zip(total, model.trainable_variables))
        return loss

    return _export(step, path)


def _export(step, path):
    path.write_bytes(step.get_concrete_function().graph.as_graph_def(
        add_shapes=True).SerializeToString())
    return path


def test_each_micro_batch_runs_after_the_previous_ones_backward_pass(tmp_path):
    """As run, every micro-batch's forward pass started at once (a ResNet-like step of four
    built outside the repo: 0.51x -> 0.35x of its original measured with the pass)."""
    import networkx as nx

    from graphrewrite.analysis import step as analysis
    from graphrewrite.analysis.split import split
    from graphrewrite.execution import verify
    from graphrewrite.passes.micro_batches import GATE_PREFIX, MicroBatchesResult

    model = io.load(_accumulating(tmp_path / "accumulating.pb"))
    found = analysis.analyse(model).split
    products = {n for n in found.forward if model.graph.op(n) == "MatMul"}
    result = pipeline.optimize(model, "memory", composed="micro_batches")
    chained = result.of(MicroBatchesResult).micro_batches
    assert len(found.seeds) == 4 and len(chained) == 3, result.of(MicroBatchesResult).note
    graph = result.graph
    gates = [n for n in graph.nodes() if n.startswith(GATE_PREFIX)]
    after = set().union(*(nx.descendants(graph.nx, gate) for gate in gates))
    # the forward products of every micro-batch but the first wait for a backward pass
    assert len(gates) == 3 and len(products) == 20 and len(products & after) == 15
    # and are still forward values: the recomputation after the pass may take them
    assert products <= split(graph).forward
    assert result.predicted_peaks[1] < 0.9 * result.predicted_peaks[0]
    out = tmp_path / "rewritten.pb"
    io.save(model, result.graph, out)
    outcome = verify.verify(model, io.load(out), verify.VerifyOptions(runs=0), isolated=False)
    assert outcome.match and outcome.rewritten.peak_bytes < outcome.original.peak_bytes


def test_towers_each_on_its_own_device_are_left_to_run_at_once(tmp_path):
    """A TF1 multi-GPU step's towers: chained, they would wait for each other's devices."""
    from graphrewrite.passes.micro_batches import MicroBatchesResult

    model = io.load(_accumulating(tmp_path / "towers.pb", towers=True))
    result = pipeline.optimize(model, "memory", composed="micro_batches").of(MicroBatchesResult)
    assert not result.micro_batches and "different devices" in result.note, result.note


def _two_networks(path, size=2048):
    """Two MLPs trained in one step, each on its own loss by its own optimizer (a GAN's habit,
    without the game): two gradient seeds, whose gradients are never summed."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    pairs = []
    for _ in range(2):
        net = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu")
                                   for _ in range(4)] + [tf.keras.layers.Dense(1)])
        net.build((None, 256))
        optimizer = tf.keras.optimizers.SGD(1e-4)
        optimizer.build(net.trainable_variables)
        pairs.append((net, optimizer))

    @tf.function(input_signature=[tf.TensorSpec([2 * size, 256], tf.float32, name="x")])
    def step(x):
        for i, (net, optimizer) in enumerate(pairs):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(net(x[i * size:(i + 1) * size])))
            grads = tape.gradient(loss, net.trainable_variables)
            optimizer.apply_gradients(zip(grads, net.trainable_variables))
        return loss

    return _export(step, path)


def test_two_networks_each_updated_from_its_own_gradients_are_not_micro_batches(tmp_path):
    """Chained, a DCGAN built outside the repo and the WGAN-GP recipe cell modelled 13% and
    16% lower as run and measured 3-4% higher: only gradients summed together make
    micro-batches."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.passes.micro_batches import MicroBatchesResult

    model = io.load(_two_networks(tmp_path / "two_networks.pb"))
    assert len(analysis.analyse(model).split.seeds) == 2
    result = pipeline.optimize(model, "memory", composed="micro_batches").of(MicroBatchesResult)
    assert not result.micro_batches
