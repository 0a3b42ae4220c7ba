"""The chunk_loss pass (lossy, `--lossy`): a tagger's projection to 2,048 classes and its sparse
softmax cross entropy, trained with Adam in a TF1 graph, computed four blocks of rows at a time:
no tensor of the whole logits' shape is left, the modelled peak falls by about the logits and
their gradient, and two training steps agree with the original's to rounding."""

import sys
from pathlib import Path

import pytest
import tensorflow as tf

from graphrewrite.analysis import memory
from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.execution import verify
from graphrewrite.passes import chunk_loss
from graphrewrite.pipeline import grammar
from graphrewrite.pipeline import run as pipeline

ROWS, TOKENS, CLASSES = 64, 16, 2048  # logits of 1,024 x 2,048 floats: 8 MiB
LOGITS_BYTES = ROWS * TOKENS * CLASSES * 4
BLOCKS = "chunk_loss(max_bytes=2097152)"  # 2 MiB blocks: four of them


def seeded_inputs():
    """A tagging step's [rows, tokens, 32] features and [rows, tokens] labels, in the default
    graph, its random seed set."""
    tf.compat.v1.set_random_seed(1)
    return (tf.compat.v1.placeholder(tf.float32, [ROWS, TOKENS, 32], name="x"),
            tf.compat.v1.placeholder(tf.int32, [ROWS, TOKENS], name="labels"))


