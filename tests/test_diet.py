"""The diet pass: 16-bit variables, the diet optimizer update, slots, savers, frozen constants.

The training graphs are built here as TF1 code builds them (tf.compat.v1 layers and optimizers,
a Saver, the train_op and losses collections), small enough that a session runs 50 steps in a
second or two.
"""

import re

import numpy as np
import pytest

from graphrewrite.analysis import optimizers
from graphrewrite.analysis.step import AnalysisOptions
from graphrewrite.core import io, names
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.core.names import SLOT_OF_ATTR
from graphrewrite.core.tensor_ref import TensorRef
from graphrewrite.passes import diet
from graphrewrite.passes.recompute import RecomputeResult
from graphrewrite.passes.diet import build
from graphrewrite.passes.diet.options import FORMATS
from graphrewrite.pipeline import grammar
from graphrewrite.pipeline import run as pipeline

from conftest import run_cli

FEATURES, HIDDEN, CLASSES, BATCH = 32, 128, 4, 256


# --------------------------------------------------------------------------- options (fast)

def test_options_have_the_documented_defaults_and_refuse_bad_values():
    options = diet.DietOptions()
    assert (options.format, options.momentum, options.factored, options.rounding,
            options.min_size) == ("int16", "auto", True, "stochastic", 1024)
    assert abs(options.scale - 10 / 32767) < 1e-12
    parsed = grammar.pass_options("diet", {"format": "bfloat16", "factored": "false",
                                            "momentum": "keep", "rounding": "nearest",
                                            "min_size": "0", "scale": "0.001"})
    assert (parsed.format, parsed.factored, parsed.momentum, parsed.rounding,
            parsed.min_size, parsed.scale) == ("bfloat16", False, "keep", "nearest", 0, 0.001)
    for bad in ({"format": "int8"}, {"momentum": "half"}, {"rounding": "up"},
                {"scale": "0"}, {"scale": "-1"}, {"min_size": "-3"}):
        with pytest.raises(GraphRewriteError, match="diet"):
            grammar.pass_options("diet", bad)


def test_mode_and_help_name_the_options():
    from graphrewrite.pipeline.modes import MODE_HELP, MODES

    assert MODES["diet"] == "diet"
    for option in ("format=int16|bfloat16", "momentum=auto|drop|keep|bfloat16", "factored=true",
                   "rounding=stochastic|nearest", "min_size=1024", "scale=",
                   "read_only=true", "generic=true"):
        assert option in MODE_HELP["diet"]
    assert grammar.compose("diet", "diet recompute(policy=memory)") == \
        "diet recompute(policy=memory)"


# --------------------------------------------------------------------------- graphs

