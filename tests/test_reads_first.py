"""Reads of a variable that nothing orders against its update run before it in a rewrite: the
value the original's schedule read (an Estimator-style step's weight histograms)."""

import networkx as nx
import pytest
import tensorflow as tf

from graphrewrite.passes import reads_first

from tfgraphs import build, placeholder


def _step(resource: bool):
    """A weight trained by SGD, its histogram beside the train op, and a second histogram no
    fetch needs."""
    def graph():
        w = tf.compat.v1.get_variable("w", [256], use_resource=resource)
        loss = tf.reduce_sum(placeholder() * w, name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        tf.compat.v1.summary.histogram("seen", w)
        tf.compat.v1.summary.histogram("unfetched", w)
    return build(graph)


def _update(graph):
    return next(n for n in graph.nodes() if "ApplyGradientDescent" in graph.op(n))


@pytest.mark.parametrize("resource", [True, False])
def test_a_fetched_summary_of_a_weight_reads_it_before_its_update(resource):
    graph = _step(resource)
    update = _update(graph)
    assert not nx.has_path(graph.nx, "seen", update)  # the race
    ordered = reads_first.order(graph, ["train", "seen", "loss"])
    # a resource read is a snapshot: the read is ordered; a ref's Identity is the buffer
    # itself: its reader, the histogram, is. (So is the loss's product: the gradient of a
    # product by a weight does not read the weight, so nothing orders that read either.)
    seen = graph.data_inputs("seen")[1].node if resource else "seen"
    assert seen in ordered and seen in graph.control_inputs(update)
    assert all(name in graph.control_inputs(update) for name in ordered)
    assert not nx.has_path(graph.nx, "unfetched", update)  # no fetch runs it: left alone
    assert graph.check() == []


def test_reads_the_update_needs_or_that_come_after_it_are_left_alone():
    def graph():
        w = tf.compat.v1.get_variable("w", [256], use_resource=True)
        loss = tf.reduce_sum(placeholder() * w, name="loss")
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        with tf.control_dependencies([train]):
            tf.identity(w.read_value(), name="after")
    step = build(graph)
    before = step.nx.number_of_edges()
    assert reads_first.order(step, ["train", "loss", "after"]) == []
    assert step.nx.number_of_edges() == before
