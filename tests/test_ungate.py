"""The ungate pass: updates no longer wait behind `GATE_GRAPH`'s tuple for every gradient (a
TF1 ResNet-50 built outside the repo held its weights' gradients to the end of the backward
pass: 0.89x in mode memory, 0.71x with the gate out, bitwise)."""

import pytest

from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
from graphrewrite.passes import ungate
from graphrewrite.pipeline import run as pipeline

from test_defer import assert_bitwise

LAYERS, UNITS, BATCH = 4, 256, 64


def _tf1_step(tmp_path, gate: str, resource: bool):
    """A TF1 MLP's MetaGraphDef: momentum SGD, its gradients gated as `gate` says (GATE_GRAPH
    or GATE_OP), on resource or ref variables."""
    import numpy as np
    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default() as graph:
        v1.set_random_seed(3)
        x = v1.placeholder(tf.float32, [BATCH, UNITS], name="x")
        labels = v1.placeholder(tf.int32, [BATCH], name="labels")
        h = x
        for i in range(LAYERS):
            kernel = v1.get_variable(f"w{i}", [UNITS, UNITS], use_resource=resource,
                                     initializer=v1.random_normal_initializer(0, UNITS ** -0.5))
            h = tf.nn.relu(tf.matmul(h, kernel))
        head = v1.get_variable("head", [UNITS, 10], use_resource=resource,
                               initializer=tf.constant_initializer(np.full([UNITS, 10], 0.01)))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=tf.matmul(h, head)))
        optimizer = v1.train.MomentumOptimizer(0.01, 0.9)
        optimizer.minimize(loss, gate_gradients=getattr(v1.train.Optimizer, gate),
                           name="train")
        v1.global_variables_initializer()
        meta = v1.train.export_meta_graph(graph=graph)
    path = tmp_path / f"{gate}_{resource}.meta"
    path.write_bytes(meta.SerializeToString())
    return io.load(path)


@pytest.mark.tf
def test_a_graph_gate_before_resource_updates_is_taken_out_bitwise(tmp_path):
    model = _tf1_step(tmp_path, "GATE_GRAPH", resource=True)
    found = analysis.analyse(model)
    [(gate, waiting)] = ungate.gates(model.graph, found).items()
    assert len(waiting) == LAYERS + 1  # one Identity per weight's gradient
    result = pipeline.optimize(model, "none", passes="ungate")
    graph = result.graph
    assert result.results["ungate"].ungated == [gate]
    assert not any(gate in graph.control_inputs(w) for w in waiting)
    assert_bitwise(model, graph, tmp_path / "ungated.meta")


@pytest.mark.tf
@pytest.mark.parametrize("gate, resource", [("GATE_GRAPH", False), ("GATE_OP", True)])
def test_ref_variables_and_per_op_gates_keep_theirs(tmp_path, gate, resource):
    """A ref variable's read is its buffer, which an early update would overwrite under the
    backward pass; GATE_OP's tuples pair an op's input gradient, which goes on through the
    backward pass, with its weight's."""
    model = _tf1_step(tmp_path, gate, resource)
    assert not ungate.gates(model.graph, analysis.analyse(model))
