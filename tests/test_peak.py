"""What holds the modelled peak, and the note that says why a rewrite saved little."""

import dataclasses
import sys

import pytest

from graphrewrite.analysis import optimizers
from graphrewrite.analysis import step as analysis
from graphrewrite.analysis.memory import DEVICE, STATE
from graphrewrite.core import io
from graphrewrite.passes import recompute
from graphrewrite.planning import peak
from graphrewrite.planning.context import Context

from conftest import FIXTURES, fixture_path


def context(name: str) -> Context:
    model = io.load(fixture_path(name))
    return Context.build(model.graph, analysis.analyse(model))


def test_the_parts_add_up_to_what_is_live_at_the_peak():
    ctx = context("rnn_while_v2")
    parts = peak.composition(ctx, ctx.analysis.memory)
    assert sum(parts.values()) == sum(size for _, size in
                                      ctx.analysis.memory.live_at_peak[DEVICE])
    assert parts[peak.CALLS] == max(parts.values())  # the loop's accumulators


def test_an_rnn_left_alone_says_its_loop_holds_the_peak():
    model = io.load(fixture_path("rnn_while_v2"))
    result = recompute.run(model.graph, analysis.analyse(model), recompute.RecomputeOptions())
    assert not result.modified
    assert "while loops and function calls" in result.note and "%" in result.note


def test_parameter_state_at_the_peak_points_to_diet():
    ctx = context("mlp")
    report = ctx.analysis.memory
    state = {ref for ref, _ in report.live_at_peak[DEVICE]
             if ref.node in ctx.parameters or ref.node in ctx.constant}
    assert state  # the frozen MLP's weights are live at its peak
    only_state = type(report)(**{**report.__dict__, "live_at_peak": {
        DEVICE: [(ref, size) for ref, size in report.live_at_peak[DEVICE] if ref in state]}})
    assert "--mode diet stores" in peak.why_so_little(ctx, only_state)  # its constants


def test_parameter_state_of_an_optimizer_diet_does_not_read_says_so(tmp_path):
    """An RNN with Adadelta (built outside the repo) was pointed to --mode diet, which did
    nothing: it reads Adam's, momentum's, RMSProp's, Adagrad's and SGD's updates only."""
    import tensorflow as tf

    from tfgraphs import build

    def step():
        x = tf.compat.v1.placeholder(tf.float32, [8, 256], name="x")
        w = tf.compat.v1.get_variable("w", [256, 256])
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        tf.compat.v1.train.AdadeltaOptimizer(0.1).minimize(loss, name="train")

    ctx, note = _note_if_state_held_the_peak(build(step), tmp_path)
    assert not optimizers.updates(ctx.graph)
    assert "diet reads no update here" in note and "diet stores" not in note
    assert "written by ResourceApplyAdadelta" in note, note


@pytest.mark.tf
def test_parameter_state_updated_inside_a_loss_scale_cond_says_so(tmp_path):
    """A mixed-precision Keras ResNet-50 under a LossScaleOptimizer (built outside the repo):
    its updates run in an `If`'s branch, which diet does not read; the note named only the
    optimizers diet reads."""
    sys.path.insert(0, str(FIXTURES))
    import recipes

    entry = recipes.ensure("tf2_cnn_lso_bn")
    _, note = _note_if_state_held_the_peak(io.load(entry["path"]).graph, tmp_path)
    assert "written inside If" in note and "LossScaleOptimizer" in note, note


def _note_if_state_held_the_peak(graph, tmp_path):
    """(context, why_so_little's note) of `graph` with only its variables live at its peak."""
    path = tmp_path / "step.pb"
    path.write_bytes(graph.to_graph_def().SerializeToString())
    model = io.load(path)
    ctx = Context.build(model.graph, analysis.analyse(model))
    report = ctx.analysis.memory
    state = [(ref, size) for ref, size in report.live_at_peak[DEVICE]
             if report.buffer_of[ref].lifetime == STATE]
    assert state
    only_state = type(report)(**{**report.__dict__, "live_at_peak": {DEVICE: state}})
    return ctx, peak.why_so_little(ctx, only_state)


