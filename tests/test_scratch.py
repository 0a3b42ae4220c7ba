"""Kernel scratch per device kind: the CPU's convolution-gradient column buffers (calibrated)
and a GPU's cuDNN workspace (an unmeasured estimate), and --device choosing between them."""

import json

import numpy as np
import tensorflow as tf

from graphrewrite.analysis import memory, scratch, shapes
from graphrewrite.core.graph import Graph

from conftest import fixture_path, run_cli

MIB = 1 << 20


def conv_step(device: str = "") -> Graph:
    """A convolution [8, 64, 64, 16] -> 32 channels and both its gradients."""
    with tf.Graph().as_default() as g, tf.device(device or None):
        x = tf.compat.v1.placeholder(tf.float32, (8, 64, 64, 16), name="x")
        w = tf.constant(np.full((3, 3, 16, 32), 0.1, np.float32), name="w")
        y = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
        dx, dw = tf.gradients(tf.reduce_sum(y), [x, w])
        tf.identity(dx, name="dx")
        tf.identity(dw, name="dw")
    return Graph.from_graph_def(g.as_graph_def())


def scratch_by_op(graph: Graph, kind: str) -> dict[str, int]:
    found = shapes.infer(graph)
    return {graph.op(n): scratch.kernel_bytes(kind, graph, found, n) for n in graph.nodes()
            if scratch.kernel_bytes(kind, graph, found, n)}


def test_gpu_workspace_estimate_is_the_largest_operand():
    ops = scratch_by_op(conv_step(), "gpu")
    output = 8 * 64 * 64 * 32 * 4  # the forward output and the gradient it reads: 4 MiB
    assert ops == {"Conv2D": output, "Conv2DBackpropInput": output,
                   "Conv2DBackpropFilter": output}


def test_cpu_scratch_is_only_the_gradients():
    assert set(scratch_by_op(conv_step(), "cpu")) == {"Conv2DBackpropInput",
                                                      "Conv2DBackpropFilter"}


def conv3d_gradients(batch: int, channels: int) -> Graph:
    """Both gradients of a 3x3x3 convolution over [batch, 8, 32, 32, channels] volumes."""
    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(tf.float32, (batch, 8, 32, 32, channels), name="x")
        w = tf.constant(np.full((3, 3, 3, channels, channels), 0.1, np.float32), name="w")
        dx, dw = tf.gradients(tf.reduce_sum(tf.nn.conv3d(x, w, [1] * 5, "SAME")), [x, w])
        tf.identity(dx, name="dx")
        tf.identity(dw, name="dw")
    return Graph.from_graph_def(g.as_graph_def())


def test_a_3d_convolutions_gradients_fill_the_whole_l3_cache(monkeypatch):
    """Measured on a Xeon whose L3 holds 260 MiB: the weights' gradient over 8 volumes of
    8x32x32x32 took 270.1 MiB beside its 108 KiB of tensors, the input's 278.0 MiB beside its
    8 MiB output: ten volumes' column buffers of 8192 positions by 864 filter taps."""
    monkeypatch.setattr(scratch, "l3_cache_bytes", lambda: 260 * MIB)
    column = 10 * 8192 * 864 * 4
    assert scratch_by_op(conv3d_gradients(8, 32), "cpu") == {
        "Conv3DBackpropInputV2": column, "Conv3DBackpropFilterV2": column}
    # a batch of one: the input's gradient contracts one volume at a time
    assert scratch_by_op(conv3d_gradients(1, 32), "cpu")["Conv3DBackpropInputV2"] == \
        8192 * 864 * 4
    # 16 channels: the buffer would exceed 25 times the tensors; Eigen's kernel takes none
    assert scratch_by_op(conv3d_gradients(8, 16), "cpu") == {}
    monkeypatch.setattr(scratch, "l3_cache_bytes", lambda: 30 * MIB)
    assert scratch_by_op(conv3d_gradients(8, 32), "cpu")["Conv3DBackpropFilterV2"] == \
        2 * 8192 * 864 * 4