def tagger(path, read_logits=False, classes=CLASSES):
    """A TF1 MetaGraphDef: two dense layers over [rows, tokens, 32] features (the second,
    the projection, through `tensordot`), the mean sparse cross entropy, Adam; with
    `read_logits`, an accuracy also reads the logits."""
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x, labels = seeded_inputs()
        hidden = v1.layers.dense(x, 64, activation=tf.nn.relu, name="hidden")
        logits = v1.layers.dense(hidden, classes, name="projection")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), name="loss")
        fetched = [v1.train.AdamOptimizer(1e-3).minimize(loss)]
        if read_logits:
            fetched.append(tf.reduce_mean(tf.cast(tf.equal(
                tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)))
        v1.add_to_collection("train_op", tf.group(*fetched, name="train"))
        v1.add_to_collection("losses", loss)
        v1.train.export_meta_graph(str(path), graph=graph)
    return io.load(path)


def language_model(path):
    """A TF1 MetaGraphDef's last layer as a word-level language model writes it: the rows
    flattened, `tf.matmul(h, w) + b` (an AddV2 of a vector, not a BiasAdd), the logits
    reshaped back to [rows, tokens, classes], the masked mean of their cross entropy, and
    `tf.gradients` clipped by global norm, applied by plain SGD."""
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x, labels = seeded_inputs()
        hidden = tf.reshape(v1.layers.dense(x, 64, activation=tf.nn.relu), [-1, 64])
        w = v1.get_variable("softmax_w", [64, CLASSES])
        b = v1.get_variable("softmax_b", [CLASSES], initializer=v1.zeros_initializer())
        logits = tf.reshape(tf.matmul(hidden, w) + b, [ROWS, TOKENS, CLASSES])
        mask = tf.cast(labels > 0, tf.float32)
        loss = tf.divide(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits) * mask), tf.reduce_sum(mask) + 1.0, name="loss")
        params = v1.trainable_variables()
        grads, _ = tf.clip_by_global_norm(tf.gradients(loss, params), 5.0)
        train = v1.train.GradientDescentOptimizer(0.5).apply_gradients(zip(grads, params))
        v1.add_to_collection("train_op", train)
        v1.train.export_meta_graph(str(path), graph=graph)
    return io.load(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tagger(tmp_path_factory.mktemp("chunk") / "tagger.meta")


def test_finds_the_projection_and_its_gradients(model):
    found, skipped = chunk_loss.find(model.graph, analysis.analyse(model))
    assert not skipped and len(found) == 1
    match = found[0]
    assert (match.rows, match.classes) == (ROWS * TOKENS, CLASSES)
    assert match.bias is not None and match.grad_b is not None
    graph = model.graph
    assert graph.op(match.grad_x) == graph.op(match.grad_w) == "MatMul"
    assert match.w in graph.data_inputs(match.grad_x)
    assert match.x in graph.data_inputs(match.grad_w)


def test_blocks_replace_the_whole_logits(model):
    result = pipeline.optimize(model, "none", passes=BLOCKS)
    done = result.of(chunk_loss.ChunkLossResult)
    assert done.modified and done.chunks == 4 and len(done.chunked) == 1
    graph = result.graph
    assert done.chunked[0] not in graph
    xents = [n for n in graph.nodes() if graph.op(n) in chunk_loss.XENT_OPS]
    assert len(xents) == 8  # a forward and a backward one per block
    found = analysis.analyse(model, graph)
    whole = [n for n in graph.nodes() for r in found.shapes.outputs(n)
             if found.shapes[r] is not None and found.shapes[r].shape == (ROWS * TOKENS, CLASSES)]
    assert not whole
    before = analysis.analyse(model).memory.peak(memory.DEVICE)
    after = found.memory.peak(memory.DEVICE)
    # the whole logits (their gradient takes their buffer) give way to a block's: 8 -> 2 MiB
    assert after < before - LOGITS_BYTES // 2, (before, after)


def test_tails_first_tries_nothing_on_the_blocks(model, monkeypatch):
    """The blocks' gradients already run one after the other: making one block's matrix
    gradients wait for another's could only close a cycle, and each try is a Grappler run (a
    transformer's `--budget 25% --lossy` spent 20 of each set's 33 s on eight such tries)."""
    from graphrewrite.passes import tails_first

    tries = []
    monkeypatch.setattr(tails_first, "as_run", lambda *args: tries.append(args))
    result = pipeline.optimize(model, "none", passes=f"{BLOCKS} tails_first", as_run=False)
    assert result.of(chunk_loss.ChunkLossResult).modified
    assert not tries and not result.of(tails_first.TailsFirstResult).modified


def test_left_alone_where_it_cannot_or_need_not(tmp_path):
    read = tagger(tmp_path / "read.meta", read_logits=True)
    result = pipeline.optimize(read, "none", passes=BLOCKS).of(chunk_loss.ChunkLossResult)
    assert not result.modified
    assert list(result.not_chunked) == ["logits read by more than the loss"]
    assert "logits read by more than the loss" in result.note
    small = tagger(tmp_path / "small.meta", classes=10)
    result = pipeline.optimize(small, "none", passes="chunk_loss").of(
        chunk_loss.ChunkLossResult)
    assert not result.modified and "logits smaller than min_bytes" in result.not_chunked


def test_lossy_puts_the_pass_after_inlining():
    assert grammar.compose("memory", lossy=True).split()[:2] == ["inline", "chunk_loss"]
    assert grammar.compose("manual", lossy=True).startswith("chunk_loss ")
    assert "chunk_loss" not in grammar.compose("memory")
    for mode, passes in (("none", None), ("diet", None), ("memory", "recompute")):
        with pytest.raises(GraphRewriteError, match="lossy"):
            grammar.compose(mode, passes, lossy=True)


@pytest.mark.tf
def test_chunked_steps_train_as_the_original_to_rounding(model, tmp_path):
    result = pipeline.optimize(model, "memory", composed=grammar.compose("memory", lossy=True))
    assert result.of(chunk_loss.ChunkLossResult).chunked
    out = tmp_path / "chunked.meta"
    io.save(model, result.graph, out)
    exact = verify.verify(model, io.load(out), verify.VerifyOptions(runs=0), isolated=False)
    close = verify.verify(model, io.load(out), verify.VerifyOptions(runs=0, rtol=1e-4,
                                                                    atol=1e-6), isolated=False)
    assert close.match, close.to_json()["mismatched"]
    # the projection's weight and bias gradients are sums in another order: Adam's slots differ
    assert not exact.match and any("projection" in m for m in exact.to_json()["mismatched"])


def test_an_inlined_forward_call_is_chunked():
    """A TF2 step whose forward pass is a nested tf.function: once inlined, its logits reach
    the loss through the call's result Identity, which waits on the body's side effects; the
    first block waits on them instead."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
    import recipes

    model = io.load(recipes.ensure("tf2n_mlp_adam")["path"])
    result = pipeline.optimize(model, "none", passes="inline chunk_loss(min_bytes=0)",
                               as_run=False)
    assert result.of(chunk_loss.ChunkLossResult).chunked, result.note


def test_a_bias_added_by_hand_is_chunked_with_its_projection(tmp_path):
    """`tf.matmul(h, w) + b`: the bias is an AddV2 of a vector of the classes, and its
    gradient TensorFlow's Add gradient, a Sum over the rows and a Reshape. It was "logits made
    by a AddV2, not a MatMul" (a TF1 LSTM language model built outside the repo: its 61 MiB of
    logits left whole, 0.98x). Chunked, the step trains as the original does to rounding."""
    lm = language_model(tmp_path / "lm.meta")
    found, skipped = chunk_loss.find(lm.graph, analysis.analyse(lm))
    assert not skipped and len(found) == 1
    match = found[0]
    assert lm.graph.op(match.bias_node) == "AddV2" and lm.graph.op(match.grad_b) == "Reshape"
    result = pipeline.optimize(lm, "none", passes=BLOCKS)
    assert result.of(chunk_loss.ChunkLossResult).chunks == 4
    out = tmp_path / "chunked.meta"
    io.save(lm, result.graph, out)
    close = verify.verify(lm, io.load(out), verify.VerifyOptions(runs=0, rtol=1e-4, atol=1e-6),
                          isolated=False)
    assert close.match, close.to_json()["mismatched"]


def test_a_peak_the_logits_hold_points_to_the_chunked_loss(tmp_path):
    """Mode memory leaves a language model's logits and their gradient whole (no lossless
    rewrite splits them); its note said "activations hold it ... try --mode swap" (a TF1 LSTM
    language model built outside the repo, 0.98x). It names the logits and the lever that
    lowers them."""
    lm = language_model(tmp_path / "lm.meta")
    note = pipeline.optimize(lm, "memory", as_run=False).results["recompute"].note
    assert "a cross entropy's logits and their gradient hold it (MatMul, 8.0 MiB)" in note
    assert "--lossy" in note and "--mode swap" not in note

