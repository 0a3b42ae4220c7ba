"""Small graphs built with TensorFlow's Python API, for tests that need real ops and shapes."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from graphrewrite.core.graph import Graph

KIB_FLOATS = 256  # 256 float32 = 1 KiB


def build(fn) -> Graph:
    """Run `fn()` inside a fresh tf.Graph and return it as our Graph."""
    with tf.Graph().as_default() as g:
        fn()
    return Graph.from_graph_def(g.as_graph_def())


def placeholder(name="x", shape=(KIB_FLOATS,)):
    return tf.compat.v1.placeholder(tf.float32, shape, name=name)


def const(name, shape, value=0.5):
    return tf.constant(np.full(shape, value, np.float32), name=name)
