"""The step memory model on graphs whose peak can be worked out by hand (1 KiB tensors)."""

import tensorflow as tf

from graphrewrite.analysis import memory, schedule, shapes
from graphrewrite.core.tensor_ref import TensorRef

from tfgraphs import KIB_FLOATS, build, const, placeholder

KIB = 1024


def simulate(graph, fetches):
    return memory.simulate(graph, shapes.infer(graph), fetches)


def test_elementwise_chain_writes_in_place():
    # x (fed, 1 KiB, lives throughout) -> Neg allocates 1 KiB; Exp and Sqrt reuse Neg's buffer.
    def chain():
        tf.sqrt(tf.exp(tf.negative(placeholder()), name="e"), name="s")
    report = simulate(build(chain), ["s"])
    assert report.peak() == 2 * KIB
    assert [b.owner.node for b in report.buffers] == ["x", "Neg"]


def test_matmul_chain_holds_input_and_output_together():
    # w: 1 KiB... as [16,16] constant; x: [16,16]; three matmuls, each output dies at the next.
    def chain():
        x = placeholder(shape=(16, 16))
        w = const("w", (16, 16))
        tf.matmul(tf.matmul(tf.matmul(x, w, name="m1"), w, name="m2"), w, name="m3")
    report = simulate(build(chain), ["m3"])
    # persistent x + w (2 KiB) + at most input and output of one matmul (2 KiB)
    assert report.persistent_bytes["device"] == KIB
    assert report.peak() == 4 * KIB


def test_the_floor_is_the_state_beside_the_kernel_with_the_most_operands():
    # x and w 1 KiB each, a and b 1 KiB each; the concat reads both and writes 2 KiB: 4 KiB
    # of operands, the most of any kernel, beside the constants (w, and the concat's axis)
    # and the fed x, which the caller holds the whole step.
    def graph():
        x = placeholder(shape=(16, 16))
        w = const("w", (16, 16))
        a = tf.matmul(x, w, name="a")
        b = tf.matmul(a, w, name="b")
        tf.reduce_sum(tf.concat([a, b], 0, name="cat"), name="out")
    report = simulate(build(graph), ["out"])
    assert report.persistent_bytes["device"] >= KIB
    assert report.floor() == (report.persistent_bytes["device"] + 5 * KIB, "cat")
    assert report.floor()[0] <= report.allocated_peak()


def test_a_fed_input_counts_once_in_the_floor():
    """The fed input is held beside every kernel; it is no kernel's operands itself (a
    SavedModel's step, one call node as written, had its floor 1.7 MiB above its peak: the
    images counted twice)."""
    def graph():
        x = placeholder(shape=(16, 16))
        tf.reduce_sum(x, name="out")
    report = simulate(build(graph), ["out"])
    assert report.floor() == (report.persistent_bytes["device"] + KIB + 4, "out")
    assert report.floor()[0] <= report.peak()


def test_value_kept_for_a_late_consumer_stays_live():
    # a = Neg(x) is read again by the last op: a, b=Exp(a)... cannot reuse a's buffer.
    def graph():
        x = placeholder()
        a = tf.negative(x, name="a")
        b = tf.matmul(tf.reshape(a, (16, 16)), tf.reshape(a, (16, 16)), name="b")
        tf.add(tf.reshape(b, (KIB_FLOATS,)), a, name="out")
    report = simulate(build(graph), ["out"])
    # x + a + b live together (out writes into b's buffer, which dies with it), plus the
    # Reshape shape constants: int32 [2], [2] and [1] = 20 bytes.
    assert report.peak() == 3 * KIB + 20
    assert {str(ref) for ref, size in report.live_at_peak["device"] if size == KIB} == \
        {"x", "a", "b"}


