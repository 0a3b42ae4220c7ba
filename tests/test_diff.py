import json

from graphrewrite.core import io
from graphrewrite.pipeline import run as pipeline
from graphrewrite.reporting.diff import diff

from conftest import fixture_path, run_cli


def test_a_graph_is_identical_to_itself():
    result = run_cli("diff", fixture_path("resnet_cnn"), fixture_path("resnet_cnn"))
    assert result.exit_code == 0 and result.stdout.strip() == "identical"


def test_original_and_rewrite_differ_readably(tmp_path):
    model = io.load(fixture_path("resnet_cnn"))
    rewritten = pipeline.optimize(model, "memory").graph
    path = tmp_path / "rewritten.pb"
    io.save(model, rewritten, path)
    result = run_cli("diff", fixture_path("resnet_cnn"), path)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    added = [l for l in lines if l.startswith("+ ") and "-graphrewrite_recompute = " in l]
    rewired = [l for l in lines if l.startswith("> gradients/")]
    assert added and rewired and not [l for l in lines if l.startswith("- ")]
    facts = json.loads(run_cli("diff", fixture_path("resnet_cnn"), path, "--json").stdout)
    assert facts["identical"] is False and len(facts["added"]) == len(rewritten) - len(model.graph)


def test_changed_attribute_and_device_are_named():
    model = io.load(fixture_path("mlp"))
    other = model.graph.copy()
    value = other.node_def("dense_0/MatMul").attr["transpose_b"].__class__(b=True)
    other.set_attr("dense_0/MatMul", "transpose_b", value)
    result = diff(model.graph, other)
    assert result.changed == [{"node": "dense_0/MatMul", "attrs": {"transpose_b": ["false",
                                                                                   "true"]}}]
    assert not result.added and not result.rewired


def test_shuffled_node_order_is_identical(tmp_path):
    from tensorflow.core.framework import graph_pb2

    original = graph_pb2.GraphDef.FromString(fixture_path("resnet_cnn").read_bytes())
    reversed_def = graph_pb2.GraphDef()
    reversed_def.CopyFrom(original)
    del reversed_def.node[:]
    reversed_def.node.extend(reversed(original.node))
    path = tmp_path / "reversed.pb"
    path.write_bytes(reversed_def.SerializeToString())
    assert run_cli("diff", fixture_path("resnet_cnn"), path).exit_code == 0
