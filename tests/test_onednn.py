"""Rewrites stay correct where oneDNN (TensorFlow's default on x86 CPUs) rewrites the graph after
Grappler: its layout pass merges a `BiasAddGrad` with the `Conv2DBackpropFilter` reading the same
gradient when their control inputs match, without checking for a cycle. `verify` measures with
oneDNN off (the memory model's step), so these run a step with it on, in another process.

Found on a Keras MobileNetV3 MetaGraphDef built outside the repo: with oneDNN on, its rewrite
updated 74 of 499 variables, silently (a merged node waiting for itself), and `serialize` made a
gradient-accumulation CNN's bias gradients round otherwise (merged in the original only)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphrewrite.core import io
from graphrewrite.passes.pads import KEEP_APART_PREFIX

from conftest import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
import recipes  # noqa: E402

CLI = "graphrewrite.cli.main"


def conv_step(path):
    """A TF1 Keras CNN of biased convolutions (ReLU, no batch norm) on placeholders, RMSProp
    with momentum, the loss in no collection: `tf.gradients` joins each bias gradient to its
    convolution's gradients through a `tuple`."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf.compat.v1.placeholder(tf.float32, [8, 32, 32, 3], name="images")
        y = tf.compat.v1.placeholder(tf.int32, [8], name="labels")
        h = x
        for i, filters in enumerate([16, 16, 32, 32, 64, 64]):
            h = tf.keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
            if i % 2:
                h = tf.keras.layers.MaxPooling2D()(h)
        logits = tf.keras.layers.Dense(10)(tf.keras.layers.GlobalAveragePooling2D()(h))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits), name="loss")
        train = tf.compat.v1.train.RMSPropOptimizer(1e-3, momentum=0.9).minimize(loss)
        tf.compat.v1.add_to_collection("train_op", train)
        meta = tf.compat.v1.train.export_meta_graph(graph=graph)
    path.write_bytes(meta.SerializeToString())
    return path


def _conv_step_tf2(path):
    """The same CNN as a TF2 step (GradientTape, Keras RMSprop): each bias gradient and its
    convolution's weight gradient read the same gradient, nothing between them."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.Input([32, 32, 3])] + [
        layer for i, filters in enumerate([16, 16, 32, 32, 64, 64])
        for layer in [tf.keras.layers.Conv2D(filters, 3, padding="same", activation="relu")]
        + ([tf.keras.layers.MaxPooling2D()] if i % 2 else [])] + [
        tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(10)])
    optimizer = tf.keras.optimizers.RMSprop(
        tf.keras.optimizers.schedules.ExponentialDecay(1e-3, 1000, 1.0), jit_compile=False)
    optimizer.build(model.trainable_variables)

    @tf.function(input_signature=[tf.TensorSpec([8, 32, 32, 3], name="images"),
                                  tf.TensorSpec([8], tf.int32, name="labels")])
    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=model(images)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    graph_def = step.get_concrete_function().graph.as_graph_def(add_shapes=True)
    path.write_bytes(graph_def.SerializeToString())
    return path


STEPS = {"tf1": (conv_step, "meta"), "tf2": (_conv_step_tf2, "pb")}


def _bias_gradients(graph, kernel):
    gradient = graph.data_inputs(kernel)[2]
    while graph.op(gradient.node) == "Identity":
        gradient = graph.data_inputs(gradient.node)[0]
    return [u for u, slot in graph.consumers(gradient) if graph.op(u) == "BiasAddGrad"]


@pytest.mark.tf
@pytest.mark.parametrize("how", ["tf1", "tf2"])
def test_a_weight_gradient_and_its_bias_gradient_merge_in_the_rewrite_as_in_the_original(
        tmp_path, how):
    """TF1: a path leads from each bias gradient to its weight gradient (`tf.gradients`'
    tuples), so the original never merges them; the rewrite's weight gradient reads the
    gradient through an Identity Grappler keeps, so neither does it, whatever path the
    rewrite adds. TF2: nothing joins them, the original merges them; so does the rewrite,
    whose serialize chain gives the bias gradient the weight gradient's control inputs."""
    build, ext = STEPS[how]
    original = build(tmp_path / f"step.{ext}")
    result = run_cli("optimize", original, "-o", tmp_path / f"opt.{ext}")
    assert result.exit_code == 0, result.output
    graph = io.load(tmp_path / f"opt.{ext}").graph
    kernels = [n for n in graph.nodes() if graph.op(n) == "Conv2DBackpropFilter"]
    assert len(kernels) == 6 and all(_bias_gradients(graph, k) for k in kernels)
    reads = {k: graph.data_inputs(k)[2].node for k in kernels}
    assert all((read == KEEP_APART_PREFIX + k) == (how == "tf1") for k, read in reads.items())
    if how == "tf2":
        chained = [k for k in kernels if graph.control_inputs(k)]
        assert chained
        for kernel in chained:
            assert all(set(graph.control_inputs(kernel)) <= set(graph.control_inputs(b))
                       for b in _bias_gradients(graph, kernel)), kernel


@pytest.mark.tf
@pytest.mark.parametrize("how", ["tf1", "tf2"])
def test_the_rewrite_is_bitwise_with_onednn_on(tmp_path, how):
    """With oneDNN's layout pass on (TensorFlow's default on x86; ignored where the build has
    none), two steps of the rewrite equal the original's bitwise: before, the TF1 step's rewrite
    ran most weight updates never."""
    build, ext = STEPS[how]
    original = build(tmp_path / f"step.{ext}")
    assert run_cli("optimize", original, "-o", tmp_path / f"opt.{ext}").exit_code == 0
    checked = subprocess.run(
        [sys.executable, "-m", CLI, "verify", str(original), str(tmp_path / f"opt.{ext}"),
         "--runs", "1"], capture_output=True, text=True,
        env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"})
    assert checked.returncode == 0 and "MATCH" in checked.stdout, checked.stdout + checked.stderr
    assert "TF_ENABLE_ONEDNN_OPTS=1" in checked.stderr  # verify says it measured with it on


@pytest.mark.tf
def test_recomputed_batch_norms_fuse_with_their_relu_as_the_originals(tmp_path):
    """The recipe matrix's DenseNet: its recomputed batch norms, each gated by a trigger (they
    read a kept concatenation), were left apart from their ReLU by oneDNN's remapper while it
    fused the originals (`_FusedBatchNormEx`): weights 2.4e-7 apart. They now wait through an
    Identity on their input (`triggers.keep_fusable`)."""
    entry = recipes.ensure("tf2_densenet_nesterov_bn")
    out = tmp_path / "opt.pb"
    assert run_cli("optimize", entry["path"], "-o", out).exit_code == 0
    checked = subprocess.run(
        [sys.executable, "-m", CLI, "verify", entry["path"], str(out), "--runs", "1"],
        capture_output=True, text=True, env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"})
    assert checked.returncode == 0 and "MATCH" in checked.stdout, checked.stdout + checked.stderr
