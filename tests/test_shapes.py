import logging

import pytest
import tensorflow as tf

from graphrewrite.analysis import memory, shapes
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.core.tensor_ref import TensorRef

from tfgraphs import build


def unknown_batch_graph():
    def graph():
        x = tf.compat.v1.placeholder(tf.float32, (None, 8), name="x")
        tf.reduce_sum(tf.nn.relu(x, name="r"), name="s")
    return build(graph)


@pytest.mark.parametrize("text, expected", [
    ("x:4,8", ("x", (4, 8))), ("a/b:?,3", ("a/b", (None, 3))), ("s:", ("s", ())),
    ("x:-1,2", ("x", (None, 2))),
])
def test_parse_input_shape(text, expected):
    assert shapes.parse_input_shape(text) == expected


@pytest.mark.parametrize("text", ["x", ":4", "x:a,b", "x:-3"])
def test_parse_input_shape_refuses(text):
    with pytest.raises(ValueError):
        shapes.parse_input_shape(text)


def test_unknown_dimensions_are_reported_not_counted_as_one():
    result = shapes.infer(unknown_batch_graph())
    assert result.nbytes(TensorRef("r")) is None
    assert TensorRef("r") in result.unknown and TensorRef("x") in result.unknown
    assert result.nbytes(TensorRef("s")) == 4


def test_input_shape_fixes_the_placeholder():
    result = shapes.infer(unknown_batch_graph(), {"x": (16, 8)})
    assert result[TensorRef("r")].shape == (16, 8)
    assert result.nbytes(TensorRef("r")) == 16 * 8 * 4
    assert result.unknown == []


def test_input_shape_must_name_a_placeholder():
    with pytest.raises(GraphRewriteError, match="not a node"):
        shapes.infer(unknown_batch_graph(), {"nope": (1,)})
    with pytest.raises(GraphRewriteError, match="not a placeholder"):
        shapes.infer(unknown_batch_graph(), {"r": (1,)})


def test_recorded_output_shapes_fill_gaps():
    graph = unknown_batch_graph()
    attr = graph.node_def("r").attr["_output_shapes"].list.shape.add()
    for size in (32, 8):
        attr.dim.add(size=size)
    assert shapes.infer(graph)[TensorRef("r")].shape == (32, 8)


def test_sizes_only_the_data_decides_are_not_blamed_on_the_inputs(tmp_path, caplog):
    """`Unique`'s output length depends on the ids' values: no --input-shape can fix it, so the
    warning that suggests one is kept for sizes the shapes could give."""
    import logging

    from graphrewrite.analysis import step as analysis
    from graphrewrite.core import io

    def ids_and_their_sum():
        ids = tf.compat.v1.placeholder(tf.int32, [64], name="ids")
        values = tf.compat.v1.placeholder(tf.float32, [64, 8], name="values")
        unique, index = tf.unique(ids)
        tf.math.unsorted_segment_sum(values, index, tf.size(unique), name="summed")

    path = tmp_path / "unique.pb"
    path.write_bytes(build(ids_and_their_sum).to_graph_def().SerializeToString())
    with caplog.at_level(logging.INFO, logger="graphrewrite"):
        found = analysis.analyse(io.load(path))
    assert found.memory.unknown
    messages = [r.getMessage() for r in caplog.records]
    assert any("only the data decides" in m for m in messages)
    assert not any("--input-shape" in m for m in messages)


