"""The relax-assign pass: Grappler's allocator mark on Assigns whose result stays on-device."""

import tensorflow as tf

from graphrewrite.passes import relax_assign
from graphrewrite.passes.relax_assign import RELAX_ATTR

from tfgraphs import build


def ref_variable_graph(reader_device=""):
    def fn():
        with tf.device(""):
            var = tf.compat.v1.Variable(tf.zeros((4,)), use_resource=False, name="v")
            assigned = tf.compat.v1.assign(var, tf.ones((4,)), name="set_v")
        with tf.device(reader_device):
            tf.exp(assigned, name="read")
    return build(fn)


def relaxed(graph):
    result = relax_assign.run(graph, None, relax_assign.RelaxAssignOptions())
    return result, [n for n in result.graph.nodes() if RELAX_ATTR in result.graph.node_def(n).attr]


def test_assigns_whose_readers_share_the_device_are_marked():
    graph = ref_variable_graph()
    result, marked = relaxed(graph)
    assert "set_v" in marked and result.relaxed_assigns == marked
    assert all(result.graph.op(n) == "Assign" for n in marked)
    assert RELAX_ATTR not in graph.node_def("set_v").attr  # the input graph is untouched


def test_an_assign_read_on_another_device_is_not_marked():
    result, marked = relaxed(ref_variable_graph("/device:CPU:1"))
    assert "set_v" not in marked


def test_graphs_without_assigns_are_unchanged():
    graph = build(lambda: tf.exp(tf.zeros((4,)), name="e"))
    result, marked = relaxed(graph)
    assert not result.modified and not marked
