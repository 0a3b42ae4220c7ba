"""Recomputation after the diet pass (`--passes "diet recompute(policy=memory)"`).

A dieted weight is read through a dequantization (Cast, x scale) of its 16-bit value: a float32
parameter that allocates, not an alias of the variable. A recomputed layer must dequantize its
weight again when it runs; reading the forward pass's dequantization instead would keep a
float32 copy of every recomputed layer's weight from the forward pass to the recomputation (an
unseen ResNet-50 MetaGraphDef: all of them at the peak, and no plan lowered it).
"""

import networkx as nx
import numpy as np
import pytest

from graphrewrite.core import io, names
from graphrewrite.core.tensor_ref import TensorRef
from graphrewrite.execution import verify
from graphrewrite.passes.recompute import RecomputeResult
from graphrewrite.pipeline import run as pipeline

DEPTH, WIDTH, BATCH, FEATURES = 8, 128, 256, 64


def _mlp(path, resource=True, batch_norm=False):
    """An 8-layer tanh MLP trained by Adam on resource (or ref) variables: 128x128 kernels
    (dieted), activations of 128 KiB; with `batch_norm`, each layer normalised and the
    training op built under the moving averages' updates, as TF1 programs do."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf.compat.v1.placeholder(tf.float32, [BATCH, FEATURES], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
        h = x
        with tf.compat.v1.variable_scope("m", use_resource=resource):
            for i in range(DEPTH):
                h = tf.compat.v1.layers.dense(h, WIDTH, activation=tf.nn.tanh, name=f"d{i}")
                if batch_norm:
                    h = tf.compat.v1.layers.batch_normalization(h, training=True, name=f"bn{i}")
            logits = tf.compat.v1.layers.dense(h, 4, name="out")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits), name="loss")
        with tf.control_dependencies(tf.compat.v1.get_collection(
                tf.compat.v1.GraphKeys.UPDATE_OPS)):
            train = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
        tf.compat.v1.add_to_collection("train_op", train)
        tf.compat.v1.add_to_collection("losses", loss)
        meta = tf.compat.v1.train.export_meta_graph()
    path.write_bytes(meta.SerializeToString())
    return io.load(path)


@pytest.fixture(scope="module", params=["resource", "ref"])
def rewritten(tmp_path_factory, request):
    """Each pipeline's result and its saved model. Diet's forward reads are gated, the order
    these tests are about (diet prices both orders as run: on this MLP they tie within 0.1
    MiB, and which wins moves with the executor's schedule)."""
    directory = tmp_path_factory.mktemp("diet_recompute")
    model = _mlp(directory / "mlp.meta", request.param == "resource")
    found = {}
    for key, passes in (("recompute", "recompute(policy=memory)"),
                        ("diet", "diet(reads=gated)"),
                        ("both", "diet(reads=gated) recompute(policy=memory)")):
        result = pipeline.optimize(model, "memory", composed=passes, as_run=False)
        io.save(model, result.graph, directory / f"{key}.meta")
        found[key] = (result, io.load(directory / f"{key}.meta"))
    return found


def _adam_writes(graph, variable):
    """The Adam update's writes of a ref variable (the `Assign`s of its value)."""
    return [u for u, slot in graph.consumers(TensorRef(variable))
            if slot == 0 and graph.op(u) == "Assign" and "Adam" in u]


def _check_copies_dequantize_again(graph, original):
    """Every recomputed MatMul of a dieted weight reads a copy of its weight's dequantization,
    made from the forward pass's 16-bit read (a ref variable itself: then every write of the
    variable waits for the copy), and each copy waits for the copies of what its original waits
    for (a gated dequantization: the activation its reader multiplies)."""
    copies = {n: names.copied_from(n) for n in graph.nodes() if names.copied_from(n)}
    copy_of = {o: c for c, o in copies.items()}
    matmuls = [c for c in copies if graph.op(c) == "MatMul"]
    assert matmuls
    for copy in matmuls:
        weight = graph.data_inputs(copy)[1].node
        if graph.op(weight) == "ReadVariableOp":  # a float32 weight (the 128x4 output layer's)
            continue
        assert weight in copies, f"{copy} reads the forward pass's dequantized {weight}"
        while graph.op(weight) == "Identity":  # a ref variable's layer reads `kernel/read`
            weight = graph.data_inputs(weight)[0].node
            assert weight in copies, weight
        cast = graph.data_inputs(weight)[0].node
        assert graph.op(cast) == "Cast" and cast in copies
        read = graph.data_inputs(cast)[0].node
        assert graph.op(read) in ("ReadVariableOp", "VariableV2")  # not copied
        if graph.op(read) == "VariableV2":
            writes = _adam_writes(graph, read)
            assert writes and all(nx.has_path(graph.nx, cast, w) for w in writes), cast
        for wait in original.control_inputs(copies[cast]):
            if wait in copy_of:
                assert copy_of[wait] in graph.control_inputs(cast), (cast, wait)
    return copies


@pytest.mark.tf
def test_recomputed_layers_dequantize_their_weights_again_when_they_run(rewritten):
    result, model = rewritten["both"]
    assert result.of(RecomputeResult).recomputed, "recompute should rewrite the diet graph"
    _check_copies_dequantize_again(model.graph, rewritten["diet"][1].graph)


@pytest.mark.tf
def test_gated_dequantizations_are_copied_with_their_gates(tmp_path):
    """Gated forward reads (what the diet pass keeps unpriced): the copy of a dequantization
    waits for the copy of the activation its reader multiplies, not only for the segment's
    trigger, which would dequantize every weight of the segment at once."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.passes import diet, recompute

    model = _mlp(tmp_path / "mlp.meta")
    dieted = diet.run(model.graph, analysis.analyse(model), diet.DietOptions(), model=None)
    assert dieted.forward_reads == "gated"
    found = analysis.analyse(model, dieted.graph, shapes=dieted.shapes)
    result = recompute.run(dieted.graph, found, recompute.RecomputeOptions())
    assert result.modified
    copies = _check_copies_dequantize_again(result.graph, dieted.graph)
    gated = [c for c, o in copies.items() if result.graph.op(c) == "Cast"
             and any(w in {v for v in copies.values()} for w in dieted.graph.control_inputs(o))]
    assert gated, "some dequantization should wait for a recomputed activation"


@pytest.mark.tf
def test_a_copied_read_of_a_ref_variable_runs_before_its_writes(tmp_path):
    """A ref variable's dequantizing `Cast` reads the variable when it runs: its copy must run
    before the optimizer writes the variable, so each write waits for it by a control edge
    (the data path from the copy to the update, which usually exists too, is not relied on)."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.passes import diet, recompute

    model = _mlp(tmp_path / "mlp.meta", resource=False)
    dieted = diet.run(model.graph, analysis.analyse(model), diet.DietOptions(), model=None)
    found = analysis.analyse(model, dieted.graph, shapes=dieted.shapes)
    result = recompute.run(dieted.graph, found, recompute.RecomputeOptions())
    graph = result.graph
    casts = [c for c in graph.nodes() if names.copied_from(c) and graph.op(c) == "Cast"]
    assert casts
    for cast in casts:
        variable = graph.data_inputs(cast)[0].node
        assert graph.op(variable) == "VariableV2"
        writes = _adam_writes(graph, variable)
        assert writes and all(cast in graph.control_inputs(w) for w in writes), cast
    assert not graph.check()


@pytest.mark.tf
def test_recompute_after_diet_with_ref_variables_and_batch_norm(tmp_path):
    """Back-propagation waits on the batch norms' moving-average writes (the training op is
    built under them): those ref variables' writes must not keep the triggers from waiting on
    the gradient flow, or every segment is recomputed when back-propagation starts."""
    model = _mlp(tmp_path / "mlp.meta", resource=False, batch_norm=True)
    peaks = {passes: pipeline.optimize(model, "memory", composed=passes, as_run=False).peak_after
             for passes in ("diet", "diet recompute(policy=memory)")}
    assert peaks["diet recompute(policy=memory)"] < 0.85 * peaks["diet"], peaks


@pytest.mark.tf
@pytest.mark.parametrize("resource", [True, False])
def test_recompute_after_diet_with_batch_norm_is_bitwise_equal_to_diet_alone(tmp_path, resource):
    """A dieted batch-norm scale makes `Rsqrt * (Cast * scale)` a chain Grappler's arithmetic
    optimizer regroups (with ref variables through the variable's `read` Identity); a
    recomputed copy of its root given a control input (a late copy's gate) is left as
    written, and rounds differently."""
    model = _mlp(tmp_path / "mlp.meta", resource, batch_norm=True)
    found = {}
    diet = f"diet(min_size={WIDTH})"  # the 128-wide scales too
    for key, passes in (("diet", diet), ("both", f"{diet} recompute(policy=memory)")):
        result = pipeline.optimize(model, "memory", composed=passes, as_run=False)
        io.save(model, result.graph, tmp_path / f"{key}.meta")
        found[key] = io.load(tmp_path / f"{key}.meta")
    assert result.results["recompute"].modified
    checked = verify.verify(found["diet"], found["both"], verify.VerifyOptions(runs=0, int_high=4),
                            isolated=False)
    assert checked.match, checked.to_json()["mismatched"]


@pytest.mark.tf
@pytest.mark.parametrize("resource", [True, False])
def test_a_dieted_scale_makes_its_batch_norm_product_a_regrouped_chain(tmp_path, resource):
    """`Rsqrt * gamma`, gamma dequantized (`Cast * scale`, read through the ref variable's
    `read` Identity with ref variables), is a Mul chain Grappler regroups: its copy gets no
    late gate (`triggers.chain_root`); the MatMuls are not chains."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.passes import diet
    from graphrewrite.passes.triggers import chain_root

    model = _mlp(tmp_path / "mlp.meta", resource, batch_norm=True)
    options = diet.DietOptions(min_size=WIDTH)
    graph = diet.run(model.graph, analysis.analyse(model), options, model=None).graph
    assert all(chain_root(graph, f"m/bn{i}/batchnorm/mul") for i in range(DEPTH))
    assert not any(chain_root(graph, f"m/d{i}/MatMul") for i in range(DEPTH))


@pytest.mark.tf
def test_recompute_after_diet_saves_about_what_it_saves_without_diet(rewritten):
    """Holding the dequantized weights of the recomputed layers costs a float32 copy of each:
    recomputation then saved 55% of what it saves on the original graph; dequantizing again,
    90%. Since diet clips its lean step as Adafactor does (the step's root mean square read
    before the step is made, so each update's direction lives a little longer), 70%."""
    original_peak = rewritten["recompute"][0].peak_before
    saved_alone = original_peak - rewritten["recompute"][0].peak_after
    diet_peak, both_peak = rewritten["diet"][0].peak_after, rewritten["both"][0].peak_after
    assert saved_alone > 0
    assert diet_peak - both_peak >= 0.65 * saved_alone, (
        original_peak / 1024, rewritten["recompute"][0].peak_after / 1024, diet_peak / 1024,
        both_peak / 1024)


@pytest.mark.tf
def test_recompute_after_diet_is_bitwise_equal_to_diet_alone(rewritten):
    diet_model, both_model = rewritten["diet"][1], rewritten["both"][1]
    checked = verify.verify(diet_model, both_model, verify.VerifyOptions(runs=0, int_high=4),
                            isolated=False)
    assert checked.match, checked.to_json()["mismatched"]
    assert checked.to_json()["variables_compared"] > 0
    assert np.isfinite(checked.to_json()["max_abs_diff"])