def test_fetched_intermediate_lives_to_the_end():
    def graph():
        x = placeholder()
        a = tf.negative(x, name="a")
        tf.matmul(tf.reshape(a, (16, 16)), tf.reshape(a, (16, 16)), name="b")
    report = simulate(build(graph), ["a", "b"])
    a = next(b for b in report.buffers if b.owner.node == "a")
    assert a.pinned and a.end is None


def test_only_what_the_fetches_need_runs():
    def graph():
        x = placeholder()
        tf.negative(x, name="used")
        tf.exp(x, name="unused")
    report = simulate(build(graph), ["used"])
    assert "unused" not in report.order


def test_schedule_is_breadth_first_from_sources_in_file_order():
    def graph():
        x = placeholder()
        a1 = tf.negative(x, name="a1")
        b1 = tf.exp(x, name="b1")
        tf.negative(a1, name="a2")
        tf.exp(b1, name="b2")
    order = schedule.schedule(build(graph), ["a2", "b2"])
    assert order == ["x", "a1", "b1", "a2", "b2"]


def chains_after_a_barrier(count: int = 6):
    """`count` chains x_i -> Neg -> Exp -> Sqrt -> Mul(x) -> Sum that all become ready when one
    NoOp runs (a moving average's updates after the optimizer's)."""
    def graph():
        barrier = tf.no_op(name="barrier")
        for i in range(count):
            x = placeholder(f"x{i}")
            with tf.control_dependencies([barrier]):
                a = tf.negative(x, name=f"a{i}")
            tf.reduce_sum(tf.multiply(tf.sqrt(tf.exp(a)), x), name=f"out{i}")
    return build(graph), [f"out{i}" for i in range(count)]


def test_the_cpu_executor_runs_one_chain_per_thread_at_a_time():
    """First come first served, every chain's first value is made before any chain ends; on
    TensorFlow's CPU pool (two threads, each continuing the chain it is on) at most two chains
    hold a value at once: as measured on eight moving-average updates (+15% modelled)."""
    graph, fetches = chains_after_a_barrier()
    found = shapes.infer(graph)
    in_order = memory.simulate(graph, found, fetches, "cpu")
    pooled = memory.simulate(graph, found, fetches, "cpu", executor=True)
    assert in_order.peak() // KIB == 6 + 6  # six inputs, six chains' values (and scalars)
    assert pooled.peak() // KIB == 2  # the inputs fed are the session's as it runs on a CPU
    assert pooled.peak(memory.HOST) // KIB == 6
    order = pooled.order
    assert sorted(order) == sorted(in_order.order)
    for i in range(6):  # each chain runs straight through on its thread
        steps = [order.index(f"{op}{i}") for op in ("a", "out")]
        assert steps[1] - steps[0] <= 2 * 5
    # the same step on a GPU: every kernel inline, in order
    assert memory.simulate(graph, found, fetches, "gpu", executor=True).order == in_order.order


def test_the_cpu_executor_runs_a_shape_read_as_its_input_is_made():
    """`Shape` is an inexpensive kernel: the executor runs it on the thread that made its input
    ready, at once, not queued behind other work. Queued, a convolution gradient's `ShapeN`
    held every forward activation of a rewritten DenseNet step (modelled 337 MiB, measured
    187)."""
    def graph():
        barrier = tf.no_op(name="barrier")
        for i in range(6):
            x = placeholder(f"x{i}")
            with tf.control_dependencies([barrier]):
                a = tf.exp(x, name=f"a{i}")
            shape = tf.raw_ops.Shape(input=a, name=f"shape{i}")
            tf.reshape(tf.exp(tf.exp(tf.exp(a))), shape, name=f"out{i}")
    graph = build(graph)
    order = memory.simulate(graph, shapes.infer(graph), [f"out{i}" for i in range(6)], "cpu",
                            executor=True).order
    for i in range(6):  # two threads taking turns: the other may run one kernel between
        between = order[order.index(f"a{i}") + 1:order.index(f"shape{i}")]
        assert len([n for n in between if graph.op(n) not in schedule.INLINE_OPS]) <= 1, order


