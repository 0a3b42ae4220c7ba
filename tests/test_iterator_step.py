"""A step that reads its batches from a `tf.data` iterator, as Keras's `model.train_function`
does: the iterator's handle is a resource placeholder but no variable, the analyses leave its
`IteratorGetNext` as it was, and `verify` (which feeds placeholders) says in one line what to
export instead."""

import pytest
import tensorflow as tf

from graphrewrite.analysis import bind
from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.execution import verify


def _train_function(tmp_path_factory, loop: bool):
    """A step reading its batches from a `tf.data` iterator; with `loop`, two steps in a
    functional While loop whose body reads the iterator passed into it (Keras's
    `model.train_function` with `steps_per_execution`)."""
    weights = tf.Variable(tf.ones([8, 4]), name="weights")
    data = tf.data.Dataset.from_tensors((tf.ones([16, 8]), tf.zeros([16], tf.int32))).repeat()

    def step(iterator):
        x, labels = next(iterator)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=tf.nn.relu(x @ weights)))
        weights.assign_sub(0.1 * tape.gradient(loss, weights))
        return loss

    @tf.function
    def train_function(iterator):
        if not loop:
            return step(iterator)
        loss = tf.constant(0.0)
        for _ in tf.range(2):
            loss = step(iterator)
        return loss

    concrete = train_function.get_concrete_function(iter(data))
    path = tmp_path_factory.mktemp("iterator") / "step.pb"
    path.write_bytes(concrete.graph.as_graph_def(add_shapes=True).SerializeToString())
    return io.load(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _train_function(tmp_path_factory, loop=False)


def test_the_iterator_is_no_variable(model):
    graph = model.graph
    handles = bind.iterators(graph)
    assert len(handles) == 1
    assert not handles & set(bind.resource_placeholders(graph))
    assert len(bind.resource_placeholders(graph)) == 1  # the weights
    found = analysis.analyse(model)
    assert [r.node for r in found.sized_by_data] == sorted(handles)
    assert found.split.seeds and found.split.differentiated


def test_the_analyses_leave_the_iterator_op_as_it_was(model):
    analysis.analyse(model)
    nexts = [n for n in model.graph.nodes() if model.graph.op(n) in bind.ITERATOR_OPS]
    assert nexts and all("dtype" not in model.graph.node_def(n).attr for n in nexts)


def test_verify_says_what_to_export_instead(model):
    with pytest.raises(GraphRewriteError, match="tf.data iterator .*model.train_step"):
        verify.verify(model, model, verify.VerifyOptions(runs=0), isolated=False)


@pytest.fixture(scope="module")
def looped(tmp_path_factory):
    return _train_function(tmp_path_factory, loop=True)


def test_an_iterator_a_loop_reads_is_no_variable_and_the_note_names_the_loop(looped):
    from graphrewrite.passes.recompute import RecomputeResult
    from graphrewrite.passes.serialize import SerializeResult
    from graphrewrite.pipeline import run as pipeline

    graph = looped.graph
    handles = bind.iterators(graph)
    assert len(handles) == 1 and not handles & set(bind.resource_placeholders(graph))
    loop = next(n for n in graph.nodes() if graph.op(n) in ("While", "StatelessWhile"))
    result = pipeline.optimize(looped, "memory", as_run=False)
    assert result.of(SerializeResult).serial_loops == [loop]  # its steps one at a time, alone
    assert [name for name, r in result.results.items() if r.modified] == ["serialize"]
    note = result.of(RecomputeResult).note
    assert f"inside loop '{loop}'" in note and "model.train_step" in note, note
    with pytest.raises(GraphRewriteError, match="tf.data iterator"):
        verify.verify(looped, looped, verify.VerifyOptions(runs=0), isolated=False)