def test_diet_advice_says_how_much_of_the_variables_it_would_store(tmp_path):
    """A distillation step (built outside the repo) held 7.1 of its 10.2 MiB of variables in a
    frozen teacher diet never touches; the note pointed to diet as if it took them all."""
    import tensorflow as tf

    from tfgraphs import build

    def step():
        x = tf.compat.v1.placeholder(tf.float32, [8, 256], name="x")
        teacher = tf.compat.v1.get_variable("teacher", [256, 1024], trainable=False)
        w = tf.compat.v1.get_variable("w", [256, 64])
        target = tf.stop_gradient(tf.matmul(x, teacher))[:, :64]
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - target))
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss, name="train")

    _, note = _note_if_state_held_the_peak(build(step), tmp_path)
    # w and its two Adam moments: 3 x 64 KiB of 1 MiB + 192 KiB (and two scalars)
    assert "in 16 bits (lossy): 0.2 of the 1.2 MiB the variables hold" in note
    assert "the rest no update writes" in note


def test_diet_advice_names_the_sparse_updates_it_leaves(tmp_path):
    """A sampled-softmax language model (built outside the repo) trains its embedding and
    output weights by `ResourceSparseApplyAdagrad`: the note called them weights no update
    writes, "the step does not train"."""
    import tensorflow as tf

    from tfgraphs import build

    def step():
        ids = tf.compat.v1.placeholder(tf.int32, [8], name="ids")
        table = tf.compat.v1.get_variable("table", [4096, 64], use_resource=True)
        w = tf.compat.v1.get_variable("w", [64, 64], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.embedding_lookup(table, ids), w)))
        tf.compat.v1.train.AdagradOptimizer(0.1).minimize(loss, name="train")

    _, note = _note_if_state_held_the_peak(build(step), tmp_path)
    assert "no update writes" not in note
    assert ("ResourceSparseApplyAdagrad writes 2 variables (2.0 MiB): an update diet does not "
            "rewrite") in note


def test_state_already_dieted_is_not_pointed_to_diet(tmp_path):
    """Recomputation after diet (`--budget --lossy`) read the dieted updates as none and said
    "--mode diet stores ... 0.0 of the 88.1 MiB the variables hold" beside diet's own line."""
    import tensorflow as tf

    from graphrewrite.passes import diet
    from tfgraphs import build

    def step():
        x = tf.compat.v1.placeholder(tf.float32, [8, 256], name="x")
        w = tf.compat.v1.get_variable("w", [256, 256], use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss, name="train")

    graph = build(step)
    model_path = tmp_path / "step.pb"
    model_path.write_bytes(graph.to_graph_def().SerializeToString())
    model = io.load(model_path)
    dieted = diet.run(model.graph, analysis.analyse(model), diet.DietOptions())
    assert dieted.dieted == ["w"]
    _, note = _note_if_state_held_the_peak(dieted.graph, tmp_path)
    assert "diet already stores 1 variables in 16 bits" in note and "--mode diet" not in note


def test_no_candidates_says_why():
    """A step whose loss the analysis could not find (as a Keras train_step's was: the values
    it took for the losses were metrics computed from no activation): the note says so, and
    how to name it."""
    model = io.load(fixture_path("adam_train"))
    found = analysis.analyse(model)
    metric = "beta1_power/Read/ReadVariableOp"  # a value computed from no activation
    blind = dataclasses.replace(found, fetches=["train_op", metric], split=dataclasses.replace(
        found.split, differentiated=(), losses=(metric,)))
    result = recompute.run(model.graph, blind, recompute.RecomputeOptions(policy="memory"))
    assert not result.modified
    assert result.note.startswith("no checkpoint candidates found: no loss found"), result.note
    assert "--outputs" in result.note