def test_what_a_data_sized_tensor_computes_is_sized_by_data_and_static_inputs_get_no_advice(
        tmp_path, caplog):
    """A mixture of experts routes rows with `DynamicPartition`: each expert's product, and its
    gradient, has as many rows as the data routed to it, several ops downstream. And where
    every input's shape is known, --input-shape cannot help whatever is left unknown."""
    import logging

    from graphrewrite.analysis import step as analysis
    from graphrewrite.core import io

    def routed():
        x = tf.compat.v1.placeholder(tf.float32, [64, 8], name="x")
        expert = tf.compat.v1.placeholder(tf.int32, [64], name="expert")
        w = tf.constant(0.5, shape=[8, 8], name="w")
        parts = tf.dynamic_partition(x, expert, 2)
        hidden = [tf.nn.relu(tf.matmul(part, w)) for part in parts]
        out = tf.dynamic_stitch(tf.dynamic_partition(tf.range(64), expert, 2), hidden)
        tf.gradients(tf.reduce_sum(out), [w], name="grad")

    path = tmp_path / "routed.pb"
    path.write_bytes(build(routed).to_graph_def().SerializeToString())
    with caplog.at_level(logging.INFO, logger="graphrewrite"):
        found = analysis.analyse(io.load(path))
    matmuls = {r.node for r in found.sized_by_data if "MatMul" in r.node}
    assert "MatMul" in matmuls and any(n.startswith("grad") for n in matmuls)
    assert not any("--input-shape" in r.getMessage() for r in caplog.records)


@pytest.mark.tf
@pytest.mark.parametrize("fixture", ["mlp.pbtxt", "keras_train.meta", "keras_step_tf2.pb",
                                     "rnn_while_v1.pb", "rnn_while_v2.pb", "tape_tf2.pb"])
def test_the_fast_import_infers_what_the_public_importer_does(fixture):
    """The C++ import without Python operations (`imported`) sees the same shapes and dtypes,
    loops and functions included, as `tf.graph_util.import_graph_def`."""
    from pathlib import Path

    from graphrewrite.core import io

    graph_def = io.load(Path(__file__).parent.parent / "fixtures" / fixture).graph.to_graph_def()
    fast = shapes.tensorflow_shapes(graph_def)
    public = {op.name: [(t.dtype.as_datatype_enum,
                         None if t.shape.rank is None else tuple(t.shape.as_list()))
                        for t in op.outputs]
              for op in shapes.imported(graph_def, public=True)}
    assert fast == public
    assert any(shape for outputs in fast.values() for _, shape in outputs)  # shapes were read
    assert len(fast) == len(graph_def.node)


def test_shapes_computed_from_a_large_constants_values_are_inferred():
    """TensorFlow's shape inference evaluates constant subgraphs whatever their inputs' size:
    a fill as long as the sum of a 10,000-element constant has a known length, so inference
    must see every constant's values (dropping large ones to save time inferred 0 here)."""
    import numpy as np

    def graph():
        values = np.zeros(10000, np.float32)
        values[:7] = 1.0
        count = tf.cast(tf.reduce_sum(tf.constant(values)), tf.int32)
        tf.fill(tf.reshape(count, [1]), 1.0, name="f")
    assert shapes.infer(build(graph))[TensorRef("f")].shape == (7,)


def _no_internals(graph_def):
    raise AttributeError("module has no attribute '_PopulateTFImportGraphDefOptions'")


def test_without_the_internals_it_reads_shapes_through_the_public_importer(monkeypatch):
    expected = shapes.infer(unknown_batch_graph(), {"x": (16, 8)}).tensors
    monkeypatch.setattr(shapes, "c_imported", _no_internals)
    assert shapes.infer(unknown_batch_graph(), {"x": (16, 8)}).tensors == expected


def _edited(graph, **changes):
    """`graph` with nodes renamed or given another op: {old name: (new name, new op)}."""
    from graphrewrite.core.graph import Graph

    graph_def = graph.to_graph_def()
    renames = {old: new for old, (new, _) in changes.items()}
    for node in graph_def.node:
        if node.name in changes:
            node.name, node.op = changes[node.name][0], changes[node.name][1] or node.op
        node.input[:] = [("^" if i.startswith("^") else "") + renames.get(i.lstrip("^"),
                                                                        i.lstrip("^"))
                         for i in node.input]
    return Graph.from_graph_def(graph_def)


def two_branches():
    """x (16, 8) -> r = relu(x) -> s = sum(r); x -> other = tanh(x)."""
    def graph():
        x = tf.compat.v1.placeholder(tf.float32, (16, 8), name="x")
        tf.reduce_sum(tf.nn.relu(x, name="r"), name="s")
        tf.tanh(x, name="other")
    return build(graph)


