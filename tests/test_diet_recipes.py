"""The diet pass on MetaGraphDefs built as Keras users build them in graph mode (issue 31).

Keras layers called on placeholders, `tf.compat.v1.train.AdamOptimizer.minimize`, a loss in
no collection and the graph's own `init` op: the rewritten graph must import, be initialised by
that op alone, and train.
"""

import numpy as np
import pytest

from graphrewrite.core import io
from graphrewrite.pipeline import run as pipeline

BATCH, TOKENS, VOCAB, WIDTH = 8, 6, 64, 32


def _export(path, build):
    """`build()` -> loss, in a fresh graph; Adam minimizes it (the train op `train_op`),
    `global_variables_initializer()` is `init`, a Saver is kept; nothing is collected."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(5)
        loss = build(tf)
        tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss, name="train_op")
        assert tf.compat.v1.global_variables_initializer().name == "init"
        saver = tf.compat.v1.train.Saver()
        meta = tf.compat.v1.train.export_meta_graph(saver_def=saver.as_saver_def())
    path.write_bytes(meta.SerializeToString())
    return loss.name


def _embedding_model(tf):
    """An Embedding whose lookup a Dense reads (its gradient reads the lookup again)."""
    ids = tf.compat.v1.placeholder(tf.int32, [BATCH, TOKENS], name="ids")
    labels = tf.compat.v1.placeholder(tf.int32, [BATCH, TOKENS], name="labels")
    h = tf.keras.layers.Embedding(VOCAB, WIDTH)(ids)
    h = tf.keras.layers.Dense(WIDTH, activation="relu")(h)
    logits = tf.keras.layers.Dense(VOCAB)(h)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))


def _cnn_model(tf):
    """A small ResNet-like Keras model called on a placeholder, batch norm updates run."""
    images = tf.compat.v1.placeholder(tf.float32, [BATCH, 12, 12, 3], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
    inputs = tf.keras.Input([12, 12, 3])
    h = tf.keras.layers.Conv2D(16, 3, padding="same")(inputs)
    h = tf.keras.layers.ReLU()(tf.keras.layers.BatchNormalization()(h))
    h = tf.keras.layers.Add()([h, tf.keras.layers.Conv2D(16, 3, padding="same")(h)])
    h = tf.keras.layers.Conv2D(32, 3, strides=2)(h)
    h = tf.keras.layers.GlobalAveragePooling2D()(h)
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(10)(h))
    logits = model(images, training=True)
    with tf.control_dependencies(model.get_updates_for(images) + model.get_updates_for(None)):
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))


def _feeds(graph):
    rng = np.random.RandomState(0)
    out = {}
    for op in graph.get_operations():
        if op.type != "Placeholder":
            continue
        tensor = op.outputs[0]
        shape = tensor.shape.as_list()
        if None in shape:  # the Keras model's own Input, not fed
            continue
        out[tensor] = (rng.randint(0, 10, shape).astype(np.int32) if tensor.dtype.is_integer
                       else rng.standard_normal(shape).astype(np.float32))
    return out


def _train_with_own_init(path, loss_name, steps):
    """(variables the graph's `init` op leaves uninitialised, the losses of `steps` steps)."""
    import tensorflow as tf

    with tf.Graph().as_default() as graph:
        tf.compat.v1.train.import_meta_graph(str(path))
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(graph.get_operation_by_name("init"))
            missing = list(session.run(tf.compat.v1.report_uninitialized_variables()))
            feeds = _feeds(graph)
            train = graph.get_operation_by_name("train_op")
            loss = graph.get_tensor_by_name(loss_name)
            losses = [session.run([loss, train], feeds)[0] for _ in range(steps)] \
                if not missing else []
    return missing, losses


def _diet(path, out):
    model = io.load(path)
    result = pipeline.optimize(model, "diet", as_run=False)
    io.save(model, result.graph, out)
    return result.results["diet"], io.load(out).graph


@pytest.mark.tf
def test_an_embedding_lookup_read_again_by_the_backward_pass_gathers_its_rows(tmp_path):
    """The backward read of a gathered value was a read of the whole table with the gather's
    recorded shape: TensorFlow refused the graph (rank 2 and 3)."""
    loss = _export(tmp_path / "emb.meta", _embedding_model)
    facts, graph = _diet(tmp_path / "emb.meta", tmp_path / "diet.meta")
    table = "embedding/embeddings"
    assert table in facts.dieted
    gathers = [n for n in graph.nodes() if graph.op(n) == "ResourceGather"]
    assert len(gathers) == 2 and any("/backward" in n for n in gathers), gathers
    missing, dieted = _train_with_own_init(tmp_path / "diet.meta", loss, 20)
    assert not missing
    _, original = _train_with_own_init(tmp_path / "emb.meta", loss, 20)
    assert abs(dieted[0] - original[0]) < 1e-3 * original[0]  # the same start, quantized
    assert dieted[0] - dieted[-1] > 0.5 * (original[0] - original[-1]) > 0  # it learns


@pytest.mark.tf
def test_the_graphs_own_init_op_initialises_the_new_slots(tmp_path):
    loss = _export(tmp_path / "cnn.meta", _cnn_model)
    facts, graph = _diet(tmp_path / "cnn.meta", tmp_path / "diet.meta")
    assert facts.slots_added and len(facts.dieted) >= 2
    init = graph.control_inputs("init")
    assert all(f"{slot}/Assign" in init for slot in facts.slots_added)
    assert not any(removed in name for removed in facts.slots_removed for name in init)
    missing, losses = _train_with_own_init(tmp_path / "diet.meta", loss, 5)
    assert not missing, missing
    assert np.isfinite(losses).all()


def _frozen_base_model(tf):
    """A frozen base layer (a variable out of `trainable_variables`, as a LoRA step's or a
    teacher's), then a head that trains."""
    x = tf.compat.v1.placeholder(tf.float32, [BATCH, 64], name="x")
    labels = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
    base = tf.compat.v1.get_variable("base", [64, 64], trainable=False, use_resource=True)
    head = tf.compat.v1.get_variable("head", [64, 32], use_resource=True)
    logits = tf.matmul(tf.nn.relu(tf.matmul(x, base)), head)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits))