def _build(path, optimizer="adam", resource=True, seed=3, lr=None):
    """A 3-layer MLP training MetaGraphDef: kernels 32x128 and 128x128 (dieted by default),
    128x4 and the biases (below min_size: float32)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        x = tf.compat.v1.placeholder(tf.float32, [BATCH, FEATURES], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
        with tf.compat.v1.variable_scope("mlp", use_resource=resource):
            h = tf.compat.v1.layers.dense(x, HIDDEN, activation=tf.nn.relu, name="dense")
            h = tf.compat.v1.layers.dense(h, HIDDEN, activation=tf.nn.relu, name="dense_1")
            logits = tf.compat.v1.layers.dense(h, CLASSES, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits), name="loss")
        step = tf.compat.v1.train.get_or_create_global_step()
        make = {"adam": lambda: tf.compat.v1.train.AdamOptimizer(lr or 3e-4),
                "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(lr or 0.01, 0.9),
                "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(lr or 0.1),
                "rmsprop": lambda: tf.compat.v1.train.RMSPropOptimizer(lr or 1e-3),
                "rmspropmomentum": lambda: tf.compat.v1.train.RMSPropOptimizer(
                    lr or 3e-4, momentum=0.9),
                "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(lr or 0.05)}
        legacy = {"kerasnesterov": lambda: tf.keras.optimizers.legacy.SGD(  # KerasMomentum
            lr or 0.01, 0.9, nesterov=True),
                  "kerasadagrad": lambda: tf.keras.optimizers.legacy.Adagrad(lr or 0.05)}
        if optimizer in legacy:  # Keras's legacy optimizers in graph mode
            weights = tf.compat.v1.trainable_variables()
            train = legacy[optimizer]().apply_gradients(zip(tf.gradients(loss, weights), weights))
        else:
            train = make[optimizer]().minimize(loss, global_step=step)
        tf.compat.v1.add_to_collection("train_op", train)
        tf.compat.v1.add_to_collection("losses", loss)
        saver = tf.compat.v1.train.Saver()
        meta = tf.compat.v1.train.export_meta_graph(saver_def=saver.as_saver_def())
    path.write_bytes(meta.SerializeToString())
    return path


def _adam_meta_graph(loss, lr: float, optimizer=None):
    """The default graph's MetaGraphDef with an AdamOptimizer (or `optimizer`) minimizing
    `loss`, in the collections a training MetaGraphDef names its step by."""
    import tensorflow as tf

    train = (optimizer or tf.compat.v1.train.AdamOptimizer)(lr).minimize(loss)
    tf.compat.v1.add_to_collection("train_op", train)
    tf.compat.v1.add_to_collection("losses", loss)
    return tf.compat.v1.train.export_meta_graph()


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("diet")
    built = {}
    for optimizer, resource in (("adam", True), ("adam", False), ("momentum", True),
                                ("momentum", False), ("sgd", True), ("rmsprop", True),
                                ("rmsprop", False), ("rmspropmomentum", True),
                                ("kerasnesterov", True), ("adagrad", True), ("adagrad", False),
                                ("kerasadagrad", True)):
        key = f"{optimizer}_{'resource' if resource else 'ref'}"
        built[key] = _build(directory / f"{key}.meta", optimizer, resource)
    return built


def _diet(path, out, passes="diet"):
    model = io.load(path)
    result = pipeline.optimize(model, "diet", composed=passes)
    io.save(model, result.graph, out)
    return result, io.load(out)


def _data(seed=0):
    """A fixed batch with labels the model cannot fit quickly (a noisy rule), so the loss falls
    slowly and two optimizers can be compared on it."""
    rng = np.random.RandomState(seed)
    x = rng.standard_normal([BATCH, FEATURES]).astype(np.float32)
    rule = x[:, :CLASSES].argmax(1)
    noise = rng.randint(0, CLASSES, BATCH)
    y = np.where(rng.uniform(size=BATCH) < 0.3, rule, noise).astype(np.int32)
    return x, y


def _train(path, steps, checkpoint=None):
    """Losses of `steps` steps from the graph's initializers; optionally saves a checkpoint
    with the graph's own Saver and returns every global variable's value too."""
    import tensorflow as tf

    graph = tf.Graph()
    x, y = _data()
    with graph.as_default():
        saver = tf.compat.v1.train.import_meta_graph(str(path))
        init = tf.compat.v1.global_variables_initializer()
        train_op = tf.compat.v1.get_collection("train_op")[0]
        loss = graph.get_tensor_by_name("loss:0")
        variables = tf.compat.v1.global_variables()
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(init)
            losses = [session.run([loss, train_op], {"x:0": x, "labels:0": y})[0]
                      for _ in range(steps)]
            values = {}
            if checkpoint:
                saver.save(session, str(checkpoint))
                values = dict(zip([v.op.name for v in variables], session.run(variables)))
    return losses, values


# --------------------------------------------------------------------------- structure

@pytest.mark.tf
def test_adam_weights_become_int16_with_factored_slots_and_no_adam_slots(graphs, tmp_path):
    from tensorflow.core.framework import types_pb2, variable_pb2

    result, model = _diet(graphs["adam_resource"], tmp_path / "diet.meta")
    facts = result.results["diet"]
    assert sorted(facts.dieted) == ["mlp/dense/kernel", "mlp/dense_1/kernel"]
    graph = model.graph
    for kernel, rows in (("mlp/dense/kernel", FEATURES), ("mlp/dense_1/kernel", HIDDEN)):
        assert graph.node_def(kernel).attr["dtype"].type == types_pb2.DT_INT16
        assert kernel + "/Adam" not in graph and kernel + "/Adam_1" not in graph
        dims = [d.size for d in graph.node_def(kernel + "/diet_rows").attr["shape"].shape.dim]
        assert dims == [rows, 1]
        dims = [d.size for d in graph.node_def(kernel + "/diet_cols").attr["shape"].shape.dim]
        assert dims == [1, HIDDEN]
        # a new slot starts from one value and its shape, not every zero written out
        zeros = graph.node_def(kernel + "/diet_rows/Initializer/zeros").attr["value"].tensor
        assert not zeros.tensor_content and len(zeros.float_val) == 1
        # every read of the int16 value is dequantized; the old read names are float32 now
        reads = [u for u, _ in graph.consumers(kernel) if graph.op(u) == "ReadVariableOp"]
        assert reads and all(graph.node_def(r).attr["dtype"].type == types_pb2.DT_INT16
                             for r in reads)
        assert graph.op(kernel + "/Read/ReadVariableOp") == "Mul"
    # small variables keep their Adam slots
    assert "mlp/logits/kernel/Adam" in graph and "mlp/dense/bias/Adam_1" in graph
    assert not graph.check()
    # the collections list the new slots and not the removed ones
    listed = set()
    for data in model.meta_graph.collection_def["variables"].bytes_list.value:
        definition = variable_pb2.VariableDef()
        definition.ParseFromString(data)
        listed.add(definition.variable_name.split(":")[0])
    assert "mlp/dense/kernel/diet_rows" in listed and "mlp/dense/kernel/Adam" not in listed
    # stochastic rounding: one random op per dieted update, inside the update
    randoms = [n for n in graph.nodes() if graph.op(n) == "RandomUniform"
               and build.PREFIX in n]
    assert len(randoms) == 2


@pytest.mark.tf
@pytest.mark.parametrize("options,expect", [
    ("format=bfloat16", "bfloat16"),
    ("momentum=keep", "keep"),
    ("factored=false", "full"),
    ("rounding=nearest", "nearest"),
    ("format=bfloat16, rounding=nearest", "bfloat16"),
    ("min_size=100000", "nothing"),
])
def test_each_option_rewrites_as_documented_and_still_trains(graphs, tmp_path, options, expect):
    from tensorflow.core.framework import types_pb2

    result, model = _diet(graphs["adam_resource"], tmp_path / "diet.meta", f"diet({options})")
    graph = model.graph
    kernel = "mlp/dense_1/kernel"
    if expect == "nothing":
        assert not result.results["diet"].dieted and "no variable" in result.results["diet"].note
        return
    dtype = graph.node_def(kernel).attr["dtype"].type
    assert dtype == (types_pb2.DT_BFLOAT16 if expect == "bfloat16" else types_pb2.DT_INT16)
    assert (kernel + "/Adam" in graph) == (expect == "keep")          # first moment
    assert (kernel + "/Adam_1" in graph) == (expect == "full")        # full second moment
    assert (kernel + "/diet_rows" in graph) == (expect != "full")
    randoms = [n for n in graph.nodes() if graph.op(n) in ("RandomUniform", "RandomUniformInt")]
    assert bool(randoms) == ("nearest" not in options)
    losses, _ = _train(tmp_path / "diet.meta", 20)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.tf
def test_adam_diet_after_50_steps_is_within_25_percent_of_the_original(graphs, tmp_path):
    """Lean (no first moment, SM3's cover as the second): 13-16% over the original's loss
    here in eight runs, the original itself moving by 8% from run to run; Adafactor's rank-1
    estimate was within 5% on this MLP but stopped a deep MLP built outside the repo from
    learning at all."""
    _diet(graphs["adam_resource"], tmp_path / "diet.meta")
    original, _ = _train(graphs["adam_resource"], 50)
    dieted, _ = _train(tmp_path / "diet.meta", 50)
    assert dieted[0] == pytest.approx(original[0], rel=1e-2)  # the same start, quantized
    assert dieted[-1] < 0.85 * dieted[0]
    assert abs(dieted[-1] - original[-1]) <= 0.25 * original[-1], (original[-1], dieted[-1])


@pytest.mark.tf
@pytest.mark.parametrize("key", ["adam_ref", "momentum_resource", "momentum_ref", "sgd_resource",
                                 "rmsprop_resource", "rmsprop_ref", "rmspropmomentum_resource",
                                 "kerasnesterov_resource", "adagrad_resource", "adagrad_ref",
                                 "kerasadagrad_resource"])
def test_other_optimizer_forms_are_dieted_and_train(graphs, tmp_path, key):
    result, model = _diet(graphs[key], tmp_path / "diet.meta")
    assert sorted(result.results["diet"].dieted) == ["mlp/dense/kernel", "mlp/dense_1/kernel"]
    if key.startswith("momentum"):
        assert "mlp/dense/kernel/Momentum" not in model.graph
        assert "mlp/logits/kernel/Momentum" in model.graph
    if key.startswith("kerasnesterov"):  # written whole, its momentum dropped
        writes = {model.graph.op(u) for u, slot in
                  model.graph.consumers(TensorRef("mlp/dense/kernel")) if slot == 0}
        assert "AssignVariableOp" in writes and "ResourceApplyKerasMomentum" not in writes
    if "adagrad" in key:  # its sum factored
        assert "mlp/dense/kernel/diet_rows" in model.graph
    if key.startswith("rmsprop"):  # its mean square factored, its momentum slot dropped
        assert "mlp/dense/kernel/diet_rows" in model.graph
        assert not [n for n in model.graph.nodes() if n.startswith("mlp/dense/kernel/RMSProp")]
        assert "mlp/logits/kernel/RMSProp_1" in model.graph
    original, _ = _train(graphs[key], 30)
    dieted, _ = _train(tmp_path / "diet.meta", 30)
    assert dieted[-1] < dieted[0]
    assert abs(dieted[-1] - original[-1]) <= 0.15 * original[-1], (original[-1], dieted[-1])


@pytest.mark.tf
@pytest.mark.parametrize("key", ["adam_resource", "adam_ref"])
def test_checkpoint_holds_float_weights_and_the_diet_slots_and_restores(graphs, tmp_path, key):
    """A ref variable's Saver reads the variable itself: it gets a dequantization of its own
    (sharing the step's, which waits for the forward pass, saving needed the step's input)."""
    import tensorflow as tf

    _diet(graphs[key], tmp_path / "diet.meta")
    _, saved = _train(tmp_path / "diet.meta", 5, checkpoint=tmp_path / "ckpt")
    reader = tf.train.load_checkpoint(str(tmp_path / "ckpt"))
    kinds = reader.get_variable_to_dtype_map()
    assert kinds["mlp/dense/kernel"] == tf.float32  # the dequantized value
    assert "mlp/dense/kernel/diet_rows" in kinds and "mlp/dense/kernel/Adam" not in kinds
    assert "mlp/logits/kernel/Adam" in kinds
    scale = diet.DietOptions().scale
    assert np.array_equal(reader.get_tensor("mlp/dense/kernel"),
                          saved["mlp/dense/kernel"].astype(np.float32) * np.float32(scale))
    graph = tf.Graph()
    with graph.as_default():
        saver = tf.compat.v1.train.import_meta_graph(str(tmp_path / "diet.meta"))
        variables = tf.compat.v1.global_variables()
        with tf.compat.v1.Session(graph=graph) as session:
            saver.restore(session, str(tmp_path / "ckpt"))
            restored = dict(zip([v.op.name for v in variables], session.run(variables)))
    assert set(restored) == set(saved)
    for name, value in saved.items():
        assert restored[name].dtype == value.dtype and np.array_equal(restored[name], value), name


@pytest.mark.tf
@pytest.mark.parametrize("fmt", ["int16", "bfloat16"])
def test_stochastic_rounding_is_unbiased_and_nearest_is_not(fmt):
    """10^5 draws of one value between two representable ones: stochastic rounding's mean is
    the value; rounding to nearest always gives the same neighbour."""
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2

    from graphrewrite.core.graph import Graph

    options = diet.DietOptions(format=fmt)
    if fmt == "int16":  # grid points k * scale, as the graph computes them
        q = options.scale
        low = float(np.float32(3277) * np.float32(q))
    else:  # bfloat16's spacing in [1, 2)
        q, low = 2.0 ** -7, 1.0
    value = float(np.float32(low + 0.3 * q))
    shape = (100000,)
    graph = Graph.from_graph_def(graph_pb2.GraphDef())
    b = build.Builder(graph, "t")
    x = b.const("x", np.full(shape, value, np.float32))
    outputs = []
    for stochastic in (True, False):
        raw = build.quantize(b, x, shape, FORMATS[fmt], options.scale, stochastic, 1)
        op, args = build.dequantize(b, raw, FORMATS[fmt], options.scale)
        outputs.append(b.op("out", op, args, **build.dequantize_attrs(FORMATS[fmt])))
    with tf.Graph().as_default() as tf_graph:
        tf.graph_util.import_graph_def(graph.to_graph_def(), name="")
        with tf.compat.v1.Session(graph=tf_graph) as session:
            stochastic, nearest = session.run([f"{r.node}:0" for r in outputs])
    assert set(np.round((stochastic - low) / q).astype(int)) == {0, 1}
    assert abs(stochastic.mean() - value) < 0.01 * q
    assert np.all(nearest == np.float32(low))


@pytest.mark.tf
def test_recompute_after_diet_never_copies_its_random_ops(tmp_path):
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [BATCH, FEATURES], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
        h = x
        for i in range(8):
            h = tf.compat.v1.layers.dense(h, 64, activation=tf.nn.tanh, name=f"d{i}")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.compat.v1.layers.dense(h, CLASSES, name="out")), name="loss")
        meta = _adam_meta_graph(loss, 1e-3)
    (tmp_path / "deep.meta").write_bytes(meta.SerializeToString())
    result, model = _diet(tmp_path / "deep.meta", tmp_path / "out.meta",
                          "diet(min_size=1000) recompute(policy=memory)")
    assert len(result.results["diet"].dieted) == 8  # d0..d7; out (64x4) is too small
    assert result.of(RecomputeResult).recomputed, "recompute should rewrite this graph"
    graph = model.graph
    randoms = {n for n in graph.nodes() if graph.op(n) == "RandomUniform"}
    assert len(randoms) == 8
    copies = {names.copied_from(n) for n in graph.nodes()} - {None}
    assert not copies & randoms
    assert not any(names.copied_from(n) for n in graph.nodes()
                   if graph.op(n) in ("RandomUniform", "RandomUniformInt"))
    losses, _ = _train(tmp_path / "out.meta", 5)
    assert np.isfinite(losses).all()


@pytest.mark.tf
def test_frozen_graph_constants_are_stored_in_16_bits(tmp_path):
    from tensorflow.core.framework import types_pb2

    from graphrewrite.execution import verify

    from conftest import fixture_path

    model = io.load(fixture_path("mlp"))
    result = pipeline.optimize(model, "diet", composed="diet")
    facts = result.results["diet"]
    assert facts.constants and facts.bytes_saved > 0
    for name in facts.constants:
        assert result.graph.op(name) == "Mul"  # the constant's name now reads the dequantized
    # Each dequantization waits for the activation its reader multiplies (computed from the
    # constants alone, it would run when the step starts: every weight a float32 copy at once).
    graph, gated = result.graph, 0
    for name in facts.constants:
        cast = graph.data_inputs(name)[0].node
        copy = graph.data_inputs(cast)[0].node
        readers = {u for u, _ in graph.consumers(TensorRef(name))}
        readers |= {u for r in readers for u, _ in graph.consumers(TensorRef(r))}  # its Identity
        inputs = {ref.node for r in readers if graph.op(r) == "MatMul"
                  for ref in graph.data_inputs(r)} - {"x"}  # the fed input is there at start
        assert graph.op(cast) == "Cast" and graph.op(copy) == "DeepCopy"
        gated += bool(set(graph.control_inputs(copy)) & inputs)
    assert gated == len(facts.constants) - 1  # all but the first layer's
    # as run: Grappler's constant folding leaves the 16-bit constants 16-bit (it folded
    # Cast(Const) * scale back into float32 before they were read through a placeholder)
    from graphrewrite.analysis import grappler
    from graphrewrite.analysis import step as analysis

    run = grappler.as_run(result.graph, analysis.default_fetches(model))
    kinds = {run.node_def(n).attr["value"].tensor.dtype for n in run.nodes()
             if run.op(n) == "Const" and (n in facts.constants or n.endswith("diet/raw"))}
    assert kinds == {types_pb2.DT_INT16}, kinds
    io.save(model, result.graph, tmp_path / "mlp.pbtxt")
    # the loss moves by the weights' quantization error (the gradients, of small magnitude
    # and sums of many terms, move more in relative terms)
    checked = verify.verify(model, io.load(tmp_path / "mlp.pbtxt"),
                            verify.VerifyOptions(fetches=["outputs/loss"], runs=0, rtol=1e-2),
                            isolated=False)
    assert checked.match, checked.to_json()["mismatched"]


@pytest.mark.tf
def test_forward_reads_of_a_dieted_weight_wait_for_their_activation(graphs):
    """A dequantizing read has no input from the step: ungated, the executor runs it when the
    step starts and every weight is a float32 copy until its forward use. (Without a model
    of the step to price the two orders with, the pass keeps them gated.)"""
    from graphrewrite.analysis import step as analysis

    model = io.load(graphs["adam_resource"])
    result = diet.run(model.graph, analysis.analyse(model), diet.DietOptions(), model=None)
    assert (result.forward_reads, result.read_peaks) == ("gated", [])
    graph = result.graph
    casts = [n for n in graph.nodes() if graph.op(n) == "Cast"
             and graph.op(graph.data_inputs(n)[0].node) == "ReadVariableOp"
             and graph.data_inputs(graph.data_inputs(n)[0].node)[0].node
             == "mlp/dense_1/kernel"]
    gates = {c for n in casts for c in graph.control_inputs(n)}
    assert "mlp/dense/Relu" in gates, {n: graph.control_inputs(n) for n in casts}


def _frozen(path, build):
    """A frozen graph built by `build(tf, rng)` in a fresh tf.Graph, written to `path`."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        build(tf, np.random.RandomState(0))
    path.write_bytes(graph.as_graph_def().SerializeToString())
    return io.load(path)


def _chain(tf, rng):
    """12 x 1 MiB of float32 weights, activations of 8 KiB: each dequantized weight copy
    should exist only around its use."""
    h = tf.compat.v1.placeholder(tf.float32, [None, 512], name="x")  # 4 rows, given
    for i in range(12):
        h = tf.nn.relu(tf.matmul(h, tf.constant(rng.standard_normal([512, 512]).astype(
            np.float32) / 23, name=f"w{i}")), name=f"relu{i}")
    tf.identity(h, name="out")


def _tied(tf, rng):
    """One small weight read by two readers on parallel branches (tied weights): by a 4 MiB
    activation early, and at the end of a branch that holds 12 MiB later. Gated, the early
    reader waits for the late one's input too (a gate is every input of every reader), so the
    4 MiB stay through the other branch's 12."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 512], name="x")  # 64 rows, given
    w = tf.constant(rng.standard_normal([512, 8]).astype(np.float32), name="w")
    early = tf.matmul(tf.tile(x, [32, 1], name="a1"), w, name="early")
    wide = tf.concat([tf.tile(tf.sin(x) * tf.cos(x) + x, [1, 32], name="b1")] * 2, 0,
                     name="b2")
    late = tf.matmul(tf.reduce_sum(tf.reshape(tf.reduce_sum(wide, 0), [32, 512]), 0,
                                   keepdims=True, name="x2"), w, name="late")
    tf.add(tf.reduce_sum(early), tf.reduce_sum(late), name="out")


@pytest.mark.tf
@pytest.mark.parametrize("build, rows, kept", [(_chain, 4, "gated"), (_tied, 64, "ungated")])
def test_diet_keeps_the_order_of_forward_reads_that_peaks_lower_as_run(tmp_path, build, rows,
                                                                        kept):
    """Both orders are priced as `optimize` reports the step (Grappler, then the allocator
    model, at the --input-shape given); the kept graph is the lower one, and the report's
    as-run peak is its price. Modelled on a GPU, whose executor runs ready kernels first come
    first served: the order these graphs were built for (on a CPU's two threads `_tied`'s
    orders tie)."""
    model = _frozen(tmp_path / "frozen.pb", build)
    result = pipeline.optimize(model, "diet", AnalysisOptions(input_shapes={"x": (rows, 512)},
                                                              device="gpu"), composed="diet")
    dieted = result.results["diet"]
    gated, ungated = dieted.read_peaks
    assert dieted.forward_reads == kept, (gated / 2**20, ungated / 2**20)
    low, high = sorted((gated, ungated))
    assert high - low >= 2**21, "the orders should differ clearly here (2 MiB or more)"
    assert result.run_peaks[1] == low
    graph = result.graph
    cast = next(n for n in graph.nodes() if graph.op(n) == "DeepCopy"
                and n.startswith("w/" if build is _tied else "w1/"))
    assert bool(graph.control_inputs(cast)) == (kept == "gated")


@pytest.mark.tf
def test_frozen_diet_measures_its_weights_halved(tmp_path):
    """As the session runs it: its own graph optimizer (not Grappler) folds a dequantization
    of a constant read through a PlaceholderWithDefault back into a float32 constant, and each
    dequantization left ungated runs when the step starts; then the peak does not fall."""
    import tensorflow as tf

    from graphrewrite.execution import measure

    graph = tf.Graph()
    rng = np.random.RandomState(0)
    with graph.as_default():
        h = tf.compat.v1.placeholder(tf.float32, [4, 512], name="x")
        for i in range(12):  # 12 x 1 MiB of float32 weights, activations of 8 KiB
            h = tf.nn.relu(tf.matmul(h, tf.constant(rng.standard_normal([512, 512]).astype(
                np.float32) / 23, name=f"w{i}")), name=f"relu{i}")
        tf.identity(h, name="out")
    (tmp_path / "frozen.pb").write_bytes(graph.as_graph_def().SerializeToString())
    model = io.load(tmp_path / "frozen.pb")
    result = pipeline.optimize(model, "diet", composed="diet")
    io.save(model, result.graph, tmp_path / "diet.pb")
    feeds = {"x": rng.standard_normal([4, 512]).astype(np.float32)}
    before = measure.run_step(model.runnable(), feeds, ["out"], 0)
    after = measure.run_step(io.load(tmp_path / "diet.pb").runnable(), feeds, ["out"], 0)
    saved = result.results["diet"].bytes_saved
    assert saved == 12 * 512 * 512 * 2
    assert before.peak_bytes - after.peak_bytes >= 0.6 * saved, (before.peak_bytes,
                                                                  after.peak_bytes)
    assert np.allclose(before.outputs["out:0"], after.outputs["out:0"], rtol=1e-2, atol=1e-3)


@pytest.mark.tf
def test_verify_steps_compares_loss_curves_and_inspect_counts_bytes(graphs, tmp_path):
    from conftest import run_cli

    out = tmp_path / "diet.meta"
    _diet(graphs["adam_resource"], out)
    from graphrewrite.cli.tables import format_verify
    from graphrewrite.execution import verify

    original, rewritten = io.load(graphs["adam_resource"]), io.load(out)
    outcome = verify.verify(original, rewritten,
                            verify.VerifyOptions(rtol=0.5, runs=1, int_high=CLASSES, steps=12,
                                                 repeat=2), isolated=False)
    facts = outcome.to_json()
    curves = facts["loss_curves"]
    assert facts["match"] and facts["steps"] == 12 and facts["loss"] == "loss:0"
    # the peaks' range over processes and the step times, as without --steps (once left out)
    shown = format_verify(facts).splitlines()
    assert [line.split()[0] for line in shown[-4:]] == ["peak", "peak", "step", "device"], shown
    assert shown[-4].endswith("x") and "the median of 2 processes" in shown[-3]
    assert len(curves["original"]) == len(curves["rewritten"]) == 12
    assert curves["original"][0] == pytest.approx(curves["rewritten"][0], rel=1e-2)
    assert curves["original"] != curves["rewritten"]  # lossy: the curves differ
    strict = verify.verify(original, rewritten,
                           verify.VerifyOptions(rtol=1e-9, runs=0, int_high=CLASSES, steps=12),
                           isolated=False)
    shown = format_verify(strict.to_json())
    assert not strict.match and "MISMATCH" in shown and "rewritten" in shown
    import json

    before = json.loads(run_cli("inspect", graphs["adam_resource"], "--json").stdout)
    after = json.loads(run_cli("inspect", out, "--json").stdout)
    assert before["bytes_per_parameter_2d"] == pytest.approx(12.0)  # value, m, v in float32
    assert after["bytes_per_parameter_2d"] <= 2.5
    assert after["trainable_parameters"] == before["trainable_parameters"]
    assert after["persistent_bytes"] < 0.3 * before["persistent_bytes"]


def _keras_step(optimizer: str, lr: float, hidden: int = HIDDEN, schedule: bool = True,
                shrink_after: bool = False, ema: bool = False, perturb: bool = False):
    """A TF2 training step (GradientTape + a Keras optimizer's apply_gradients) over a 2-layer
    MLP, its GraphDef exported as `concrete.graph.as_graph_def(add_shapes=True)`; returns
    (tf.function, its input signature, the model, the GraphDef). `schedule=False` keeps the
    rate a float, which Keras holds in a captured variable; `shrink_after` writes every weight
    once more after the update (`w -= w * 1e-4`, a hand-made decay); `ema` keeps an
    exponential moving average of the weights, updated in the step; `perturb` moves each
    weight along its gradient and back before the update, as SAM does."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(5)
    model = tf.keras.Sequential([tf.keras.layers.Dense(hidden, activation="relu"),
                                 tf.keras.layers.Dense(CLASSES)])
    model.build((None, FEATURES))
    # A schedule, not a float: Keras keeps a float rate in a variable, which a bound step's
    # seeded values would replace; a schedule's rate is a constant of the step.
    if schedule:
        lr = tf.keras.optimizers.schedules.ExponentialDecay(lr, 1000, 1.0)
    make = {"adam": lambda: tf.keras.optimizers.Adam(lr, jit_compile=False),
            "momentum": lambda: tf.keras.optimizers.SGD(lr, momentum=0.9, jit_compile=False),
            "nesterov": lambda: tf.keras.optimizers.SGD(lr, momentum=0.9, nesterov=True,
                                                        jit_compile=False),
            "rmsprop_momentum": lambda: tf.keras.optimizers.RMSprop(lr, momentum=0.9,
                                                                    jit_compile=False),
            "adagrad": lambda: tf.keras.optimizers.Adagrad(lr, jit_compile=False),
            "lso": lambda: tf.keras.mixed_precision.LossScaleOptimizer(
                tf.keras.optimizers.SGD(lr, momentum=0.9, jit_compile=False)),
            "sgd": lambda: tf.keras.optimizers.SGD(lr, jit_compile=False),
            "adamw": lambda: tf.keras.optimizers.AdamW(lr, jit_compile=False),
            "lion": lambda: tf.keras.optimizers.Lion(lr, jit_compile=False),
            "rmsprop": lambda: tf.keras.optimizers.RMSprop(lr, jit_compile=False),
            "nadam": lambda: tf.keras.optimizers.Nadam(lr, jit_compile=False),
            "adamax": lambda: tf.keras.optimizers.Adamax(lr, jit_compile=False),
            "adadelta": lambda: tf.keras.optimizers.Adadelta(lr, jit_compile=False),
            "handmade": lambda: _RootMeanSquare(lr)}
    optimizer = make[optimizer]()
    optimizer.build(model.trainable_variables)
    average = tf.train.ExponentialMovingAverage(0.999) if ema else None
    if ema:
        average.apply(model.trainable_variables)  # its shadow variables, made eagerly
    signature = [tf.TensorSpec([BATCH, FEATURES], tf.float32, name="x"),
                 tf.TensorSpec([BATCH], tf.int32, name="labels")]

    @tf.function(input_signature=signature)
    def step(x, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                labels, model(x, training=True), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if perturb:
            for weight, grad in zip(model.trainable_variables, grads):
                weight.assign_add(1e-3 * grad)
                weight.assign_sub(1e-3 * grad)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if shrink_after:
            for weight in model.trainable_variables:
                weight.assign_sub(weight * 1e-4)
        if ema:
            average.apply(model.trainable_variables)
        return loss

    graph_def = step.get_concrete_function().graph.as_graph_def(add_shapes=True)
    return step, signature, model, graph_def


class _RootMeanSquare:
    """A hand-written optimizer, as a program might carry its own: a mean square of each
    weight's gradient (`assign`) scales its step (`assign_sub`)."""

    def __init__(self, lr):
        self.lr = lr

    def build(self, weights):
        import tensorflow as tf

        self.squares = [tf.Variable(tf.zeros_like(w), trainable=False) for w in weights]

    def apply_gradients(self, pairs):
        import tensorflow as tf

        lr = self.lr(0) if callable(self.lr) else self.lr
        for (grad, weight), square in zip(pairs, self.squares):
            square.assign(0.9 * square + 0.1 * grad * grad)
            weight.assign_sub(lr * grad / (tf.sqrt(square) + 1e-7))


def _tf2_losses(model, steps):
    """Losses of `steps` steps of a TF2 step's GraphDef on the fixed batch, its captured
    variables bound to seeded values (the diet graph's: the same ones, quantized)."""
    from graphrewrite.analysis import shapes as shapes_mod
    from graphrewrite.analysis import step as analysis
    from graphrewrite.execution import measure, verify

    shapes = shapes_mod.infer(model.graph)
    x, y = _data()
    first = {**measure.random_feeds(model.graph, shapes, 0), "x": x, "labels": y}
    first = verify.own_variables(model, first, 0)
    # Optimizer slots start at zero, as a program's do (seeded values are for weights).
    slots = {s for u in optimizers.updates(model.graph) for s in u.slots.values()}
    slots |= {n for n in model.graph.nodes() if SLOT_OF_ATTR in model.graph.node_def(n).attr}
    first.update({n: np.zeros_like(first[n]) for n in slots})
    fetches = analysis.default_fetches(model, shapes=shapes)
    batches = [first] + [{"x": x, "labels": y}] * (steps - 1)
    return measure.loss_curve(model.runnable(), batches, fetches, f"{fetches[0]}:0")


@pytest.mark.tf
@pytest.mark.parametrize("optimizer,lr,slots", [
    ("adam", 2e-3, ("diet_rows", "diet_cols")), ("adamw", 2e-3, ("diet_rows", "diet_cols")),
    ("rmsprop", 1e-3, ("diet_rows", "diet_cols")), ("momentum", 0.05, ("diet_momentum",)),
    ("sgd", 0.5, ()),
    ("nesterov", 0.05, ("diet_momentum",)), ("adagrad", 0.05, ()),
    ("lion", 2e-3, ("diet_momentum",))])
def test_tf2_keras_steps_are_dieted_and_train_like_the_original(tmp_path, optimizer, lr, slots):
    from graphrewrite.analysis import bind
    from graphrewrite.analysis.state import parameter_facts

    *_, graph_def = _keras_step(optimizer, lr)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    original = io.load(tmp_path / "step.pb")
    result, model = _diet(tmp_path / "step.pb", tmp_path / "diet.pb")
    facts = result.results["diet"]
    assert len(facts.dieted) == 1  # the 32x128 kernel; 128x4 and the biases are small
    graph = model.graph
    kernel = facts.dieted[0]
    assert bind.diet_mark(graph, kernel).startswith("int16")
    added = [n for n in bind.resource_placeholders(graph) if n not in original.graph]
    assert sorted(n.rsplit("/", 1)[1] for n in added) == sorted(slots)
    removed = [n for n in bind.resource_placeholders(original.graph) if n not in graph]
    # Keras 2.15 SGD keeps m with momentum 0
    assert len(removed) == {"adam": 2, "adamw": 2, "rmsprop": 1, "momentum": 1, "sgd": 1,
                            "nesterov": 1, "adagrad": 0, "lion": 1}[optimizer]
    if optimizer == "adamw":  # the decay's own write is gone, folded into the 16-bit update
        writes = [u for u, slot in graph.consumers(kernel) if slot == 0
                  and graph.op(u).startswith("Assign")]
        assert [graph.op(w) for w in writes] == ["AssignVariableOp"], writes
    # The kernel's 16 bits, the removed float32 slots of its shape (placeholders: their shape
    # is the kernel's), less the factored moment's (32, 1) and (1, 128) float32 slots or the
    # momentum's bfloat16 one.
    added_bytes = {(): 0, ("diet_momentum",): 32 * 128 * 2}.get(slots, (32 + 128) * 4)
    assert facts.bytes_saved == 32 * 128 * (2 + 4 * len(removed)) - added_bytes
    assert not graph.check()
    before = parameter_facts(original.graph, _shapes(original))
    after = parameter_facts(graph, _shapes(model))
    assert before["trainable_parameters"] == after["trainable_parameters"]
    assert before["bytes_per_parameter_2d"] > after["bytes_per_parameter_2d"], (before, after)
    if optimizer == "adam":  # verify binds each graph's own captured variables
        from graphrewrite.execution import verify

        checked = verify.verify(original, model,
                                verify.VerifyOptions(rtol=0.5, runs=0, int_high=CLASSES, steps=3,
                                                     repeat=2), isolated=False)
        assert checked.match and checked.rewritten.peak_bytes < checked.original.peak_bytes
        # the peaks measured twice each, as without --steps (they were measured once)
        assert [len(checked.peak_runs[k]) for k in ("original", "rewritten")] == [2, 2]
        # Two steps compared bitwise (lossy: they differ), the cause sought, both timed: each
        # run binds the dieted graph its own 16-bit weights.
        plain = verify.verify(original, model,
                              verify.VerifyOptions(runs=1, int_high=CLASSES), isolated=False)
        assert not plain.match and plain.rewritten.step_seconds
        from graphrewrite.cli.tables import format_verify

        assert plain.dieted == 1 and "(diet: lossy), so the outputs cannot match bitwise" \
            in format_verify(plain.to_json())
    start = _tf2_losses(original, 30)
    dieted = _tf2_losses(model, 30)
    assert dieted[0] == pytest.approx(start[0], rel=1e-2)  # the same start, quantized
    assert dieted[-1] < 0.9 * dieted[0]
    assert abs(dieted[-1] - start[-1]) <= 0.1 * start[-1], (start[-1], dieted[-1])


@pytest.mark.tf
def test_verify_steps_on_a_fixed_set_sees_learning_and_a_graph_that_does_not_learn(graphs,
                                                                                   tmp_path):
    from graphrewrite.cli.tables import format_verify
    from graphrewrite.execution import verify

    original = io.load(graphs["adam_resource"])
    _diet(graphs["adam_resource"], tmp_path / "diet.meta")
    learns = verify.verify(original, io.load(tmp_path / "diet.meta"),
                           verify.VerifyOptions(rtol=0.1, runs=0, int_high=CLASSES, steps=30, batches=2),
                           isolated=False)
    facts = learns.to_json()
    trend = facts["trend"]
    assert facts["batches"] == 2 and trend["original"]["window"] == 2
    assert trend["original"]["fell"] and trend["rewritten"]["fell"], trend
    assert trend["original"]["end"] < 0.95 * trend["original"]["start"]  # it memorises
    assert learns.match
    # Both curves start at the mean of the first pass over the set and end at the last's.
    curve = facts["loss_curves"]["original"]
    assert trend["original"]["start"] == pytest.approx(np.mean(curve[:2]))
    assert trend["original"]["end"] == pytest.approx(np.mean(curve[-2:]))
    # The verdict compares those ends, not one batch's loss.
    compared = facts["compared"]
    assert compared["what"] == "end"
    assert (compared["original"], compared["rewritten"]) == (trend["original"]["end"],
                                                             trend["rewritten"]["end"])
    # The same model with a learning rate of (almost) nothing: its loss does not fall, and that
    # alone fails the check, though its final loss is within the (loose) rtol.
    still = verify.verify(original, io.load(_build(tmp_path / "still.meta", lr=1e-30)),
                          verify.VerifyOptions(rtol=0.5, runs=0, int_high=CLASSES, steps=30, batches=2),
                          isolated=False)
    facts = still.to_json()
    final = facts["final_loss"]
    assert abs(final["rewritten"] - final["original"]) <= 0.5 * final["original"]
    assert not facts["trend"]["rewritten"]["fell"] and not still.match
    shown = format_verify(facts)
    assert "MISMATCH" in shown and "fell" in shown and "2 fixed batches" in shown


@pytest.mark.tf
def test_verify_data_trains_on_the_users_set(graphs, tmp_path):
    """--data's batches are what both graphs train on: a set made of the very batches
    --batches K seeds gives the same curves bit for bit, and other labels give other curves."""
    from graphrewrite.analysis import shapes as shapes_mod
    from graphrewrite.execution import measure, verify

    original = io.load(graphs["adam_resource"])
    _diet(graphs["adam_resource"], tmp_path / "diet.meta")
    dieted = io.load(tmp_path / "diet.meta")
    run = dict(rtol=0.5, runs=0, int_high=CLASSES, steps=6)
    seeded = verify.verify(original, dieted, verify.VerifyOptions(batches=3, **run),
                           isolated=False).to_json()
    shapes = shapes_mod.infer(original.graph)
    made = [measure.random_feeds(original.graph, shapes, k, CLASSES) for k in range(3)]
    data = {name: np.concatenate([batch[name] for batch in made]) for name in ("x", "labels")}
    given = verify.verify(original, dieted, verify.VerifyOptions(data=data, **run),
                          isolated=False).to_json()
    assert given["batches"] == 3
    assert given["loss_curves"] == seeded["loss_curves"]
    data["labels"] = (data["labels"] + 1) % CLASSES
    other = verify.verify(original, dieted,
                          verify.VerifyOptions(data=data, batches=2, **run),
                          isolated=False).to_json()
    assert other["batches"] == 2
    assert other["loss_curves"]["original"] != seeded["loss_curves"]["original"]


@pytest.mark.parametrize("data, message", [
    ({"x": np.zeros((8, FEATURES)), "ghost": np.zeros(8)}, "'ghost', which is not an input"),
    ({"x": np.zeros((8, FEATURES + 1))}, f"examples of shape [{FEATURES + 1}], the graph takes "
                                         f"[{FEATURES}]"),
    ({"x": np.zeros((BATCH - 1, FEATURES))}, f"fewer than one batch of {BATCH}"),
    ({"x": np.zeros((2 * BATCH, FEATURES)), "labels": np.zeros(BATCH, np.int64)},
     "different numbers of batches (labels: 1, x: 2)"),
    ({"labels": np.zeros(BATCH, np.float32)}, "float32 values, the graph takes int32"),
    ({}, "holds no arrays"),
])
def test_verify_data_that_does_not_fit_the_graph_is_refused(graphs, data, message):
    from graphrewrite.analysis import shapes as shapes_mod
    from graphrewrite.execution import verify

    graph = io.load(graphs["adam_resource"]).graph
    with pytest.raises(GraphRewriteError, match=re.escape(message)):
        verify.data_batches(graph, shapes_mod.infer(graph), data)


def test_verify_data_cuts_batches_in_the_graphs_dtypes(graphs):
    from graphrewrite.analysis import shapes as shapes_mod
    from graphrewrite.execution import verify

    graph = io.load(graphs["adam_resource"]).graph
    x = np.arange((2 * BATCH + 1) * FEATURES, dtype=np.float64).reshape(-1, FEATURES)
    batches = verify.data_batches(graph, shapes_mod.infer(graph),
                                  {"x": x, "labels": np.arange(2 * BATCH + 1) % CLASSES})
    assert len(batches) == 2  # the partial third batch is dropped
    assert batches[1]["x"].dtype == np.float32 and batches[1]["labels"].dtype == np.int32
    assert np.array_equal(batches[1]["x"], x[BATCH:2 * BATCH])


def test_verify_data_needs_steps_and_a_readable_archive(graphs, tmp_path):
    np.save(tmp_path / "one.npy", np.zeros(3))
    np.savez(tmp_path / "set.npz", x=np.zeros((BATCH, FEATURES), np.float32))
    for extra, message in ((["--data", tmp_path / "set.npz"], "--data is for --steps N"),
                           (["--data", tmp_path / "one.npy", "--steps", "2"],
                            "not an .npz archive"),
                           (["--data", tmp_path / "none.npz", "--steps", "2"], "cannot read")):
        shown = run_cli("verify", graphs["adam_resource"], graphs["adam_resource"], *extra)
        assert shown.exit_code == 2 and message in shown.stderr, shown.stderr
        assert len(shown.stderr.strip().splitlines()) == 1


def test_verify_batches_needs_steps():
    from graphrewrite.execution import verify

    with pytest.raises(GraphRewriteError, match="batches K"):
        verify.verify(None, None, verify.VerifyOptions(batches=4))
    with pytest.raises(GraphRewriteError, match="batches K"):
        verify.verify(None, None, verify.VerifyOptions(steps=5, batches=-1))


@pytest.mark.tf
def test_verify_steps_starts_a_tf2_step_with_zero_slots_and_a_sane_learning_rate(tmp_path):
    """A Keras float rate is a captured variable with no value in the step: verify --steps
    starts it at 1e-3 (a seeded value would be up to 0.1) and every slot at zero, the diet
    graph's new ones too, as a training run starts."""
    from graphrewrite.analysis import bind
    from graphrewrite.execution import verify

    *_, graph_def = _keras_step("adam", 1e-3, schedule=False)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    original = io.load(tmp_path / "step.pb")
    _, model = _diet(tmp_path / "step.pb", tmp_path / "diet.pb")
    from graphrewrite.execution import measure

    seeded = measure.random_feeds(original.graph, _shapes(original), 0, CLASSES)
    start = verify.training_start(original, seeded)
    scalars = {n for n in bind.resource_placeholders(original.graph)
               if start[n].shape == () and start[n].dtype == np.float32}
    assert len(scalars) == 1 and float(start[scalars.pop()]) == pytest.approx(1e-3)
    slots = {s for u in optimizers.updates(original.graph) for s in u.slots.values()}
    assert len(slots) == 8 and all(not start[s].any() for s in slots)
    assert all(seeded[s].any() for s in slots)  # what a bitwise verify still binds
    ours = verify.training_start(model, verify.own_variables(model, start, 0))
    new = [n for n in bind.resource_placeholders(model.graph)
           if SLOT_OF_ATTR in model.graph.node_def(n).attr]
    assert new and all(not ours[n].any() for n in new)
    checked = verify.verify(original, model,
                            verify.VerifyOptions(rtol=0.1, runs=0, int_high=CLASSES, steps=20, batches=1),
                            isolated=False)
    trend = checked.to_json()["trend"]
    assert checked.match and trend["original"]["fell"] and trend["rewritten"]["fell"], trend


def _shapes(model):
    from graphrewrite.analysis import shapes as shapes_mod

    return shapes_mod.infer(model.graph)


@pytest.mark.tf
def test_tf2_keras_rmsprop_keeps_its_momentum_in_a_slot_of_its_own(tmp_path):
    """Keras's own update of RMSprop's momentum reads the mean square that diet factors: kept,
    the momentum is a new float32 slot that diet updates, and Keras's is gone."""
    from graphrewrite.analysis import bind

    *_, graph_def = _keras_step("rmsprop_momentum", 2e-4)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    original = io.load(tmp_path / "step.pb")
    [kernel] = pipeline.optimize(original, "diet").results["diet"].dieted
    [update] = [u for u in optimizers.updates(original.graph) if u.var == kernel]
    losses = {}
    for momentum in ("keep", "drop"):
        _, model = _diet(tmp_path / "step.pb", tmp_path / f"{momentum}.pb",
                         f"diet(momentum={momentum})")
        added = [n for n in bind.resource_placeholders(model.graph) if n not in original.graph]
        assert any(n.endswith("/diet_momentum") for n in added) == (momentum == "keep")
        assert update.slots["mom"] not in model.graph and update.slots["ms"] not in model.graph
        losses[momentum] = _tf2_losses(model, 30)[-1]
    start = _tf2_losses(original, 30)
    assert abs(losses["keep"] - start[-1]) <= 0.1 * start[-1]
    assert losses["keep"] < 0.9 * start[0] and losses["drop"] < 0.9 * start[0]


@pytest.mark.tf
def test_tf2_keras_adam_keeps_its_own_moments_when_asked(tmp_path):
    *_, graph_def = _keras_step("adam", 3e-3)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    original = io.load(tmp_path / "step.pb")
    _, model = _diet(tmp_path / "step.pb", tmp_path / "diet.pb",
                     "diet(momentum=keep, factored=false, format=bfloat16)")
    from graphrewrite.analysis import bind

    assert set(bind.resource_placeholders(model.graph)) == set(
        bind.resource_placeholders(original.graph))
    losses = _tf2_losses(model, 20)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.tf
def test_tf2_api_runs_a_diet_step_on_variables_it_makes_and_writes_back():
    import tensorflow as tf

    from graphrewrite import tf2

    step, signature, keras_model, _ = _keras_step("adam", 3e-3)
    rewritten = tf2.rewrite(step, mode="diet")
    kernel = keras_model.trainable_variables[0]
    before = kernel.numpy()
    dtypes = sorted(v.dtype.name for v in rewritten.variables.values())
    assert dtypes == ["float32", "float32", "int16"]  # two factored slots and the kernel
    x, y = _data()
    losses = [float(rewritten(tf.constant(x), tf.constant(y))) for _ in range(15)]
    assert losses[-1] < 0.8 * losses[0]
    assert np.array_equal(kernel.numpy(), before)  # the program's kernel waits for write_back
    rewritten.write_back()
    assert np.abs(kernel.numpy() - before).max() > 1e-3
    assert np.allclose(kernel.numpy() / diet.DietOptions().scale,
                       np.round(kernel.numpy() / diet.DietOptions().scale), atol=1e-2)


@pytest.mark.tf
def test_a_learning_rate_of_zero_leaves_the_weights_as_they_are():
    """A warmup's first step has a rate of 0: diet's lean Adam divided by it, and the NaN it
    made was written as zeros by the 16-bit cast (a BERT-like step built outside the repo)."""
    import tensorflow as tf

    from graphrewrite import tf2

    step, _, keras_model, _ = _keras_step("adam", 0.0)
    rewritten = tf2.rewrite(step, mode="diet")
    kernel = keras_model.trainable_variables[0]
    before = kernel.numpy()
    x, y = _data()
    for _ in range(2):
        rewritten(tf.constant(x), tf.constant(y))
    rewritten.write_back()
    assert np.abs(kernel.numpy() - before).max() <= diet.DietOptions().scale  # rounded once


@pytest.mark.tf
@pytest.mark.parametrize("optimizer,lr,writes", [
    ("nadam", 0.2, {"AssignVariableOp": 3}), ("adamax", 1e-3, {"AssignVariableOp": 3}),
    ("adadelta", 1.0, {"AssignVariableOp": 3}), ("handmade", 3e-2, {"AssignVariableOp": 2})])
def test_updates_diet_does_not_read_store_16_bits_and_train(tmp_path, optimizer, lr, writes):
    """Nadam, Adamax and a hand-written optimizer (an MLP-Mixer's LAMB, built outside the
    repo, was left float32): the weight in the format asked, its state in bfloat16, each
    write the optimizer's own float32 value rounded stochastically (an increment becomes a
    read, the sum and a whole write); training follows the original's."""
    from collections import Counter

    from graphrewrite.analysis import bind

    *_, graph_def = _keras_step(optimizer, lr)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    original = io.load(tmp_path / "step.pb")
    result, model = _diet(tmp_path / "step.pb", tmp_path / "diet.pb")
    graph, dieted = model.graph, result.results["diet"].dieted
    assert len(dieted) == sum(writes.values()), dieted  # the 32x128 kernel and its state
    marks = Counter(bind.diet_mark(graph, v).split()[0] for v in dieted)
    assert marks == {"int16": 1, "bfloat16": len(dieted) - 1}, marks
    steps = Counter(graph.op(u) for v in dieted for u, slot in graph.consumers(v)
                    if slot == 0 and graph.op(u).startswith("Assign")
                    and any(graph.op(n).startswith("RandomUniform")
                            for n in graph.data_ancestors([u])))
    assert steps == writes, steps
    assert not graph.check()
    start, trained = _tf2_losses(original, 30), _tf2_losses(model, 30)
    assert abs(start[-1] - start[0]) > 0.01 * start[0]  # the original's weights move
    assert trained[0] == pytest.approx(start[0], rel=1e-2)
    assert trained[-1] == pytest.approx(start[-1], rel=0.05)  # Adadelta: 0.603 against 0.622


@pytest.mark.tf
def test_tf2_updates_of_other_forms_stay_float32_with_one_warning(caplog, tmp_path):
    """The fixture's Keras Adam step is dieted; its batch-norm statistics (written from
    forward values, not gradients) are not warned about."""
    from conftest import fixture_path

    model = io.load(fixture_path("keras_step_tf2"))
    with caplog.at_level("WARNING", logger="graphrewrite.passes.diet"):
        result = pipeline.optimize(model, "diet", composed="diet(min_size=0)")
    facts = result.results["diet"]
    assert len(facts.dieted) == 10  # every weight (not the 2 statistics), with min_size=0
    assert not [r for r in caplog.records if "stay float32" in r.getMessage()]


@pytest.mark.tf
def test_updates_inside_a_loss_scale_cond_are_named_as_why_nothing_was_dieted(tmp_path):
    """A LossScaleOptimizer applies its gradients in an If's branch: diet rewrote nothing and
    said only that (a mixed-precision ResNet step built outside the repo)."""
    *_, graph_def = _keras_step("lso", 0.05)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    result, _ = _diet(tmp_path / "step.pb", tmp_path / "diet.pb")
    note = result.results["diet"].note
    assert not result.results["diet"].dieted
    assert "diet does not read updates inside" in note and "If" in note, note


@pytest.mark.tf
def test_an_ema_of_the_weights_is_named_as_a_moving_average(tmp_path, caplog):
    """The shadows of a weight EMA updated in the step were warned of as updates of a form
    diet does not read, naming Adam and Adagrad (a ConvNeXt step built outside the repo)."""
    *_, graph_def = _keras_step("adam", 1e-3, ema=True)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    with caplog.at_level("WARNING", logger="graphrewrite.passes.diet"):
        result = pipeline.optimize(io.load(tmp_path / "step.pb"), "diet")
    kept = result.results["diet"].kept_float
    averages = [v for reason, names in kept.items() if "moving average" in reason for v in names]
    assert len(averages) == 1 and len(result.results["diet"].dieted) == 1, kept  # the kernel's
    said = [r.getMessage() for r in caplog.records if "stay float32" in r.getMessage()]
    assert said and "moving average" in said[0] and "Adagrad" not in said[0], said


@pytest.mark.tf
def test_a_variable_kept_float32_is_listed_once(tmp_path):
    """A weight written twice, its update and then a decay of the program's own: refused for
    the one and unread for the other, it was listed under both reasons (a ViT's 27 weights
    warned as 54)."""
    *_, graph_def = _keras_step("adam", 1e-3, shrink_after=True)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    kept = pipeline.optimize(io.load(tmp_path / "step.pb"), "diet",
                             composed="diet(min_size=0, generic=false)"
                             ).results["diet"].kept_float
    listed = [name for names in kept.values() for name in names]
    assert len(listed) == len(set(listed)) == 4, kept  # two kernels, two biases
    # the generic form stores them, both writes rounded where they are made
    dieted = pipeline.optimize(io.load(tmp_path / "step.pb"), "diet",
                               composed="diet(min_size=0)").results["diet"].dieted
    assert set(listed) <= set(dieted), dieted


@pytest.mark.tf
def test_without_the_generic_form_an_assigned_state_is_named_as_such(tmp_path):
    """A hand-written mean square written whole (`assign`) was listed as "updated by  (not a
    supported optimizer update)", naming no op."""
    *_, graph_def = _keras_step("handmade", 1e-2)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    facts = pipeline.optimize(io.load(tmp_path / "step.pb"), "diet",
                              composed="diet(generic=false)").results["diet"]
    assert not facts.dieted
    assert any(r.startswith("assigned a value from the gradient") for r in facts.kept_float), \
        facts.kept_float


@pytest.mark.tf
def test_a_weight_the_generic_form_stores_is_not_listed_as_kept(tmp_path):
    """SAM moves the weights along their gradient and back beside Adam's update: the update
    is refused, the generic form stores the weight, and the warning listed it as kept float32
    all the same (a SAM step built outside the repo)."""
    *_, graph_def = _keras_step("adam", 1e-3, perturb=True)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    facts = pipeline.optimize(io.load(tmp_path / "step.pb"), "diet").results["diet"]
    listed = {name for names in facts.kept_float.values() for name in names}
    assert facts.dieted and not listed & set(facts.dieted), (facts.dieted, facts.kept_float)


@pytest.mark.tf
def test_backward_readers_get_a_late_read_and_the_update_waits_for_it(graphs, tmp_path):
    """The backward MatMul reads its own dequantized read, gated on the gradient it multiplies,
    so no float32 copy of the weight lives from the forward pass to the backward one; the
    update writes after that read."""
    from graphrewrite.analysis.split import split

    for key in ("adam_resource", "adam_ref"):
        result, model = _diet(graphs[key], tmp_path / f"{key}.meta")
        graph = model.graph
        flow = split(graph).gradient_flow
        kernel = "mlp/dense_1/kernel"
        forward = "mlp/dense_1/MatMul"
        backward = [u for u in flow if graph.op(u) == "MatMul"
                    and "dense_1/MatMul_grad" in u and not u.endswith("MatMul_1")]
        assert len(backward) == 1, backward
        fwd_weight = graph.data_inputs(forward)[1].node
        bwd_weight = graph.data_inputs(backward[0])[1].node
        assert fwd_weight != bwd_weight and "backward" in bwd_weight
        # the late read waits for a gradient and the update waits for the late read
        upstream, todo = set(), [bwd_weight]
        while todo:
            node = todo.pop()
            upstream.add(node)
            todo.extend(r.node for r in graph.data_inputs(node) if r.node != kernel)
        late = [n for n in upstream if graph.control_inputs(n)]
        assert late and all(c in flow for n in late for c in graph.control_inputs(n))
        updates = [u for u, _ in graph.consumers(kernel)
                   if graph.op(u) in ("AssignVariableOp", "Assign") and u in flow]
        assert len(updates) == 1 and late[0] in graph.control_inputs(updates[0])
        assert not graph.check()
        losses, _ = _train(tmp_path / f"{key}.meta", 10)
        assert losses[-1] < losses[0]


@pytest.mark.tf
def test_convolution_kernels_get_a_second_moment_factored_over_kh_kw_cin_by_cout(tmp_path):
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf.compat.v1.placeholder(tf.float32, [8, 8, 8, 16], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [8], name="labels")
        with tf.compat.v1.variable_scope("cnn", use_resource=True):
            h = tf.compat.v1.layers.conv2d(x, 32, 3, padding="same", activation=tf.nn.relu,
                                           name="conv")
            logits = tf.compat.v1.layers.dense(tf.reduce_mean(h, [1, 2]), CLASSES, name="out")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits), name="loss")
        meta = _adam_meta_graph(loss, 1e-3)
    (tmp_path / "cnn.meta").write_bytes(meta.SerializeToString())
    result, model = _diet(tmp_path / "cnn.meta", tmp_path / "out.meta")
    assert result.results["diet"].dieted == ["cnn/conv/kernel"]
    graph = model.graph

    def dims(name):
        return [d.size for d in graph.node_def(name).attr["shape"].shape.dim]

    assert dims("cnn/conv/kernel/diet_rows") == [3 * 3 * 16, 1]
    assert dims("cnn/conv/kernel/diet_cols") == [1, 32]
    assert "cnn/conv/kernel/Adam_1" not in graph and not graph.check()
    # the gradient's ShapeN no longer reads (and holds) the float32 kernel: a constant instead
    shape_n = [n for n in graph.nodes() if graph.op(n) == "ShapeN" and "conv/Conv2D_grad" in n]
    assert shape_n and all(len(graph.data_inputs(n)) == 1 for n in shape_n)
    filter_sizes = graph.data_inputs(next(n for n in graph.nodes()
                                          if graph.op(n) == "Conv2DBackpropFilter"))[1]
    assert graph.op(filter_sizes.node) == "Const"
    rng = np.random.RandomState(0)
    feed = {"x:0": rng.standard_normal([8, 8, 8, 16]).astype(np.float32),
            "labels:0": rng.randint(0, CLASSES, 8).astype(np.int32)}
    with tf.Graph().as_default() as imported:
        tf.compat.v1.train.import_meta_graph(str(tmp_path / "out.meta"))
        with tf.compat.v1.Session(graph=imported) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            losses = [session.run(["loss:0", imported.get_collection("train_op")[0]],
                                  feed)[0] for _ in range(15)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def _embedding_step_tf1(path, optimizer=None):
    """tf.compat.v1 Adam (or `optimizer`) on a 500x32 embedding (a sparse gradient) and a 32x4
    readout."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(2)
        tokens = tf.compat.v1.placeholder(tf.int32, [BATCH, 8], name="tokens")
        y = tf.compat.v1.placeholder(tf.int32, [BATCH], name="labels")
        with tf.compat.v1.variable_scope("m", use_resource=True):
            table = tf.compat.v1.get_variable("embeddings", [500, 32])
            pooled = tf.reduce_mean(tf.nn.embedding_lookup(table, tokens), 1)
            logits = tf.compat.v1.layers.dense(pooled, CLASSES, name="out")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits), name="loss")
        meta = _adam_meta_graph(loss, 1e-2, optimizer)
    path.write_bytes(meta.SerializeToString())
    return path


@pytest.mark.tf
def test_a_sparse_update_diet_does_not_read_is_named_as_one(tmp_path):
    """RMSProp's sparse update of an embedding (a masked LSTM step built outside the repo):
    the warning said only that its handle is also used by ResourceSparseApplyRMSProp."""
    import tensorflow as tf

    path = _embedding_step_tf1(tmp_path / "emb.meta", tf.compat.v1.train.RMSPropOptimizer)
    kept = _diet(path, tmp_path / "diet.meta")[0].results["diet"].kept_float
    reason = next(r for r, names in kept.items() if "m/embeddings" in names)
    assert "a sparse update of some rows" in reason, kept


@pytest.mark.tf
def test_sparse_adam_of_an_embedding_is_dieted_and_trains(tmp_path):
    import tensorflow as tf

    path = _embedding_step_tf1(tmp_path / "emb.meta")
    result, model = _diet(path, tmp_path / "diet.meta")
    facts = result.results["diet"]
    assert facts.dieted == ["m/embeddings"] and not facts.kept_float.get("m/embeddings")
    graph = model.graph
    assert "m/embeddings/Adam" not in graph and "m/embeddings/Adam_1" not in graph
    assert not [n for n in graph.nodes() if graph.op(n) == "ResourceScatterAdd"]
    assert not graph.check()
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 500, [BATCH, 8]).astype(np.int32)
    tokens[:, 0] = np.arange(BATCH) % 100  # repeated ids: the gradient's rows sum per id
    labels = (tokens[:, 0] % CLASSES).astype(np.int32)
    curves = []
    for meta in (path, tmp_path / "diet.meta"):
        with tf.Graph().as_default() as imported:
            tf.compat.v1.train.import_meta_graph(str(meta))
            with tf.compat.v1.Session(graph=imported) as session:
                session.run(tf.compat.v1.global_variables_initializer())
                curves.append([session.run(["loss:0", imported.get_collection("train_op")[0]],
                                           {"tokens:0": tokens, "labels:0": labels})[0]
                               for _ in range(30)])
    original, dieted = curves
    assert dieted[-1] < 0.5 * dieted[0]
    # SM3's cover holds a row's largest entry for all of it: slower here (0.54 against 0.32)
    assert abs(dieted[-1] - original[-1]) <= 0.2 * original[0], (original[-1], dieted[-1])


@pytest.mark.tf
@pytest.mark.parametrize("key,slot", [("adam_resource", "Adam"), ("adam_ref", "Adam"),
                                      ("momentum_resource", "Momentum"),
                                      ("momentum_ref", "Momentum"),
                                      ("rmspropmomentum_resource", "RMSProp_1")])
def test_a_bfloat16_first_moment_replaces_the_float32_one_and_trains_as_kept(graphs, tmp_path,
                                                                             key, slot):
    from tensorflow.core.framework import types_pb2

    kernel = "mlp/dense_1/kernel"
    _, model = _diet(graphs[key], tmp_path / "half.meta", "diet(momentum=bfloat16)")
    new = [n for n in model.graph.nodes() if n.startswith(kernel + "/diet_")
           and model.graph.op(n) in ("VarHandleOp", "VariableV2")
           and model.graph.node_def(n).attr["dtype"].type == types_pb2.DT_BFLOAT16]
    assert len(new) == 1 and f"{kernel}/{slot}" not in model.graph
    if slot == "Adam":  # the first moment's update waits for the factored second moment's
        import networkx as nx

        graph = model.graph
        ends = {e: [n for n in graph.nodes() if kernel in n and n.endswith(e)]
                for e in ("/second", "/first_old", "/first_taken")}
        assert all(len(found) == 1 for found in ends.values()), ends
        for later in ("/first_old", "/first_taken"):
            assert nx.has_path(graph.nx, ends["/second"][0], ends[later][0])
    import tensorflow as tf

    _train(tmp_path / "half.meta", 2, checkpoint=tmp_path / "ckpt")  # the Saver keeps it
    assert tf.train.load_checkpoint(str(tmp_path / "ckpt")).get_variable_to_dtype_map()[
        new[0]] == tf.bfloat16
    _diet(graphs[key], tmp_path / "keep.meta", "diet(momentum=keep)")
    _diet(graphs[key], tmp_path / "drop.meta", "diet")
    original, _ = _train(graphs[key], 50)
    half, _ = _train(tmp_path / "half.meta", 50)
    keep, _ = _train(tmp_path / "keep.meta", 50)
    drop, _ = _train(tmp_path / "drop.meta", 50)
    print(key, original[-1], keep[-1], half[-1], drop[-1])
    # 16 bits of momentum train as 32 do: closer to the kept moment than dropping it is, or
    # within 1% of it where dropping it changes as little (Adam here, with SM3's cover: the
    # three end within 0.1% of each other)
    assert abs(half[-1] - keep[-1]) < max(0.25 * abs(drop[-1] - keep[-1]), 0.01 * keep[-1]), \
        (keep[-1], half[-1], drop[-1])


@pytest.mark.tf
@pytest.mark.parametrize("optimizer,lr", [("adam", 2e-3), ("momentum", 0.05),
                                         ("nesterov", 0.05), ("lion", 2e-3)])
def test_tf2_keras_steps_take_a_bfloat16_first_moment(tmp_path, optimizer, lr):
    from graphrewrite.analysis import bind

    *_, graph_def = _keras_step(optimizer, lr)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    original = io.load(tmp_path / "step.pb")
    losses = {}
    for momentum in ("keep", "bfloat16", "drop"):
        _, model = _diet(tmp_path / "step.pb", tmp_path / f"{momentum}.pb",
                         f"diet(momentum={momentum})")
        added = [n for n in bind.resource_placeholders(model.graph) if n not in original.graph]
        assert any(n.endswith(("/diet_first", "/diet_momentum")) for n in added) == (
            momentum == "bfloat16")
        losses[momentum] = _tf2_losses(model, 30)[-1]
    print(optimizer, losses)
    assert abs(losses["bfloat16"] - losses["keep"]) < 0.25 * abs(losses["drop"] - losses["keep"])


@pytest.mark.tf
@pytest.mark.parametrize("key, warned", [("momentum_resource", True), ("rmsprop_resource", False),
                                         ("rmspropmomentum_resource", True)])
def test_sgd_momentum_is_kept_in_bfloat16_unless_dropped_and_warned_of(graphs, tmp_path, caplog,
                                                                         key, warned):
    """Dropped, SGD momentum steps by lr / (1 - momentum): a CNN at lr 0.1 and momentum 0.9
    stopped learning, a TF1 ResNet-50 at lr 0.01 went from 6.7 to 68 in two steps. The default
    keeps it in bfloat16; `momentum=drop` drops it and warns. RMSProp's default momentum 0
    loses nothing."""
    with caplog.at_level("WARNING", logger="graphrewrite.passes.diet"):
        _diet(graphs[key], tmp_path / "drop.meta", "diet(momentum=drop)")
    said = [r.getMessage() for r in caplog.records if "take momentum" in r.getMessage()]
    assert bool(said) == warned
    if said:  # named by the optimizer it comes from (RMSProp's was called SGD momentum)
        assert ("RMSProp's" in said[0]) == key.startswith("rmsprop"), said
    caplog.clear()
    with caplog.at_level("WARNING", logger="graphrewrite.passes.diet"):
        result, _ = _diet(graphs[key], tmp_path / "diet.meta")
    assert not [r for r in caplog.records if "take momentum" in r.getMessage()]
    added = result.results["diet"].slots_added
    assert any(n.endswith("/diet_momentum") for n in added) == warned, added


@pytest.mark.tf
@pytest.mark.tf
def test_keras_adams_lean_step_is_clipped_too(tmp_path):
    """Keras's Adam keeps its rate as `lr * sqrt(1 - beta_2_power) / (1 - beta_1_power)`: the
    learning rate the clip compares the step with is read from it."""
    *_, graph_def = _keras_step("adam", 1e-3)
    (tmp_path / "step.pb").write_bytes(graph_def.SerializeToString())
    original = io.load(tmp_path / "step.pb")
    adams = [u for u in optimizers.updates(original.graph) if u.kind == "adam"]
    assert adams and all(original.graph.op(u.terms["lr"].node) != "Sqrt" for u in adams)
    result, model = _diet(tmp_path / "step.pb", tmp_path / "diet.pb")
    assert len(result.results["diet"].dieted) == 1  # the 32x128 kernel
    assert len([n for n in model.graph.nodes() if n.endswith("/rate_clipped")]) == 1


def _loss_after(path, steps: int) -> float:
    """A TF1 MetaGraphDef's `loss:0` after `steps - 1` runs of its train op, from its init."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.import_meta_graph(str(path))
        train_op = tf.compat.v1.get_collection("train_op")[0]
        loss = graph.get_tensor_by_name("loss:0")
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for _ in range(steps - 1):  # the loss read apart: beside the update it races
                session.run(train_op)
            return session.run(loss)


def _linear_step(tmp_path, gradient: np.ndarray, optimizer):
    """A TF1 step of `loss = sum(w * gradient)` over a [64, 64] resource weight starting at 0,
    whose gradient is that constant, minimized by `optimizer`; its MetaGraphDef's path."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        weight = tf.compat.v1.get_variable("w", [64, 64], initializer=tf.zeros_initializer(),
                                           use_resource=True)
        loss = tf.reduce_sum(weight * gradient, name="loss")
        tf.compat.v1.add_to_collection("train_op", optimizer().minimize(loss))
        tf.compat.v1.add_to_collection("losses", loss)
        meta = tf.compat.v1.train.export_meta_graph()
    path = tmp_path / "linear.meta"
    path.write_bytes(meta.SerializeToString())
    return path


@pytest.mark.tf
def test_without_a_first_moment_a_step_is_clipped_as_adafactor_clips_it(tmp_path):
    """A gradient far from rank 1 (one large entry, the rest 1e-3): the factored second moment
    of the small entries is the product of small row and column means, so their step was 16
    times Adam's (a TF2 deep MLP built outside the repo diverged after 37 steps). Clipped to
    a root mean square of the learning rate, the first step lowers the loss about as Adam's."""
    import tensorflow as tf

    gradient = np.full((64, 64), 1e-3, np.float32)
    gradient[0, 0] = 1.0
    path = _linear_step(tmp_path, gradient, lambda: tf.compat.v1.train.AdamOptimizer(0.01))
    result, _ = _diet(path, tmp_path / "diet.meta", "diet(format=bfloat16, rounding=nearest)")
    assert result.results["diet"].dieted == ["w"]
    original, dieted = _loss_after(path, 2), _loss_after(tmp_path / "diet.meta", 2)
    assert original == pytest.approx(-0.01 * gradient.sum(), rel=1e-3)  # Adam: lr * sign
    assert original * 1.5 < dieted < original * 0.5  # unclipped: 12 times as low


def test_a_factored_second_moment_of_gradients_all_zero_so_far_is_zero_not_nan(tmp_path):
    """A stochastic-depth ResNet (built outside the repo) drops residual branches at random:
    a dropped branch's kernels get a gradient of 0, and their factored second moment was
    0 * 0 / 0. The NaN, stored in 16 bits, became a large weight (its loss: 9 -> 2210)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        weight = tf.compat.v1.get_variable("w", [64, 64], initializer=tf.zeros_initializer(),
                                           use_resource=True)
        step = tf.compat.v1.train.get_or_create_global_step()
        kept = tf.cast(step >= 1, tf.float32)  # the branch is dropped in the first step
        loss = tf.reduce_sum(weight * kept, name="loss")  # its gradient: rank 1, as factored
        train = tf.compat.v1.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
        tf.compat.v1.add_to_collection("train_op", train)
        tf.compat.v1.add_to_collection("losses", loss)
        meta = tf.compat.v1.train.export_meta_graph()
    path = tmp_path / "dropped.meta"
    path.write_bytes(meta.SerializeToString())
    result, _ = _diet(path, tmp_path / "diet.meta", "diet(momentum=keep)")
    assert result.results["diet"].dieted == ["w"]
    original, dieted = _loss_after(path, 3), _loss_after(tmp_path / "diet.meta", 3)
    adam_step = 0.01 * (0.1 / (1 - 0.9 ** 2)) / np.sqrt(0.001 / (1 - 0.999 ** 2))  # at t = 2
    assert original == pytest.approx(-adam_step * 64 * 64, rel=1e-3)
    assert dieted == pytest.approx(original, rel=0.01)
