"""Variables changing buffers in the allocator's replay: copy-on-write updates and adopted values.

One 1 KiB resource variable `v`, read once (`r`); a reader of `r` and an update of `v` in the
orders that decide whether TensorFlow copies the variable first.
"""

import tensorflow as tf

from graphrewrite.analysis import memory, shapes
from graphrewrite.core.tensor_ref import TensorRef

from tfgraphs import KIB_FLOATS, build, placeholder

KIB = 1024


def variable_and_read():
    handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[KIB_FLOATS], shared_name="v",
                                    name="v")
    return handle, tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32, name="r")


def simulate(fn, fetches):
    graph = build(fn)
    return graph, memory.simulate(graph, shapes.infer(graph), fetches)


def test_an_update_before_a_pending_reader_copies_the_variable_until_that_reader_ran():
    def graph():
        handle, read = variable_and_read()
        x = placeholder()
        update = tf.raw_ops.AssignSubVariableOp(resource=handle, value=tf.exp(x), name="u")
        with tf.control_dependencies([update]):
            tf.negative(read, name="late")
    built, report = simulate(graph, ["late"])
    (move,) = report.moves
    assert move.new is None and move.variable.owner == TensorRef("v")
    assert (report.order[move.step], report.order[move.free_at]) == ("u", "late")
    # x, v and Exp(x) at the update; the copy adds v's KiB there (the liveness peak does not)
    assert report.allocated_peak() == report.peak() + KIB


def test_an_update_that_waits_for_every_reader_writes_in_place():
    def graph():
        handle, read = variable_and_read()
        x = placeholder()
        late = tf.negative(read, name="late")
        with tf.control_dependencies([late]):
            tf.raw_ops.AssignSubVariableOp(resource=handle, value=tf.exp(x), name="u")
    _, report = simulate(graph, ["u", "late"])
    assert report.moves == []
    assert report.allocated_peak() == report.peak()


def test_an_update_racing_a_reader_it_does_not_wait_for_copies_while_that_reader_runs():
    # The schedule runs the reader first, but nothing makes the update wait for it: on another
    # thread the update can run while the reader still holds the read.
    def graph():
        handle, read = variable_and_read()
        x = placeholder()
        tf.negative(read, name="reader")
        tf.raw_ops.AssignSubVariableOp(resource=handle, value=tf.exp(tf.exp(x)), name="u")
    _, report = simulate(graph, ["reader", "u"])
    (move,) = report.moves
    assert move.new is None
    assert report.order[move.step] == report.order[move.free_at] == "reader"


def test_assign_variable_makes_the_variable_share_its_value_buffer():
    def graph():
        handle, _ = variable_and_read()
        x = placeholder()
        tf.raw_ops.AssignVariableOp(resource=handle, value=tf.exp(x, name="e"), name="a")
    _, report = simulate(graph, ["a"])
    (move,) = report.moves
    assert move.new.owner == TensorRef("e") and report.order[move.step] == "a"
    # No byte more: the old buffer goes as the value's stays.
    assert report.allocated_peak() == report.peak()


def test_a_reference_variables_apply_writes_in_place():
    """TF1 graphs with reference variables (`disable_v2_behavior`) update them with `Apply*`
    kernels whose output is the variable itself: no buffer of its size (an unseen gradient
    accumulation step's ApplyMomentum was counted as 1 MiB more at its update)."""
    def graph():
        tf.compat.v1.disable_resource_variables()
        v = tf.compat.v1.get_variable("v", [KIB_FLOATS], use_resource=False)
        grad = tf.exp(placeholder(), name="grad")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).apply_gradients([(grad, v)],
                                                                           name="train")
        tf.compat.v1.enable_resource_variables()

    built, report = simulate(graph, ["train"])
    apply = next(n for n in built.nodes() if built.op(n) == "ApplyGradientDescent")
    assert report.buffer_of[TensorRef(apply)] is report.buffer_of[TensorRef("v")]
    # x, its exponential, the variable and the rate (4 bytes): nothing more at the update
    assert report.peak() == 3 * KIB + 4


def test_a_variable_a_sparse_op_touches_is_copied_by_every_read_and_dense_write():
    """An embedding's gather puts its variable in copy-on-read mode (TensorFlow's
    `EnsureSparseVariableAccess`): the read makes a copy of it, and assigning a value copies
    the value into a new buffer rather than taking the value's, the old one freed as it ends."""
    def graph():
        handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[KIB_FLOATS // 4, 4],
                                        shared_name="table", name="table")
        rows = tf.raw_ops.ResourceGather(resource=handle, indices=[0, 1], dtype=tf.float32,
                                         name="gather")
        read = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32, name="r")
        with tf.control_dependencies([rows]):
            tf.raw_ops.AssignVariableOp(resource=handle, value=tf.exp(read, name="e"), name="a")
    built, report = simulate(graph, ["gather", "a"])
    assert report.buffer_of[TensorRef("r")] is not report.buffer_of[TensorRef("table")]
    (move,) = report.moves
    assert move.new is None and report.order[move.step] == report.order[move.free_at] == "a"
    # at the assignment: the table, its value e and the new copy of the table
    assert report.allocated_peak() >= 3 * KIB > report.peak()