def test_a_long_kernel_on_one_cpu_thread_lets_the_other_run_short_ones_meanwhile():
    """The executor's threads run in time, not in turns: while one multiplies two 512 x 512
    matrices (about a millisecond), the other runs a chain of six tiny kernels. Modelled in
    turns, a TF2 MLP's optimizer updates fell behind its backward pass and the weight gradients
    waiting for them were held (+37% modelled on one built outside the repo, now +2%)."""
    def graph():
        x = tf.compat.v1.placeholder(tf.float32, [512, 512], name="x")
        tf.exp(tf.matmul(x, x, name="long"), name="after")
        value = x[0, :4]
        for i in range(6):
            value = tf.exp(value, name=f"s{i}")
    graph = build(graph)
    order = memory.simulate(graph, shapes.infer(graph), ["after", "s5"], "cpu",
                            executor=True).order
    assert order.index("long") < order.index("s1") < order.index("s5") < order.index("after")


def test_cpu_pinned_nodes_are_host_memory_next_to_an_accelerator():
    def graph():
        with tf.device("/device:GPU:0"):
            x = placeholder()
            a = tf.negative(x, name="a")
        with tf.device("/device:CPU:0"):
            h = tf.identity(tf.exp(a), name="h")
        with tf.device("/device:GPU:0"):
            tf.negative(h, name="out")
    report = simulate(build(graph), ["out"])
    assert report.peak("host") == KIB
    # x with a, then x with out (a fresh buffer: h lives on the host); never three at once.
    assert report.peak("device") == 2 * KIB


def test_cross_entropy_writes_the_logits_gradient_over_the_logits():
    """TensorFlow's xent kernels forward the logits' buffer to their backprop output when the
    logits die there: one buffer, not two."""
    def loss_of_logits():
        x = tf.compat.v1.placeholder(tf.float32, [256, 1000], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [256], name="labels")
        logits = tf.multiply(x, 2.0, name="logits")  # its gradient does not read it
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        tf.reduce_mean(loss, name="loss")
        tf.compat.v1.gradients(loss, [x])[0]

    graph = build(loss_of_logits)
    report = memory.simulate(graph, shapes.infer(graph))
    xent = next(n for n in graph.nodes() if graph.op(n) == "SparseSoftmaxCrossEntropyWithLogits")
    owner = report.buffer_of[TensorRef(xent, 1)].owner
    assert owner == TensorRef("logits")


def test_readers_of_an_identity_n_grappler_removes_wait_only_for_their_own_input():
    """A TF2 step's IdentityN over every gradient: as run (Grappler removes it), each optimizer
    update starts when its own gradient is ready, not when the last one is."""
    def graph():
        x = placeholder()
        a = tf.negative(x, name="a")
        c = tf.exp(tf.exp(tf.exp(a, name="c1"), name="c2"), name="c3")
        both = tf.identity_n([a, c], name="both")
        tf.negative(both[0], name="ra")
        tf.negative(both[1], name="rc")
    built = build(graph)
    order = schedule.schedule(built, ["ra", "rc"])
    assert len(order) == len(set(order))
    assert order.index("ra") < order.index("c3")
    report = simulate(built, ["ra", "rc"])
    assert not [b for b in report.buffers if b.owner.node == "both"]  # a view, no buffer


