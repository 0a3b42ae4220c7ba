import tensorflow as tf

from graphrewrite.analysis import flops, shapes

from tfgraphs import build, const


def flops_of(fn, name):
    graph = build(fn)
    return flops.node_flops(graph, shapes.infer(graph), name)


def test_matmul_counts_multiply_adds_twice():
    def fn():
        tf.matmul(const("a", (8, 32)), const("b", (32, 16)), name="mm")
    assert flops_of(fn, "mm") == 2 * 8 * 16 * 32


def test_transposed_matmul_uses_the_contracted_dimension():
    def fn():
        tf.matmul(const("a", (32, 8)), const("b", (32, 16)), transpose_a=True, name="mm")
    assert flops_of(fn, "mm") == 2 * 8 * 16 * 32


def test_batch_matmul():
    def fn():
        tf.matmul(const("a", (4, 8, 32)), const("b", (4, 32, 16)), name="bmm")
    assert flops_of(fn, "bmm") == 2 * 4 * 8 * 16 * 32


def test_conv2d_and_its_gradients_cost_the_same():
    def fn():
        x = const("x", (2, 8, 8, 3))
        w = const("w", (3, 3, 3, 4))
        y = tf.nn.conv2d(x, w, 1, "SAME", name="conv")
        tf.compat.v1.gradients(tf.reduce_sum(y), [x, w])
    graph = build(fn)
    info = shapes.infer(graph)
    expected = 2 * (2 * 8 * 8 * 4) * (3 * 3 * 3)
    assert flops.node_flops(graph, info, "conv") == expected
    for name in graph.nodes():
        if "Backprop" in graph.op(name):
            assert flops.node_flops(graph, info, name) == expected, name


def test_conv3d_and_its_gradients_cost_the_same():
    """A video CNN's Conv3D was priced at one FLOP per output element."""
    def fn():
        x = const("x", (2, 4, 8, 8, 3))
        w = const("w", (3, 3, 3, 3, 4))
        y = tf.nn.conv3d(x, w, [1, 1, 1, 1, 1], "SAME", name="conv")
        tf.compat.v1.gradients(tf.reduce_sum(y), [x, w])
    graph = build(fn)
    info = shapes.infer(graph)
    expected = 2 * (2 * 4 * 8 * 8 * 4) * (3 * 3 * 3 * 3)
    assert flops.node_flops(graph, info, "conv") == expected
    gradients = [n for n in graph.nodes() if "Backprop" in graph.op(n)]
    assert len(gradients) == 2 and all(flops.node_flops(graph, info, n) == expected
                                       for n in gradients), gradients


def test_einsum_and_elementwise():
    def fn():
        tf.einsum("bij,bjk->bik", const("a", (2, 3, 4)), const("b", (2, 4, 5)), name="e")
        tf.nn.relu(const("c", (10, 10)), name="r")
    graph = build(fn)
    info = shapes.infer(graph)
    einsum = next(n for n in graph.nodes() if graph.op(n) == "Einsum")
    assert flops.node_flops(graph, info, einsum) == 2 * 2 * 3 * 4 * 5
    assert flops.node_flops(graph, info, "r") == 100