@pytest.mark.parametrize("importer", ["fast", "public"])
def test_an_op_unknown_to_tensorflow_leaves_the_rest_inferred(importer, caplog, monkeypatch):
    """Issue 32: one unregistered op failed TensorFlow's whole import, so every tensor was
    unknown and the modelled peak 0 B. Now only what depends on it is unknown, and its
    `_output_shapes` size it, typed as its reader expects. (The public importer also refuses
    a colocation with a node it does not have.)"""
    if importer == "public":
        monkeypatch.setattr(shapes, "c_imported", _no_internals)
    graph = _edited(two_branches(), r=("r", "MyCustomRelu"))
    graph.node_def("s").attr["_class"].list.s.append(b"loc:@r")  # colocated with the cut node
    with caplog.at_level("WARNING", logger="graphrewrite"):
        result = shapes.infer(graph)
    assert result.nbytes(TensorRef("x")) == result.nbytes(TensorRef("other")) == 16 * 8 * 4
    assert result.nbytes(TensorRef("r")) is None and TensorRef("r") in result.unknown
    assert "left out node 'r' (op 'MyCustomRelu' is not in TensorFlow's op registry)" \
        in caplog.text
    recorded = graph.node_def("r").attr["_output_shapes"].list.shape.add()
    for size in (16, 8):
        recorded.dim.add(size=size)
    result = shapes.infer(graph)
    assert result[TensorRef("r")].shape == (16, 8) and result.nbytes(TensorRef("r")) == 512
    assert result[TensorRef("s")].shape == ()


def test_what_inference_leaves_out_of_a_graph_grappler_wrote_is_no_warning(caplog):
    """The model as run infers the shapes of Grappler's output, whose own nodes can carry stale
    `_output_shapes` (a Keras loss's `ReorderCastLikeAndValuePreserving` cast): nothing a user
    can act on, so it is logged at the level asked, not as a warning."""
    graph = _edited(two_branches(), r=("r", "MyCustomRelu"))
    with caplog.at_level("INFO", logger="graphrewrite"):
        shapes.infer(graph, level=logging.INFO)
    left = [r for r in caplog.records if "left out node 'r'" in r.getMessage()]
    assert left and all(r.levelno == logging.INFO for r in left)


def test_a_node_name_tensorflow_refuses_is_inferred_under_another():
    graph = _edited(two_branches(), r=("r bad!", None))
    result = shapes.infer(graph)
    assert result[TensorRef("r bad!")].shape == (16, 8)
    assert result[TensorRef("s")].shape == () and result.unknown == []
    assert "graphrewrite_import/0" not in {ref.node for ref in result.tensors}


def test_a_node_whose_shape_function_fails_is_left_out():
    """A Reshape of 128 elements to [3, 7] fails TensorFlow's import; only it (and what reads
    it) is left unknown."""
    def graph():
        x = tf.compat.v1.placeholder(tf.float32, (16, 8), name="x")
        tf.reshape(x, tf.compat.v1.placeholder(tf.int32, (2,), name="to"), name="reshaped")
        tf.tanh(x, name="other")
    built = build(graph)
    graph_def = built.to_graph_def()
    to = next(n for n in graph_def.node if n.name == "to")
    to.op = "Const"
    to.attr.clear()
    to.attr["dtype"].type = tf.int32.as_datatype_enum
    to.attr["value"].tensor.CopyFrom(tf.make_tensor_proto([3, 7], tf.int32))
    from graphrewrite.core.graph import Graph

    result = shapes.infer(Graph.from_graph_def(graph_def))
    assert result[TensorRef("other")].shape == (16, 8)
    assert TensorRef("reshaped") not in result.tensors  # left out: no _output_shapes, no reader


