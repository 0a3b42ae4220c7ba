"""Sums Grappler's memory optimizer runs as running sums in the original step stay running sums
in the rewrite (`passes.running_sums`): else the two add the same terms in another order."""

import json

import numpy as np
import pytest
from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2

from conftest import run_cli
from graphrewrite.core.graph import Graph
from graphrewrite.core.tensor_ref import TensorRef
from graphrewrite.passes import running_sums

FLOAT = attr_value_pb2.AttrValue(type=1)


def _written():
    """x -> three terms (each read through an Identity, as `tf.gradients` tuples them) -> AddN."""
    graph = Graph()
    graph.add_node("x", "Placeholder", [], {"dtype": FLOAT})
    for term in "abc":
        graph.add_node(term, "Square", [TensorRef("x")], {"T": FLOAT})
        graph.add_node(f"{term}/tuple", "Identity", [TensorRef(term)], {"T": FLOAT})
    graph.add_node("sum", "AddN", [TensorRef(f"{t}/tuple") for t in "abc"],
                   {"T": FLOAT, "N": attr_value_pb2.AttrValue(i=3)})
    graph.add_node("out", "Identity", [TensorRef("sum")], {"T": FLOAT})
    return graph


def _as_run(graph, sums):
    """`graph` as Grappler returns it (Identities gone), the AddNs in `sums` made running sums as
    its memory optimizer makes them (the zeros waiting on term "b")."""
    run = Graph()
    run.add_node("x", "Placeholder", [], {"dtype": FLOAT})
    for term in "abc":
        run.add_node(term, "Square", [TensorRef("x")], {"T": FLOAT})
    shape = attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=4)]))
    if "sum" in sums:
        run.add_node("sum/tmp_var", "TemporaryVariable", [TensorRef("b", -1)],
                     {"dtype": FLOAT, "shape": shape})
        run.add_node("sum/tmp_var_initializer", "Assign", [TensorRef("sum/tmp_var")], {})
        for i, term in enumerate("acb"):
            run.add_node(f"sum/tmp_var_accum_{i}", "AssignAdd",
                         [TensorRef("sum/tmp_var_initializer"), TensorRef(term)], {})
        run.add_node("sum", "DestroyTemporaryVariable",
                     [TensorRef("sum/tmp_var_initializer"),
                      *(TensorRef(f"sum/tmp_var_accum_{i}", -1) for i in range(3))], {})
    else:
        run.add_node("sum", "AddN", [TensorRef(t) for t in "abc"], {"T": FLOAT})
    return run


def test_a_sum_the_original_runs_as_a_running_sum_is_found_through_its_terms_identities():
    graph = _written()
    original, rewritten = _as_run(graph, {"sum"}), _as_run(graph, set())
    sums = running_sums.missing(original, rewritten, graph)
    assert list(sums) == ["sum"] and sums["sum"][:2] == ({"a", "b", "c"}, "b")
    assert running_sums.missing(original, original, graph) == {}  # the rewrite runs it so too
    other = _written()
    other.redefine("sum", "AddN", [TensorRef("a/tuple"), TensorRef("b/tuple")],
                   {"T": FLOAT, "N": attr_value_pb2.AttrValue(i=2)})
    assert running_sums.missing(original, rewritten, other) == {}  # not the same terms


@pytest.mark.tf
def test_a_running_sum_written_as_grappler_writes_it_imports_and_adds_the_terms():
    import tensorflow as tf

    graph = _written()
    original = _as_run(graph, {"sum"})
    graph.set_attr("x", "shape", original.node_def("sum/tmp_var").attr["shape"])
    assert running_sums.make_running(graph, running_sums.missing(
        original, _as_run(graph, set()), graph)) == ["sum"]
    assert graph.op("sum") == "DestroyTemporaryVariable"
    zeros_read = graph.data_inputs("sum/tmp_var_zeros")[0]
    assert zeros_read == TensorRef("b/tuple")  # the term Grappler's zeros waited for
    with tf.Graph().as_default() as imported:
        tf.graph_util.import_graph_def(graph.to_graph_def(), name="")
        with tf.compat.v1.Session(graph=imported) as session:
            x = np.arange(4, dtype=np.float32)
            assert session.run("out:0", {"x:0": x}).tolist() == (3 * x * x).tolist()


def _wide_batch_norm_mlp(path, layers=10, width=2048, batch=512):
    """h111's recipe (a graph built outside the repo): Dense, `batch_normalization(training=
    True)` and ReLU per layer, UPDATE_OPS before Adagrad. Large enough (about 500 MiB) that
    Grappler's estimate passes 80% of the CPU device's 256 MiB and it runs the last batch
    norm's input gradient, an AddN of three, as a running sum."""
    import tensorflow as tf

    tf1 = tf.compat.v1
    with tf.Graph().as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [batch, 64], name="x")
        y = tf1.placeholder(tf.int32, [batch], name="y")
        h = x
        for _ in range(layers):
            h = tf1.layers.dense(h, width, use_bias=False)
            h = tf.nn.relu(tf1.layers.batch_normalization(h, training=True))
        logits = tf1.layers.dense(h, 10)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = tf1.train.AdagradOptimizer(0.05).minimize(loss)
        tf1.add_to_collection("train_op", train_op)
        tf1.train.export_meta_graph(filename=str(path),
                                    saver_def=tf1.train.Saver().as_saver_def())


@pytest.mark.tf
def test_a_swapped_step_sums_as_the_original_step_as_run_does(tmp_path):
    """h111 in mode swap differed by 2e-4 after two steps: Grappler ran the last batch norm's
    input gradient as a running sum in the original (a term live at its estimated peak) and
    not in the rewrite (the swap moved the peak). A running sum adds its terms as they arrive,
    so the original may differ from itself: verify's verdict is MATCH or WITHIN SPREAD."""
    from graphrewrite.analysis import grappler
    from graphrewrite.core import io
    from graphrewrite.execution import mismatch
    from graphrewrite.pipeline import run as pipeline

    source, out = tmp_path / "mlp.meta", tmp_path / "mlp_swap.meta"
    _wide_batch_norm_mlp(source)
    result = run_cli("optimize", source, "-o", out, "--mode", "swap", "--json")
    assert result.exit_code == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["swapped"] and "running sum" in facts["note"], facts["note"]
    summed = []
    for path in (source, out):
        model = io.load(path)
        fetches = list(model.meta_graph.collection_def["train_op"].node_list.value)
        summed.append(set(running_sums.running_sums(grappler.as_run(model.graph, fetches))))
    assert summed[0] and summed[0] == summed[1]
    result = run_cli("verify", source, out, "--runs", "1", "--int-high", "10")
    # bitwise, within the original's own spread, or (its terms raced) the original's own race
    assert result.exit_code == 0 or mismatch.ORIGINAL_CAUSE in result.output, result.output
    # Without the step as run, optimize cannot know: verify's diagnosis names the sum.

    original = io.load(source)
    blind = pipeline.optimize(original, "swap", as_run=False)
    assert mismatch.running_sums_apart(original.runnable(), original.with_graph(blind.graph),
                                       fetches) == sorted(summed[0])