def test_a_savers_restore_pinned_to_the_cpu_does_not_make_a_gpu_graph():
    """TensorFlow pins a Saver's `RestoreV2` (and its string constants) to the CPU on any
    machine: a TF1 Inception MetaGraphDef built on a CPU was modelled as written as a GPU's step
    (its swap report set a CPU original beside a GPU rewrite: 0.29x, 0.43x on one device). A
    tensor pinned there beside unplaced ones, as a swap copy is, still means a GPU's step."""

    def step(pinned):
        x = placeholder("x")
        y = tf.nn.relu(x, name="y")
        with tf.device("/device:CPU:0"):
            tf.identity(y, name="copy") if pinned else None
        tf.compat.v1.get_variable("w", [4])
        tf.compat.v1.train.Saver()

    saver_only, swapped = build(lambda: step(False)), build(lambda: step(True))
    assert any("CPU" in saver_only.node_def(n).device for n in saver_only.nodes())
    assert not memory.cpu_is_host(saver_only)
    assert memory.cpu_is_host(swapped)


def test_a_v1_conds_untaken_side_never_runs():
    """A v1 cond (control flow v2 off) on an unfed `PlaceholderWithDefault` (Keras's learning
    phase) takes its default side: the other side's 16 KiB tile never runs, and the Merge's
    output is the taken side's value, held for the fetch. Fed, either side could run: both are
    counted."""
    from tensorflow.python.ops import control_flow_util

    def graph(phase_op):
        x = placeholder()
        phase = phase_op()
        taken = tf.compat.v1.cond(phase, lambda: tf.reduce_sum(tf.tile(x, [16]), name="big"),
                                  lambda: tf.reduce_sum(tf.negative(x, name="small")))
        tf.identity(taken, name="out")

    was = control_flow_util.ENABLE_CONTROL_FLOW_V2
    control_flow_util.ENABLE_CONTROL_FLOW_V2 = False
    try:
        default = build(lambda: graph(
            lambda: tf.compat.v1.placeholder_with_default(False, (), name="phase")))
        fed = build(lambda: graph(lambda: tf.compat.v1.placeholder(tf.bool, (), name="phase")))
    finally:
        control_flow_util.ENABLE_CONTROL_FLOW_V2 = was
    report = simulate(default, ["out"])
    assert "cond/Tile" not in report.order and "cond/big" not in report.order
    assert "cond/small" in report.order
    assert report.peak() < 3 * KIB  # x, and Neg's 1 KiB; never the tile's 16
    assert simulate(fed, ["out"]).peak() >= 16 * KIB


def _owners(report):
    return {b.owner.node for b in report.buffers}


def test_whole_first_axis_rows_are_views_of_their_input():
    """`a[1]`, `a[1:3]`, `unstack(a)` and `split(a, 2)` of [4, 16, 16] float32 rows (1 KiB:
    aligned) share `a`'s buffer, as TensorFlow's kernels hand them out; `a` lives on while
    they are read (a dieted weight's slices held its whole float32 copy: `row_views`)."""
    def graph():
        a = tf.negative(placeholder(shape=(4, 16, 16)), name="a")
        parts = [a[1], a[1:3][0], tf.unstack(a, name="rows")[2],
                 tf.split(a, 2, name="halves")[1][0]]
        tf.add_n([tf.matmul(p, p) for p in parts], name="out")
    report = simulate(build(graph), ["out"])
    assert not {"strided_slice", "strided_slice_1", "rows", "halves"} & _owners(report)
    a = next(b for b in report.buffers if b.owner.node == "a")
    last = max(report.order.index(n) for n in report.order if n.startswith("MatMul"))
    assert a.end == last


def test_rows_that_are_not_aligned_or_strided_are_copies():
    """Rows of 3 floats (12 bytes) are not aligned: a copy; every other row (stride 2) and a
    slice across the second axis are copies whatever the alignment."""
    def graph():
        a = tf.negative(placeholder(shape=(4, 3)), name="a")
        b = tf.negative(placeholder("y", shape=(4, 16, 16)), name="b")
        tf.add_n([tf.reduce_sum(t) for t in (a[1:3], b[::2], b[:, 1:3], tf.unstack(b, axis=1)[0])],
                 name="out")
    report = simulate(build(graph), ["out"])
    assert {"strided_slice", "strided_slice_1", "strided_slice_2", "unstack"} <= \
        _owners(report)