@pytest.mark.parametrize("given, conflict", [
    ((8, 8), "conflicts with the placeholder's shape [4, 8]"),
    ((4, 8, 1), "conflicts with the placeholder's shape [4, 8]"),
    ((None, 8), None),  # leaves a dimension unknown: not a conflict
])
def test_an_input_shape_that_conflicts_with_the_placeholders_is_refused(given, conflict):
    def graph():
        tf.nn.relu(tf.compat.v1.placeholder(tf.float32, (4, 8), name="x"), name="r")
    if conflict is None:
        assert shapes.infer(build(graph), {"x": given})[TensorRef("r")].shape == (4, 8)
        return
    with pytest.raises(GraphRewriteError, match="^[^\n]*$") as err:
        shapes.infer(build(graph), {"x": given})
    assert conflict in str(err.value)


def test_an_input_shape_that_conflicts_with_the_graph_is_refused():
    """x's batch is unknown, y's is 4: x:16,8 cannot be added to y. Refused with TensorFlow's
    reason, in one line; the graph itself (without the shape) infers."""
    def graph():
        x = tf.compat.v1.placeholder(tf.float32, (None, 8), name="x")
        tf.add(x, tf.compat.v1.placeholder(tf.float32, (4, 8), name="y"), name="sum")
    assert shapes.infer(build(graph), {"x": (4, 8)})[TensorRef("sum")].shape == (4, 8)
    with pytest.raises(GraphRewriteError, match="^[^\n]*$") as err:
        shapes.infer(build(graph), {"x": (16, 8)})
    assert "input shape x:16,8 conflicts with the graph's shapes" in str(err.value)
    assert "node 'sum'" in str(err.value) and "{{node" not in str(err.value)


def test_optimize_models_and_rewrites_a_graph_with_an_unknown_op(tmp_path):
    """The CLI end of issue 32's row: the MLP with one custom op is modelled (not 0 B) and
    rewritten; a conflicting --input-shape is one line and exit 2."""
    import json

    from conftest import fixture_path, run_cli

    text = fixture_path("mlp").read_text()
    custom = tmp_path / "custom.pbtxt"
    custom.write_text(text.replace('name: "dense_3/Relu"\n  op: "Relu"',
                                   'name: "dense_3/Relu"\n  op: "MyCustomRelu"', 1))
    shown = run_cli("optimize", custom, "-o", tmp_path / "out.pbtxt", "--json", "--no-as-run")
    assert shown.exit_code == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["peak_bytes"]["before"] > 512 * 64 * 4 and report["nodes_added"] > 0
    refused = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "no.pbtxt",
                      "--input-shape", "x:256,64", "--no-as-run")
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1
    assert "conflicts with the placeholder's shape [512, 64]" in refused.stderr
    assert not (tmp_path / "no.pbtxt").exists()


def test_a_node_grappler_made_under_an_old_name_gets_its_own_shape(monkeypatch, tmp_path):
    """Grappler can give a node it made an old node's name (a TF2 step with a loss-scaled
    optimizer and two micro-batches: `mul_1` a scalar product where a [7,16,64] one was). The
    original's shape recorded on it made the importer refuse the graph as run, and every size
    was lost (a 63 MiB step modelled at 0.75 MiB)."""
    from graphrewrite.analysis import grappler
    from graphrewrite.analysis import step as analysis
    from graphrewrite.core import io

    def step(optimized: bool):
        x = tf.compat.v1.placeholder(tf.float32, [7, 16, 64], name="x")
        s = tf.compat.v1.placeholder(tf.float32, [], name="s")
        if optimized:  # what Grappler returned: mul_1 multiplies the scalars first
            tf.identity(x * tf.multiply(s, 2.0, name="mul_1"), name="out")
        else:
            tf.identity(tf.multiply(x, 2.0, name="mul_1") * s, name="out")

    path = tmp_path / "step.pb"
    path.write_bytes(build(lambda: step(False)).to_graph_def().SerializeToString())
    model = io.load(path)
    found = analysis.analyse(model)
    monkeypatch.setattr(grappler, "finish", lambda started: build(lambda: step(True)))
    _, as_run, report = analysis.as_run_step(model, model.graph, found)
    assert as_run[TensorRef("mul_1")].shape == ()
    assert as_run[TensorRef("out")].shape == (7, 16, 64)
    assert report.peak() + report.peak(memory.HOST) >= 2 * 7 * 16 * 64 * 4  # x: fed, host


