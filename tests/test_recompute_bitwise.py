"""The recompute pass keeps outputs bitwise equal under Grappler (default session config).

Grappler rewrites some arithmetic only when a tensor has exactly one data reader (constant
push-down of the layer norm's gamma, MinimizeBroadcasts regrouping Gelu's products). Moving the
backward readers of a forward tensor to its copy changes those counts; the pass pads them back.
MinimizeBroadcasts also pairs a Mul chain's operands in the order of their names, and does not
absorb a Mul with a control input; copies are named so they sort as their originals, and
triggers wait past the Identities the dependency optimizer would otherwise keep (issue 14).
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from graphrewrite.analysis.split import reachable
from graphrewrite.core import io
from graphrewrite.core.graph import Graph
from graphrewrite.core.names import COPY_SUFFIX, PAD_PREFIX
from graphrewrite.execution import verify
from graphrewrite.pipeline import run as pipeline

from conftest import run_cli

pytestmark = pytest.mark.tf


def _tiny_transformer(path, layers=2, batch=2, seq=8, d=16, ff=64):
    """Layer norm (constant gamma) + exact-Gelu FFN + residual, mean-square loss, its gradients."""
    rng = np.random.RandomState(0)

    def const(shape, name, mean=0.0):
        return tf.constant((mean + 0.1 * rng.randn(*shape)).astype(np.float32), name=name)

    with tf.Graph().as_default() as g:
        h = tf.compat.v1.placeholder(tf.float32, [batch, seq, d], name="x")
        weights = []
        for i in range(layers):
            with tf.compat.v1.name_scope(f"layer_{i}"):
                gamma, w1, w2 = const([d], "gamma", 1.0), const([d, ff], "w1"), const([ff, d], "w2")
                weights += [gamma, w1, w2]
                mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
                ln = (h - mean) * tf.math.rsqrt(var + 1e-6) * gamma
                h = h + tf.tensordot(tf.nn.gelu(tf.tensordot(ln, w1, 1), approximate=False), w2, 1)
        loss = tf.reduce_mean(tf.square(h))
        tf.identity(loss, name="outputs/loss")
        for i, grad in enumerate(tf.compat.v1.gradients(loss, weights)):
            tf.identity(grad, name=f"outputs/grad_{i}")
    path.write_bytes(g.as_graph_def().SerializeToString())


def test_recomputed_transformer_is_bitwise_equal_under_grappler(tmp_path):
    source, out = tmp_path / "t.pb", tmp_path / "t_mem.pb"
    _tiny_transformer(source)
    assert run_cli("optimize", source, "-o", out, "--mode", "memory").exit_code == 0
    graph_def = tf.compat.v1.GraphDef()
    graph_def.ParseFromString(out.read_bytes())
    graph = Graph.from_graph_def(graph_def)
    pads = [n for n in graph.nodes() if n.startswith(PAD_PREFIX)]
    assert pads and all(graph.node_def(p).attr["_grappler_do_not_remove"].b for p in pads)
    fetched = reachable(graph.nx, [n for n in graph.nodes() if n.startswith("outputs/")],
                        upstream=True)
    assert not fetched & set(pads)  # no fetch needs a pad: the session prunes them, they never run
    result = run_cli("verify", source, out, "--runs", "1")
    if result.exit_code == 1 and "only through Grappler's arithmetic optimizer" in result.output:
        # Bitwise here (AVX2, oneDNN on or off, 1-32 threads, 40 processes); one CI machine
        # found layer 0's gradients 1.5e-8 apart: name that machine so it can be reproduced.
        pytest.xfail(f"Grappler's arithmetic optimizer rounds differently on {_machine()}")
    assert result.exit_code == 0, result.output
    assert "MATCH" in result.output


def test_triggers_wait_only_on_what_the_step_runs(tmp_path):
    """Exact GELU's `1 + erf` has a gradient with respect to its constant 1 that nothing reads:
    Grappler prunes it. A trigger waiting on it kept it, its input had one reader more, and
    MinimizeBroadcasts grouped the GELU gradient's products otherwise (a Keras transformer step:
    weights 1.5e-8 apart after two steps)."""
    from graphrewrite.core.names import TRIGGER_PREFIX

    source, out = tmp_path / "t.pb", tmp_path / "t_mem.pb"
    _tiny_transformer(source)
    original = io.load(source).graph
    outputs = [n for n in original.nodes() if n.startswith("outputs/")]
    assert run_cli("optimize", source, "-o", out, "--mode", "memory",
                   "--outputs", ",".join(outputs)).exit_code == 0
    rewritten = io.load(out).graph
    runs = reachable(original.nx, outputs, upstream=True)
    dead = {n for n in original.nodes() if n not in runs and "_grad/" in n}
    assert dead  # the gradients with respect to constants are in the graph
    triggers = [n for n in rewritten.nodes() if n.startswith(TRIGGER_PREFIX)]
    waits = {w for t in triggers for w in rewritten.control_inputs(t)}
    assert triggers and not waits & dead, sorted(waits & dead)


def _machine() -> str:
    """The CPU's vector extensions and whether TensorFlow runs oneDNN's kernels."""
    from tensorflow.python.util import _pywrap_util_port
    try:
        flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
    except (OSError, IndexError):
        flags = []
    wide = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return f"a CPU with {' '.join(wide) or 'unknown flags'}, oneDNN " \
           f"{'on' if _pywrap_util_port.IsMklEnabled() else 'off'}"


def _gelu_mlp(path, gated, layers=3, batch=64, width=32):
    """Dense + exact-Gelu layers, 10 logits, softmax cross-entropy (its gradient, like the
    layers', has the fed input's batch dimension), and the gradients; `gated` as an optimizer's
    minimize gates them (a tf.tuple per op: the gradient flow reads Identities)."""
    rng = np.random.RandomState(0)
    with tf.Graph().as_default() as g:
        h = tf.compat.v1.placeholder(tf.float32, [batch, width], name="x")
        labels = tf.compat.v1.placeholder(tf.int32, [batch], name="labels")
        weights = []
        for i in range(layers):
            with tf.compat.v1.name_scope(f"dense_{i}"):
                kernel = tf.constant(0.3 * rng.randn(width, width).astype(np.float32),
                                     name="kernel")
                bias = tf.constant(0.1 * rng.randn(width).astype(np.float32), name="bias")
                weights += [kernel, bias]
                h = tf.nn.gelu(tf.nn.bias_add(tf.matmul(h, kernel), bias), approximate=False)
        with tf.compat.v1.name_scope("logits"):
            kernel = tf.constant(0.3 * rng.randn(width, 10).astype(np.float32), name="kernel")
            bias = tf.constant(0.1 * rng.randn(10).astype(np.float32), name="bias")
            weights += [kernel, bias]
            logits = tf.nn.bias_add(tf.matmul(h, kernel), bias)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        tf.identity(loss, name="outputs/loss")
        grads = tf.compat.v1.gradients(loss, weights, gate_gradients=gated)
        for i, grad in enumerate(grads):
            tf.identity(grad, name=f"outputs/grad_{i}")
    fetches = [f"outputs/grad_{i}" for i in range(len(weights))] + ["outputs/loss"]
    graph_def = tf.compat.v1.graph_util.extract_sub_graph(g.as_graph_def(), fetches)
    path.write_bytes(graph_def.SerializeToString())
    return fetches


@pytest.mark.parametrize("gated", [True, False])
def test_recomputed_gelu_mlp_gradients_are_grouped_as_in_the_original(tmp_path, gated):
    """Recomputing the Gelus (memory mode keeps the layer outputs) regroups their gradients' Mul
    chains unless the copies sort by name as their originals, no trigger keeps a tuple's
    Identity, and Grappler knows the first layer's copies (which read the fed input) have
    their originals' shapes; then every gradient is bitwise equal."""
    source = tmp_path / "gelu_mlp.pb"
    fetches = _gelu_mlp(source, gated)
    model = io.load(source)
    result = pipeline.optimize(model, "memory")
    copies = [n for n in result.graph.nodes() if n.endswith(COPY_SUFFIX)]
    assert "dense_0/Gelu/add" + COPY_SUFFIX in copies  # the first layer's Gelu, recomputed
    rewritten = dataclasses.replace(model, graph=result.graph)
    outcome = verify.verify(model, rewritten, verify.VerifyOptions(fetches=fetches, runs=0),
                            isolated=False)
    assert outcome.match, outcome.to_json()
