import copy

import pytest

from graphrewrite.core.errors import GraphError
from graphrewrite.core.graph import Graph
from graphrewrite.core.tensor_ref import CONTROL, TensorRef

from conftest import graph_def


def chain():
    return Graph.from_graph_def(graph_def(
        ("x", "Placeholder", []),
        ("a", "Relu", ["x"]),
        ("b", "Mul", ["a", "a:0", "^x"]),
        ("c", "Neg", ["b"]),
    ))


def test_round_trip_keeps_order_spelling_and_duplicate_edges():
    original = graph_def(("x", "Placeholder", []), ("b", "Mul", ["a", "a:0", "^x"]),
                         ("a", "Relu", ["x"]))
    assert Graph.from_graph_def(original).to_graph_def() == original


def test_inputs_in_nodedef_order():
    g = chain()
    assert g.inputs("b") == [TensorRef("a"), TensorRef("a"), TensorRef("x", CONTROL)]
    assert g.data_inputs("b") == [TensorRef("a"), TensorRef("a")]
    assert g.control_inputs("b") == ["x"]
    assert g.consumers(TensorRef("a")) == [("b", 0), ("b", 1)]


def test_add_node_puts_controls_last_and_appends():
    g = chain()
    g.add_node("d", "AddV2", [TensorRef("x", CONTROL), TensorRef("a"), TensorRef("c")])
    assert [str(r) for r in g.inputs("d")] == ["a", "c", "^x"]
    assert g.nodes()[-1] == "d"
    assert g.to_graph_def().node[-1].input == ["a", "c", "^x"]
    with pytest.raises(GraphError):
        g.add_node("d", "NoOp")
    with pytest.raises(GraphError):
        g.add_node("e", "Neg", [TensorRef("nowhere")])


def test_copy_node_keeps_inputs_and_leaves_consumers():
    g = chain()
    g.copy_node("b", "b_copy")
    assert g.inputs("b_copy") == g.inputs("b")
    assert g.consumers(TensorRef("b")) == [("c", 0)]
    assert g.node_def("b_copy").attr == g.node_def("b").attr


def test_copy_node_reads_the_copies_it_is_given():
    g = chain()
    g.copy_node("x", "x_copy")
    g.copy_node("a", "a_copy")
    g.copy_node("b", "b_copy", {"a": "a_copy", "x": "x_copy"})  # data inputs only
    assert g.inputs("b_copy") == [TensorRef("a_copy"), TensorRef("a_copy"),
                                  TensorRef("x", CONTROL)]
    assert g.consumers(TensorRef("a")) == [("b", 0), ("b", 1)]


def test_replace_uses_only_named_consumers():
    g = chain()
    g.add_node("a2", "Relu", [TensorRef("x")])
    g.add_node("d", "Neg", [TensorRef("a")])
    moved = g.replace_uses(TensorRef("a"), TensorRef("a2"), consumers=["b"])
    assert moved == 2
    assert g.data_inputs("b") == [TensorRef("a2"), TensorRef("a2")]
    assert g.data_inputs("d") == [TensorRef("a")]
    assert g.check() == []


def test_add_control_is_idempotent_and_ordered_after_data():
    g = chain()
    assert g.add_control("a", "c") is True
    assert g.add_control("a", "c") is False
    assert [str(r) for r in g.inputs("c")] == ["b", "^a"]


def test_remove_node_refuses_used_nodes():
    g = chain()
    with pytest.raises(GraphError, match="still read by b"):
        g.remove_node("a")
    g.remove_node("c")
    assert "c" not in g and len(g) == 3


def test_unique_name_is_deterministic():
    g = chain()
    assert g.unique_name("fresh") == "fresh"
    assert g.unique_name("a") == "a_1"
    g.add_node("a_1", "NoOp")
    assert g.unique_name("a") == "a_2"


def test_check_accepts_sound_graph_and_copy_is_independent():
    g = chain()
    assert g.check() == []
    other = copy.deepcopy(g)
    other.add_node("z", "NoOp")
    assert "z" not in g


@pytest.mark.parametrize("nodes, expected", [
    ([("a", "Relu", ["ghost:1"])], "node 'a' reads 'ghost:1' but there is no node 'ghost'"),
    ([("a", "NoOp", []), ("a", "NoOp", [])], "duplicate node name 'a'"),
    ([("a", "Relu", ["b"]), ("b", "Relu", ["a"])], "cycle outside a while-loop frame"),
    ([("a", "Relu", ["a"])], "cycle outside a while-loop frame"),
    ([("x", "Placeholder", []), ("a", "AddV2", ["^x", "x"])],
     "lists a control input before a data input"),
])
def test_check_reports_each_problem(nodes, expected):
    problems = Graph.from_graph_def(graph_def(*nodes)).check()
    assert any(expected in p for p in problems), problems


def test_check_reports_every_problem_not_just_the_first():
    g = Graph.from_graph_def(graph_def(("a", "Relu", ["ghost"]), ("a", "NoOp", []),
                                       ("b", "Relu", ["c"]), ("c", "Relu", ["b"])))
    assert len(g.check()) == 3


def test_loop_back_edge_through_next_iteration_is_legal():
    g = Graph.from_graph_def(graph_def(
        ("x", "Placeholder", []),
        ("enter", "Enter", ["x"]),
        ("merge", "Merge", ["enter", "next"]),
        ("body", "Relu", ["merge"]),
        ("next", "NextIteration", ["body"]),
    ))
    assert g.check() == []
    order = g.topological_order()
    assert order.index("merge") < order.index("body") < order.index("next")


def test_topological_order_by_name_ignores_file_order():
    nodes = [("x", "Placeholder", []), ("b", "Relu", ["x"]), ("a", "Relu", ["x"])]
    forward = Graph.from_graph_def(graph_def(*nodes)).topological_order(tie_break="name")
    backward = Graph.from_graph_def(graph_def(*reversed(nodes))).topological_order("name")
    assert forward == backward == ["x", "a", "b"]