@pytest.mark.parametrize("stop, rows", [(1, 4), (2, 8), (None, None)])
def test_a_slice_whose_bounds_move_together_is_as_long_as_their_distance(stop, rows):
    """Gradient accumulation's `x[i * mb:(i + 1) * mb]` in a `tf.range` loop: TensorFlow leaves
    the micro-batch's size unknown, and with it the loop body (a CNN step of four micro-batches
    modelled 13 MiB of 81 measured). The bounds move together: the slice is mb long."""
    def graph():
        x = tf.compat.v1.placeholder(tf.float32, [16, 32], name="x")
        i = tf.compat.v1.placeholder(tf.int32, [], name="i")
        j = tf.compat.v1.placeholder(tf.int32, [], name="j")
        end = (i + stop) * 4 if stop else j * 4  # j: bounds that do not move together
        tf.matmul(x[i * 4:end], tf.ones([32, 8]), name="y")
    inferred = shapes.infer(build(graph))
    assert inferred[TensorRef("strided_slice")].shape == (rows, 32)
    assert inferred[TensorRef("y")].shape == (rows, 8)


def test_wheres_splitting_one_tensor_by_value_are_sized_at_an_even_share():
    """A mixture of experts' dispatch, `tf.where(tf.equal(expert, e))` for each of 4 experts:
    their rows add up to at most the tokens; each is estimated at a quarter (a top-2-of-4 MLP
    built outside the repo modelled 69.9 MiB with them counted as nothing, 123.7 measured).
    A lone test of another tensor stays unknown."""
    def graph():
        expert = tf.compat.v1.placeholder(tf.int32, [64], name="expert")
        other = tf.compat.v1.placeholder(tf.int32, [64], name="other")
        h = tf.compat.v1.placeholder(tf.float32, [64, 32], name="h")
        for e in range(4):
            tf.gather(h, tf.where(tf.equal(expert, e))[:, 0], name=f"tokens_{e}")
        tf.gather(h, tf.where(tf.equal(other, 1))[:, 0], name="lone")
    inferred = shapes.infer(build(graph))
    assert [inferred[TensorRef(f"tokens_{e}")].shape for e in range(4)] == [(16, 32)] * 4
    assert inferred[TensorRef("lone")].shape == (None, 32)
    assert sorted(inferred.estimated) == ["Where", "Where_1", "Where_2", "Where_3"]


def test_a_fed_dense_shape_is_read_from_the_dense_operands_it_multiplies():
    """A graph convolution's adjacency has a fed dense shape: its products' rows are unknown
    to TensorFlow (a TF1 GCN built outside the repo: 36 tensors, half its measured peak,
    counted as nothing). A's columns are B's rows; A's rows are the rows of what its
    transpose multiplies, else A is taken as square (and listed as estimated)."""
    def graph():
        def adjacency(name):
            return tf.SparseTensor(tf.compat.v1.placeholder(tf.int64, [40, 2]),
                                   tf.compat.v1.placeholder(tf.float32, [40]),
                                   tf.compat.v1.placeholder(tf.int64, [2], name=name))
        square, wide = adjacency("square"), adjacency("wide")
        features = tf.compat.v1.placeholder(tf.float32, [30, 8])
        tf.sparse.sparse_dense_matmul(square, features, name="square_product")
        tf.sparse.sparse_dense_matmul(wide, features, name="wide_product")
        grad = tf.compat.v1.placeholder(tf.float32, [12, 8])
        tf.sparse.sparse_dense_matmul(wide, grad, adjoint_a=True, name="wide_transposed")
    inferred = shapes.infer(build(graph))
    assert inferred[TensorRef("square_product/SparseTensorDenseMatMul")].shape == (30, 8)
    assert inferred[TensorRef("wide_product/SparseTensorDenseMatMul")].shape == (12, 8)
    assert inferred[TensorRef("wide_transposed/SparseTensorDenseMatMul")].shape == (30, 8)
    assert inferred.estimated == ["square_product/SparseTensorDenseMatMul"]
