"""The check before writing: TensorFlow imports the rewrite, and its init ops still initialise
every variable; a pass that breaks either is graphrewrite's bug (exit 3), and nothing is
written."""

import pytest
from tensorflow.core.framework import attr_value_pb2

from graphrewrite.core import io
from graphrewrite.core.tensor_ref import TensorRef
from graphrewrite.passes import PASSES
from graphrewrite.passes.swap import SwapResult
from graphrewrite.pipeline import importable

from conftest import fixture_path, run_cli


def _broken_swap(break_graph):
    """The swap pass's slot, running `break_graph` on a copy of the graph instead."""
    def run(graph, analysis, options, model=None):
        graph = graph.copy()
        break_graph(graph)
        return SwapResult(graph, True)
    return PASSES["swap"]._replace(run=run)


def _wrong_recorded_shape(graph):
    """A MatMul recording a rank-3 output: structurally fine, refused by TensorFlow's importer
    (diet's embedding read did this, issue 31)."""
    shapes = attr_value_pb2.AttrValue()
    proto = shapes.list.shape.add()
    for size in (2, 3, 4):
        proto.dim.add(size=size)
    graph.set_attr("dense_0/MatMul", "_output_shapes", shapes)


def _variable_left_out(graph):
    """A new resource variable with an initializer that no init op runs."""
    flt = attr_value_pb2.AttrValue(type=1)
    graph.add_node("extra", "VarHandleOp", [], {
        "dtype": flt, "shape": attr_value_pb2.AttrValue(shape={}),
        "shared_name": attr_value_pb2.AttrValue(s=b"extra")})
    graph.add_node("extra/zero", "Const", [], {
        "dtype": flt, "value": attr_value_pb2.AttrValue(tensor={"dtype": 1, "float_val": [0]})})
    graph.add_node("extra/Assign", "AssignVariableOp", [TensorRef("extra"),
                                                         TensorRef("extra/zero")], {"dtype": flt})


@pytest.mark.tf
@pytest.mark.parametrize("break_graph, message", [
    (_wrong_recorded_shape, "left a graph TensorFlow cannot import"),
    (_variable_left_out, "'save/restore_all', which initialised or restored every variable, "
                         "leaves variable 'extra' out"),
])
def test_a_pass_leaving_a_graph_tensorflow_cannot_use_is_a_bug_and_nothing_is_written(
        tmp_path, monkeypatch, break_graph, message):
    monkeypatch.setitem(PASSES, "swap", _broken_swap(break_graph))
    out = tmp_path / "out.meta"
    result = run_cli("optimize", fixture_path("adam_train"), "-o", out, "--mode", "swap",
                     "--no-as-run")
    assert result.exit_code == 3, result.stderr
    assert "pass 'swap' (" in result.stderr and message in result.stderr
    assert "bug in graphrewrite" in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.tf
def test_the_first_pass_that_broke_the_graph_is_named_and_a_refused_original_is_let_through(
        caplog):
    model = io.load(fixture_path("adam_train"))
    fine, broken = model.graph.copy(), model.graph.copy()
    _wrong_recorded_shape(broken)
    importable.check(model, [("recompute", [], fine)])  # imports: no error
    with pytest.raises(Exception, match=r"pass 'swap' \(after recompute\) left a graph"):
        importable.check(model, [("recompute", [], fine), ("swap", ["recompute"], broken)])
    model.graph = broken  # an input TensorFlow refuses: not graphrewrite's bug
    importable.check(model, [("swap", [], broken)])
    assert "TensorFlow cannot import the original either" in caplog.text


@pytest.mark.tf
def test_a_graphdefs_checked_bytes_are_the_bytes_written(tmp_path):
    model = io.load(fixture_path("resnet_cnn"))
    graph = model.graph.copy()
    graph.set_attr("stem/Conv2D", "_marked", attr_value_pb2.AttrValue(b=True))
    checked = importable.check(model, [("recompute", [], graph)])
    assert checked == io.serialize(model.with_graph(graph), text=False)
    io.save(model, graph, tmp_path / "built.pb")  # built and serialized again
    io.save(model, graph, tmp_path / "checked.pb", serialized=checked)
    assert (tmp_path / "checked.pb").read_bytes() == (tmp_path / "built.pb").read_bytes()
    # another format than the checked one's is built from the graph, not from those bytes
    io.save(model, graph, tmp_path / "text.pbtxt", serialized=b"not these")
    assert b"_marked" in (tmp_path / "text.pbtxt").read_bytes()
