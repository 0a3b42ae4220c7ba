import pytest
import tensorflow as tf

from graphrewrite import shapes
from graphrewrite.errors import GraphRewriteError
from graphrewrite.tensor_ref import TensorRef

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

    from graphrewrite import analysis, io

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


@pytest.mark.tf
@pytest.mark.parametrize("fixture", ["mlp.pbtxt", "keras_train.meta", "keras_step_tf2.pb",
                                     "rnn_while_v1.pb", "rnn_while_v2.pb", "tape_tf2.pb"])
def test_the_fast_import_infers_what_the_public_importer_does(fixture):
    """The C++ import without Python operations (`_imported`) sees the same shapes and dtypes,
    loops and functions included, as `tf.graph_util.import_graph_def`."""
    from pathlib import Path

    from graphrewrite import io

    graph_def = io.load(Path(__file__).parent.parent / "fixtures" / fixture).graph.to_graph_def()
    fast = shapes._tensorflow_shapes(graph_def)
    public = {op.name: [(t.dtype.as_datatype_enum,
                         None if t.shape.rank is None else tuple(t.shape.as_list()))
                        for t in op.outputs]
              for op in shapes._imported(graph_def, public=True)}
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


def test_without_the_internals_it_reads_shapes_through_the_public_importer(monkeypatch):
    def missing(graph_def):
        raise AttributeError("module has no attribute '_PopulateTFImportGraphDefOptions'")

    expected = shapes.infer(unknown_batch_graph(), {"x": (16, 8)}).tensors
    monkeypatch.setattr(shapes, "_c_imported", missing)
    assert shapes.infer(unknown_batch_graph(), {"x": (16, 8)}).tensors == expected
