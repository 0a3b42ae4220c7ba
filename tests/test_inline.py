"""Inlining the calls of functions that run a loop (a TF2 Keras RNN's forward and backward)."""

import numpy as np
import pytest
import tensorflow as tf

from graphrewrite import inline


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