def test_workspace_limit_caps_the_estimate(monkeypatch):
    monkeypatch.setenv("TF_CUDNN_WORKSPACE_LIMIT_IN_MB", "1")
    assert set(scratch_by_op(conv_step(), "gpu").values()) == {MIB}
    monkeypatch.delenv("TF_CUDNN_WORKSPACE_LIMIT_IN_MB")
    assert scratch.workspace_limit() == 4 << 30


def test_placement_decides_the_default_kind():
    assert scratch.device_kind(conv_step()) == "cpu"
    placed = conv_step("/device:GPU:0")
    assert scratch.device_kind(placed) == "gpu"
    found = shapes.infer(placed)
    default = memory.simulate(placed, found, ["dx", "dw"])
    assert default.accelerator and default.scratch == \
        memory.simulate(placed, found, ["dx", "dw"], "gpu").scratch
    on_cpu = memory.simulate(placed, found, ["dx", "dw"], "cpu")
    assert not on_cpu.accelerator and set(on_cpu.scratch.values()) != set(default.scratch.values())


def test_inspect_device_changes_the_allocator_peak_not_the_live_tensors():
    peaks = {}
    for device in ("cpu", "gpu"):
        result = run_cli("inspect", fixture_path("resnet_cnn"), "--json", "--device", device)
        assert result.exit_code == 0, result.output
        facts = json.loads(result.output)
        peaks[device] = (facts["peak_bytes"], facts["live_peak_bytes"], facts["host_peak_bytes"])
    assert peaks["cpu"][0] != peaks["gpu"][0]
    # the same live tensors; the fed inputs are the session's on a CPU, the device's on a GPU
    assert peaks["cpu"][1] + peaks["cpu"][2] == peaks["gpu"][1] and peaks["gpu"][2] == 0


def test_a_convolutions_two_gradients_hold_their_scratch_at_once_until_one_waits():
    graph = conv_step()
    found = shapes.infer(graph)
    own = scratch_by_op(graph, "cpu")
    together = memory.simulate(graph, found, ["dx", "dw"], "cpu")
    held = [v for v in together.scratch.values() if isinstance(v, tuple)]
    assert len(held) == 1 and sorted(held[0]) == sorted(own.values())  # two allocations
    filter_grad, input_grad = (next(n for n in graph.nodes() if graph.op(n) == op)
                               for op in ("Conv2DBackpropFilter", "Conv2DBackpropInput"))
    graph.add_control(filter_grad, input_grad)  # what the serialize pass adds
    apart = memory.simulate(graph, shapes.infer(graph), ["dx", "dw"], "cpu")
    assert sorted(apart.scratch.values()) == sorted(own.values())
    assert apart.allocated_peak() < together.allocated_peak()


