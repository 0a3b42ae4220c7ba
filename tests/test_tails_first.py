"""A head's backward pass waits for another head's loss gradient (`tails_first`)."""

import pytest

from graphrewrite.core import io
from graphrewrite.pipeline import run as pipeline

pytestmark = pytest.mark.tf


def _two_heads(path):
    """A trunk and two heads: one ends in a focal-like loss (elementwise products of its
    [256, 1024] logits, each held for its gradient), the other in three matrix products;
    plain SGD on the sum of the two losses, as a TF1 MetaGraphDef."""
    import tensorflow as tf

    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, [256, 64], name="x")
        y = tf1.placeholder(tf.float32, [256, 1024], name="y")

        def weight(name, shape):
            return tf1.get_variable(name, shape, initializer=tf1.glorot_uniform_initializer())

        h = tf.nn.relu(tf.matmul(x, weight("w0", [64, 64])))
        a = tf.matmul(h, weight("wa", [64, 1024]))
        p = tf.sigmoid(a)
        ce = tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=a)
        pt = y * p + (1 - y) * (1 - p)
        loss_a = tf.reduce_mean((y * 0.25 + (1 - y) * 0.75) * tf.pow(1 - pt, 2.0) * ce)
        b = h
        for i in range(3):
            b = tf.nn.relu(tf.matmul(b, weight(f"wb{i}", [64 if i == 0 else 1024, 1024])))
        loss = tf.identity(loss_a + tf.reduce_mean(tf.square(b)), name="loss")
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.1).minimize(loss))
        tf1.train.export_meta_graph(filename=str(path), clear_devices=True)
    return path


def test_the_other_heads_matrix_gradients_wait_for_the_focal_losss_gradient(tmp_path):
    """As run, the matrix head's gradients ran beside the focal loss's, which held its
    forward values (an FPN-like detector built outside the repo: 0.89x -> 0.73x measured).
    Measured here in one process, the executor's two threads race: on a 2-core AMD EPYC the
    fall showed in about half the single runs (session 45), and one CI run measured 25.6 MiB
    before and 26.6 after. On a 2-core Xeon, nine runs each: 26.0 to 32.5 MiB before, 25.2 to
    26.2 after. So the median of nine is held to not rising past 2% of the original's."""
    import networkx as nx

    from graphrewrite.analysis import split
    from graphrewrite.execution import verify
    from graphrewrite.passes.tails_first import HEAVY, TailsFirstResult

    model = io.load(_two_heads(tmp_path / "two_heads.meta"))
    result = pipeline.optimize(model, "memory", composed="tails_first")
    kept = result.of(TailsFirstResult).tails_first
    assert kept, result.of(TailsFirstResult).note
    graph = result.graph
    flow = split.split(graph).gradient_flow
    waiting = [n for n in graph.nodes() if graph.op(n) in HEAVY and n in flow
               and set(kept) & set(graph.control_inputs(n))]
    # the other head's first matrix gradients: none computed from the gradient it waits for
    downstream = nx.descendants(model.graph.nx, kept[0])
    assert waiting and not set(waiting) & downstream, waiting
    assert result.predicted_peaks[1] < result.predicted_peaks[0]
    outcome = verify.verify(model, io.load(_save(model, result, tmp_path)),
                            verify.VerifyOptions(runs=0, repeat=9), isolated=False)
    assert outcome.match and outcome.rewritten.peak_bytes <= outcome.original.peak_bytes * 1.02


def _save(model, result, tmp_path):
    out = tmp_path / "rewritten.meta"
    io.save(model, result.graph, out)
    return out