def test_a_value_computed_from_a_weight_alone_is_not_the_variables_state(tmp_path):
    """A capsule network (built outside the repo) tiles a weight over the batch: 45 MiB of its
    153, computed from the weight alone. The note counted it among the parameters and said
    the variables held the peak ("16.1 of the 16.1 MiB"); recomputation lowered it to 0.62x."""
    import tensorflow as tf

    from tfgraphs import build

    def step():
        x = tf.compat.v1.placeholder(tf.float32, [64, 256, 1], name="x")
        w = tf.compat.v1.get_variable("w", [1, 256, 256], use_resource=True)
        loss = tf.reduce_mean(tf.matmul(tf.tile(w, [64, 1, 1]), x))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")

    path = tmp_path / "step.pb"
    path.write_bytes(build(step).to_graph_def().SerializeToString())
    model = io.load(path)
    ctx = Context.build(model.graph, analysis.analyse(model))
    tiled = next(n for n in ctx.graph.nodes() if ctx.graph.op(n) == "Tile")
    assert tiled in ctx.parameters  # computed from the weight alone
    report = ctx.analysis.memory
    live = dict(report.live_at_peak[DEVICE])
    assert any(ref.node == tiled for ref in live)
    parts = peak.composition(ctx, report)
    assert parts[peak.STATE] < 2**20 < parts[peak.ACTIVATIONS]  # the weight is 256 KiB


def test_backward_values_at_the_peak_are_named_by_the_largest_live_one(tmp_path):
    """A deep MLP built outside the repo (batch 256, 12 x 1024, activations 0% of its peak)
    was told "the backward pass's own values hold it (e.g. the logits' gradient)": 10 KiB,
    where its weights' gradients, 4 MiB each, waited for the optimizer. The note now names
    the largest backward value live at the peak, and diet beside it where variables weigh."""
    import tensorflow as tf

    from tfgraphs import build

    def step():
        x = tf.compat.v1.placeholder(tf.float32, [2, 512], name="x")
        h = x
        for i in range(3):
            w = tf.compat.v1.get_variable(f"w{i}", [512, 512])
            h = tf.nn.relu(tf.matmul(h, w) + tf.compat.v1.get_variable(f"b{i}", [512]))
        loss = tf.reduce_mean(tf.square(h))
        tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train")

    path = tmp_path / "step.pb"
    path.write_bytes(build(step).to_graph_def().SerializeToString())
    model = io.load(path)
    ctx = Context.build(model.graph, analysis.analyse(model))
    report = ctx.analysis.memory
    backward = [(ref, size) for ref, size in report.live_at_peak[DEVICE]
                if ref.node not in ctx.analysis.split.forward
                and report.buffer_of[ref].lifetime != STATE]
    assert backward
    largest = max(backward, key=lambda item: item[1])[0]
    state = [min(((ref, size) for ref, size in report.live_at_peak[DEVICE]
                  if report.buffer_of[ref].lifetime == STATE), key=lambda item: item[1])]
    held = type(report)(**{**report.__dict__, "live_at_peak": {DEVICE: backward + state}})
    note = peak.why_so_little(ctx, held)
    assert f"(the largest: {largest}, " in note and "logits" not in note
    assert "beside them the variables: --mode diet stores" in note


def test_a_note_over_tensors_only_the_data_sizes_says_it_leaves_them_out():
    """A mixture of experts built outside the repo: 190 tensors after the experts' `Where`
    counted 0 bytes (43% of its measured peak), and the note's shares, without them, sent the
    user to diet, which raised the peak."""
    ctx = context("rnn_while_v2")
    assert not ctx.analysis.sized_by_data
    plain = peak.why_so_little(ctx, ctx.analysis.memory)
    assert "only the data decides" not in plain
    ctx.analysis = dataclasses.replace(ctx.analysis, sized_by_data=("Where", "GatherV2"))
    note = peak.why_so_little(ctx, ctx.analysis.memory)
    assert note.startswith("2 tensors whose size only the data decides") and note.endswith(plain)