def test_a_weights_gradient_still_running_holds_its_scratch_beside_the_layer_befores():
    """A weights' gradient runs longer than its input's (`memory.CPU_OP_FLOPS`), so on the
    CPU executor's two threads it is still running when the layer before starts its own: a
    Keras CNN built outside the repo measured 24% over the model that held each gradient's
    scratch only beside its twin's."""
    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(tf.float32, (8, 64, 64, 16), name="x")
        w1, w2 = (tf.constant(np.full(shape, 0.1, np.float32), name=n)
                  for shape, n in (((3, 3, 16, 64), "w1"), ((3, 3, 64, 64), "w2")))
        y = tf.nn.conv2d(tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME")), w2, 1, "SAME")
        for grad, name in zip(tf.gradients(tf.reduce_sum(y), [x, w1, w2]), ("dx", "d1", "d2")):
            tf.identity(grad, name=name)
    graph = Graph.from_graph_def(g.as_graph_def())
    found = shapes.infer(graph)
    report = memory.simulate(graph, found, ["dx", "d1", "d2"], "cpu", executor=True)
    filters = {graph.data_inputs(n)[0].node: n for n in graph.nodes()
               if graph.op(n) == "Conv2DBackpropFilter"}  # by the activation each reads
    first, second = filters["x"], next(n for a, n in filters.items() if a != "x")
    held = {report.order[step]: s for step, s in report.scratch.items()
            if isinstance(s, tuple)}
    assert scratch.kernel_bytes("cpu", graph, found, second) in held[first][1:]


ATTENTION = (8, 128, 8, 64)  # batch, positions, heads, head size: each 2 MiB in float32


def einsum_step(equations: dict[str, tuple]) -> Graph:
    """One `Einsum` per equation (in scopes e0, e1, ...) on placeholders of the given shapes,
    each after the one before: run at once, their matrix products take more blocking buffers."""
    with tf.Graph().as_default() as g:
        before = []
        for k, (equation, operands) in enumerate(equations.items()):
            inputs = [tf.compat.v1.placeholder(tf.float32, shape, name=f"x{k}_{i}")
                      for i, shape in enumerate(operands)]
            with tf.control_dependencies(before):
                before = [tf.einsum(equation, *inputs, name=f"e{k}")]
    return Graph.from_graph_def(g.as_graph_def())


EINSUMS = {  # equation -> operand shapes; the MiB TensorFlow's rule makes scratch, by hand
    "abc,cde->abde": ((8, 128, 512), (512, 8, 64)),  # a projection: no operand moves
    "aecd,abcd->acbe": (ATTENTION, ATTENTION),  # both operands to [a c . d], the product to acbe
    "acbe,aecd->abcd": ((8, 8, 128, 128), ATTENTION),  # the second operand, then the product
    "abcd,aecd->acbe": (ATTENTION, ATTENTION),  # both operands; the product is the output
    "bij->bj": ((64, 512, 256),),  # the reduced label moved last, then summed
    "...ij,jk->...ik": ((8, 128, 512), (512, 512)),  # an ellipsis: not modelled
}
EINSUM_MIB = [0, 2 + 2 + 4, 2 + 2, 2 + 2, 32, 0]


def test_an_einsum_takes_its_transposed_operands_and_product_as_scratch():
    graph = einsum_step(EINSUMS)
    found = shapes.infer(graph)
    for kind in scratch.DEVICE_KINDS:  # the same kernel code on every device
        assert [scratch.kernel_bytes(kind, graph, found, f"e{k}/Einsum") / MIB
                for k in range(len(EINSUMS))] == EINSUM_MIB


def layer_norm_step(dtype=tf.float32) -> Graph:
    """A layer normalization over [512, 64] as Keras runs it (a fused batch norm of the input
    as [1, 512, 64, 1] in NCHW) and its gradient, beside a batch norm in NHWC."""
    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(dtype, (512, 64), name="x")
        y = tf.compat.v1.nn.fused_batch_norm(tf.reshape(x, (1, 512, 64, 1)), tf.ones(512),
                                             tf.zeros(512), data_format="NCHW")[0]
        images = tf.compat.v1.placeholder(dtype, (8, 16, 16, 32), name="images")
        z = tf.compat.v1.nn.fused_batch_norm(images, tf.ones(32), tf.zeros(32))[0]
        dx, dimages = tf.gradients(tf.reduce_sum(y) + tf.reduce_sum(z), [x, images])
        tf.identity(dx, name="dx")
        tf.identity(dimages, name="dimages")
    return Graph.from_graph_def(g.as_graph_def())


def test_a_cpu_batch_norm_copies_an_nchw_input_to_nhwc():
    for dtype, item in ((tf.float32, 4), (tf.float16, 2)):
        graph = layer_norm_step(dtype)
        found = shapes.infer(graph)
        x, images = 512 * 64, 8 * 16 * 16 * 32  # elements
        widened = 4 if item == 2 else 0  # a 16-bit gradient sums in float32
        by_layout = {(graph.op(n), graph.node_def(n).attr["data_format"].s.decode()):
                     scratch.kernel_bytes("cpu", graph, found, n) for n in graph.nodes()
                     if graph.op(n).startswith("FusedBatchNorm")}
        assert by_layout == {
            ("FusedBatchNormV3", "NCHW"): 2 * x * item,
            ("FusedBatchNormGradV3", "NCHW"): 3 * x * item + x * widened,
            ("FusedBatchNormV3", "NHWC"): 0,
            ("FusedBatchNormGradV3", "NHWC"): images * widened}
        assert not any(scratch.kernel_bytes("gpu", graph, found, n) for n in graph.nodes()
                       if graph.op(n).startswith("FusedBatchNorm"))  # cuDNN reads NCHW as is