@pytest.mark.tf
def test_a_variable_the_step_only_reads_is_stored_in_16_bits(tmp_path):
    """A LoRA step built outside the repo: its frozen base, the step's real state, stayed
    float32 (diet rewrote the adapters' updates only). It is now stored in 16 bits, initialised
    by the graph's own init op, and the step trains; `diet(read_only=false)` keeps it."""
    loss = _export(tmp_path / "base.meta", _frozen_base_model)
    facts, graph = _diet(tmp_path / "base.meta", tmp_path / "diet.meta")
    assert facts.read_only == ["base"] and facts.dieted == ["head"], facts
    assert graph.node_def("base").attr["dtype"].type == graph.node_def(
        "head").attr["dtype"].type != 1  # 16-bit, as the trained kernel
    missing, losses = _train_with_own_init(tmp_path / "diet.meta", loss, 5)
    assert not missing and np.isfinite(losses).all() and losses[-1] < losses[0], losses
    kept = pipeline.optimize(io.load(tmp_path / "base.meta"), "diet",
                             composed="diet(read_only=false)", as_run=False)
    assert not kept.results["diet"].read_only


@pytest.mark.tf
def test_a_gan_step_reading_the_discriminator_after_its_update_keeps_that_order(tmp_path):
    """The recipe cell `tf2_gan_adam` alternates its updates: the generator's forward pass
    reads the discriminator's weights after their update. Those reads' backward copies were
    ordered before the update as well (a cycle: diet failed as a bug in graphrewrite); they read
    the updated weights, after it, as the forward reads do."""
    import sys
    from pathlib import Path

    import networkx as nx

    from graphrewrite.execution import verify

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
    import recipes

    entry = recipes.ensure("tf2_gan_adam")
    model = io.load(entry["path"])
    result = pipeline.optimize(model, "diet", as_run=False)
    graph = result.graph
    assert nx.is_directed_acyclic_graph(graph.nx)
    late = [n for n in graph.nodes() if n.endswith("/backward/raw")]
    after = [n for n in late if any(graph.op(a) == "AssignSubVariableOp"
                                    for a in nx.ancestors(graph.nx, n))]
    assert after, late  # the generator's backward reads of the updated discriminator
    io.save(model, graph, tmp_path / "diet.pb")
    outcome = verify.verify(model, io.load(tmp_path / "diet.pb"), verify.VerifyOptions(
        rtol=0.02, runs=0, steps=2), isolated=False)  # a GAN's losses need not fall
    assert outcome.match, outcome.to_json()
