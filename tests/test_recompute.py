"""Recompute rewriting: invariants over every fixture and mode, policies, and selectors."""

import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2

from graphrewrite.analysis import memory
from graphrewrite.analysis.split import split
from graphrewrite.core import io, ops, selectors
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.core.names import (ACCUMULATE_SUFFIX, AHEAD_SUFFIX, COPY_SUFFIX, LOOP_PREFIX,
                                     PAD_PREFIX, TRIGGER_PREFIX, copied_from)
from graphrewrite.passes.accumulate import SUMMING_OPS
from graphrewrite.passes.loop_recompute import LoopRecomputeResult
from graphrewrite.passes.recompute import RecomputeResult
from graphrewrite.passes.recompute.rewrite import SHAPE_READERS
from graphrewrite.pipeline import run as pipeline
from graphrewrite.planning import search

from conftest import FIXTURE_NAMES, fixture_path
from tfgraphs import build

MODES = ["memory", "speed", "manual"]


def rewrite(name, mode, **options):
    model = io.load(fixture_path(name))
    return model, pipeline.optimize(model, mode, **options)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_invariants(name, mode):
    model, result = rewrite(name, mode)
    before, after = model.graph, result.graph
    assert after.check() == []
    # No original node lost, renamed or changed (only inputs of backward readers move), but an
    # empty list made to carry another value in a loop (its element shape opened), and a loop
    # run one iteration at a time.
    for node in before.nodes():
        assert node in after
        if after.node_def(node) != before.node_def(node):
            if before.op(node) in SUMMING_OPS and after.op(node) == "AddV2":  # accumulated
                continue
            if after.op(node) == "EmptyTensorList":
                assert after.node_def(node).input[0].startswith(LOOP_PREFIX)
                continue
            same = node_def_pb2.NodeDef()
            same.CopyFrom(after.node_def(node))
            assert same.attr["parallel_iterations"].i == 1, node
            same.attr["parallel_iterations"].i = before.node_def(node).attr[
                "parallel_iterations"].i
            assert same == before.node_def(node), node
    added = [n for n in after.nodes() if n not in before]
    for node in added:
        if node.startswith(LOOP_PREFIX):  # an open element shape
            assert after.op(node) == "Const" and all(
                after.op(reader) == "EmptyTensorList" for reader in after.successors(node))
            continue
        if ACCUMULATE_SUFFIX in node:  # a running sum's link, or its guard
            assert after.op(node) in ("AddV2", "NoOp"), node
            continue
        assert copied_from(node) or node.endswith(AHEAD_SUFFIX) or node.startswith(
            (TRIGGER_PREFIX, PAD_PREFIX)), node  # ahead: a checkpoint computed again
        if node.startswith(TRIGGER_PREFIX):
            assert after.op(node) == "NoOp"
            continue
        if node.startswith(PAD_PREFIX):  # read by nobody: Grappler keeps it, the session prunes it
            assert after.op(node) in ("IdentityN", "Pack") and not after.successors(node)
            assert after.node_def(node).attr["_grappler_do_not_remove"].b
            continue
        op = after.op(node)
        assert not ops.is_stateful(op) and "Random" not in op, f"{node} copies a {op}"
    # Copies feed only the backward pass (and each other): the forward is untouched. Besides the
    # gradient flow, the backward's values of forward values alone read them (a tanh-GELU's
    # `x ** 2`), but its shape readers (a convolution gradient's ShapeN) only when they wait on
    # control inputs.
    found = split(before)
    for node in added:
        for reader in after.successors(node) if not node.startswith(LOOP_PREFIX) else ():
            assert reader in found.gradient_flow or reader in added or (
                reader in found.backward and (after.op(reader) not in SHAPE_READERS
                                              or after.control_inputs(reader))), (node, reader)
    recomputed = result.of(RecomputeResult).recomputed
    in_loops = result.of(LoopRecomputeResult).recomputed_loops
    assert (result.nodes_after > result.nodes_before) == bool(recomputed or in_loops)
    if added:
        assert result.peak_after < result.peak_before


@pytest.mark.parametrize("name", ["resnet_cnn", "mlp"])
def test_rewriting_twice_is_harmless(name, tmp_path):
    model, first = rewrite(name, "memory")
    path = tmp_path / fixture_path(name).name
    io.save(model, first.graph, path)
    second = pipeline.optimize(io.load(path), "memory")
    assert second.graph.check() == []
    assert second.peak_after <= first.peak_after * 1.01


def test_mode_none_and_unhinted_manual_change_nothing():
    for mode in ("none", "manual"):
        model, result = rewrite("resnet_cnn", mode)
        assert result.graph.to_graph_def() == model.graph.to_graph_def()


def test_random_ops_are_never_copied():
    model, result = rewrite("transformer_dropout", "speed")
    randoms = {n for n in model.graph.nodes() if "Random" in model.graph.op(n)}
    assert randoms
    copied = {copied_from(n) for n in result.graph.nodes()} - {None}
    assert copied and not copied & randoms
    kept = result.of(RecomputeResult).kept_because
    assert "random op" in kept or "a smaller form of a random draw" in kept


def test_loops_come_back_unchanged_or_sound():
    for name in ("rnn_while_v1", "rnn_while_v2"):
        model, result = rewrite(name, "speed")
        assert result.graph.check() == []
        frames = [n for n in result.graph.nodes() if copied_from(n)
                  and model.graph.op(copied_from(n)) in ("Enter", "Merge", "Switch")]
        assert frames == []


def test_triggers_wait_on_the_gradient_flow():
    model, result = rewrite("resnet_cnn", "memory")
    flow = split(model.graph).gradient_flow
    triggers = [n for n in result.graph.nodes() if n.startswith(TRIGGER_PREFIX)]
    assert triggers
    for trigger in triggers:
        waits = result.graph.control_inputs(trigger)
        assert waits and all(w in flow for w in waits)
        gated = [v for v, _ in result.graph.consumers(trigger)]
        assert gated and all(copied_from(g) for g in gated)


def test_triggers_wait_past_the_identities_a_tuple_adds():
    """A TF1 optimizer gates gradients with tf.tuple: the flow reads control_dependency
    Identities. A trigger reading one would keep it from Grappler's dependency optimizer (which
    counts its readers), so triggers wait on the node it forwards instead (issue 14)."""
    model, result = rewrite("keras_train", "speed")
    triggers = [n for n in result.graph.nodes() if n.startswith(TRIGGER_PREFIX)]
    identities = [n for n in model.graph.nodes() if model.graph.op(n) == "Identity"
                  and "tuple/control_dependency" in n]
    waits = {w for t in triggers for w in result.graph.control_inputs(t)}
    assert triggers and identities and waits
    assert not [w for w in waits if result.graph.op(w) in ("Identity", "IdentityN")]


def test_copies_sort_among_their_readers_inputs_as_the_originals():
    """Grappler sorts the inputs of commutative ops by name before grouping products; a copy
    must take its original's place in that order (issue 14)."""
    for name, mode in (("keras_train", "memory"), ("transformer_dropout", "speed")):
        model, result = rewrite(name, mode)
        graph, checked = result.graph, 0
        for node in graph.nodes():
            if graph.op(node) not in ("Mul", "AddV2", "AddN") or node not in model.graph:
                continue
            inputs = [str(r) for r in graph.data_inputs(node)]
            originals = [str(r) for r in model.graph.data_inputs(node)]
            if inputs != originals:
                checked += 1
                by_name = sorted(range(len(inputs)), key=inputs.__getitem__)
                assert by_name == sorted(range(len(originals)), key=originals.__getitem__), node
        assert checked, name


def test_speed_keeps_expensive_ops():
    model, result = rewrite("resnet_cnn", "speed")
    kept = set(result.of(RecomputeResult).checkpoints)
    convs = {n for n in model.graph.nodes() if model.graph.op(n) == "Conv2D"}
    assert kept == convs | {"logits/MatMul"}
    assert not any(copied_from(n) in convs for n in result.graph.nodes())


def test_collection_mode_uses_selectors():
    model, result = rewrite("resnet_cnn", "collection", checkpoints="op:Relu")
    relus = {n for n in model.graph.nodes() if model.graph.op(n) == "Relu"}
    assert set(result.of(RecomputeResult).checkpoints) == relus
    with pytest.raises(GraphRewriteError, match="needs checkpoints"):
        rewrite("resnet_cnn", "collection")


def test_collection_mode_reads_the_metagraph_collection(tmp_path):
    model = io.load(fixture_path("adam_train"))
    meta = model.container
    meta.collection_def["checkpoints"].node_list.value.append("dense_0/Relu:0")
    result = pipeline.optimize(model, "collection")
    assert result.of(RecomputeResult).checkpoints in ([], ["dense_0/Relu"])


def test_manual_mode_honours_recompute_hint():
    model = io.load(fixture_path("resnet_cnn"))
    hinted = [n for n in model.graph.nodes() if model.graph.op(n) == "Relu"][:3]
    for name in hinted:
        value = tf.compat.v1.AttrValue(b=True)
        model.graph.set_attr(name, "_recompute_hint", value)
    result = pipeline.optimize(model, "manual")
    copied = {copied_from(n) for n in result.graph.nodes()} - {None}
    assert copied == set(hinted)


def test_memory_policy_finds_bottlenecks_past_a_label_shortcut():
    """Labels reach the loss directly; the chain of layer outputs must still be found."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.planning import checkpoints

    model = io.load(fixture_path("mlp"))
    found = analysis.analyse(model)
    chain = checkpoints.bottlenecks(checkpoints.Context.build(model.graph, found))
    assert {"dense_0/Relu", "dense_3/Relu", "dense_5/Relu"} <= set(chain)


def test_bottlenecks_of_a_residual_block_are_its_outputs():
    from graphrewrite.analysis import step as analysis
    from graphrewrite.planning import checkpoints

    def graph():
        x = tf.compat.v1.placeholder(tf.float32, (64, 64), name="x")
        w = tf.constant(np.full((64, 64), 0.01, np.float32), name="w")
        h = x
        for i in range(3):
            inner = tf.nn.relu(tf.matmul(h, w), name=f"inner_{i}")
            h = tf.add(h, tf.matmul(inner, w), name=f"block_{i}")
        loss = tf.reduce_sum(h * h, name="loss")
        tf.compat.v1.gradients(loss, [w])
    g = build(graph)
    model = io.Model(fixture_path("mlp"), io.Format("graphdef"), g.to_graph_def(), g)
    chain = checkpoints.bottlenecks(checkpoints.Context.build(g, analysis.analyse(model, g)))
    assert {"block_0", "block_1", "block_2"} <= set(chain)
    assert not {"inner_0", "inner_1"} & set(chain)  # skipped by the residual path


def test_a_regression_target_as_large_as_the_activations_hides_no_bottleneck():
    """A float target of the activations' size reaches the loss alone: as an entry of the
    forward pass it would make the loss the only bottleneck (nothing to checkpoint)."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.planning import checkpoints

    def graph():
        x = tf.compat.v1.placeholder(tf.float32, (64, 64), name="x")
        y = tf.compat.v1.placeholder(tf.float32, (64, 64), name="y")
        w = tf.constant(np.full((64, 64), 0.01, np.float32), name="w")
        h = x
        for i in range(6):
            h = tf.add(h, tf.nn.relu(tf.matmul(h, w)), name=f"block_{i}")
        loss = tf.reduce_mean(tf.square(h - y), name="loss")
        tf.compat.v1.gradients(loss, [w])
    g = build(graph)
    model = io.Model(fixture_path("mlp"), io.Format("graphdef"), g.to_graph_def(), g)
    chain = checkpoints.bottlenecks(checkpoints.Context.build(g, analysis.analyse(model, g)))
    assert {f"block_{i}" for i in range(5)} <= set(chain)


def test_a_residual_sum_read_only_by_its_relu_is_no_bottleneck():
    """Keeping the sum as well as its ReLU would hold two buffers for one block output."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.planning import checkpoints

    model = io.load(fixture_path("resnet_cnn"))
    chain = checkpoints.bottlenecks(checkpoints.Context.build(model.graph,
                                                              analysis.analyse(model)))
    assert {"block_1/Relu", "block_2/Relu"} <= set(chain)
    assert not any(model.graph.op(n) in ("Add", "AddV2") for n in chain)


def test_budgeted_segments_shrink_towards_the_loss_and_grow_with_held_gradients():
    from graphrewrite.planning.checkpoints import budgeted

    chain = [f"layer{i}" for i in range(30)]
    needed = [8 * (i + 1) for i in range(30)]   # 8 bytes read per layer
    sizes = [8] * 30
    positions = [chain.index(n) for n in budgeted(chain, needed, sizes, [0] * 30, 64)]
    gaps = [b - a for a, b in zip(positions, positions[1:])]
    assert gaps == sorted(gaps, reverse=True) and gaps[0] > gaps[-1]
    heavy = [chain.index(n) for n in budgeted(chain, needed, sizes, [24] * 30, 64)]
    assert heavy[0] < positions[0]  # gradients held above the first segment shorten it


def test_two_level_recomputes_ahead_below_the_cut_and_holds_the_rest():
    from graphrewrite.analysis import step as analysis
    from graphrewrite.planning import checkpoints

    model = io.load(fixture_path("resnet_cnn"))
    ctx = checkpoints.Context.build(model.graph, analysis.analyse(model))
    position = {n: i for i, n in enumerate(checkpoints.bottlenecks(ctx))}
    kept, ahead = checkpoints.two_level(ctx, 0.5, 0.1)
    held = kept - ahead
    assert ahead and held and ahead < kept and kept <= set(position)
    assert max(map(position.get, ahead)) < min(map(position.get, held))
    assert not checkpoints.two_level(ctx, 0.0, 0.1)[1]  # no cut below the first: single-level
    assert len(checkpoints.two_level(ctx, 0.5, 0.2)[0]) < len(kept)  # a larger budget, fewer


@pytest.mark.parametrize("text, expected", [
    ("block_1/Relu", {"block_1/Relu"}),
    ("block_1/Relu:0", {"block_1/Relu"}),
    ("scope:block_2/conv_bn_a", None),
    ("regex:^stem/", None),
    ("op:Conv2D", None),
])
def test_selectors(text, expected):
    graph = io.load(fixture_path("resnet_cnn")).graph
    chosen = set(selectors.select(graph, text))
    if expected is not None:
        assert chosen == expected
    kind, _, value = text.partition(":")
    if kind == "scope":
        assert chosen and all(n.startswith(value + "/") or n == value for n in chosen)
    elif kind == "regex":
        assert chosen and all(n.startswith("stem/") for n in chosen)
    elif kind == "op":
        assert chosen == {n for n in graph.nodes() if graph.op(n) == "Conv2D"}


@pytest.mark.parametrize("text, message", [
    ("nope", "not in the graph"), ("regex:(", "bad regular expression"), ("scope:", "missing"),
])
def test_selectors_refuse(text, message):
    graph = io.load(fixture_path("resnet_cnn")).graph
    with pytest.raises(GraphRewriteError, match=message):
        selectors.select(graph, text)


def every_other_bottleneck(name="resnet_cnn"):
    """The model, its analysis, the planners' context and every other bottleneck of it."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.planning import checkpoints

    model = io.load(fixture_path(name))
    found = analysis.analyse(model)
    ctx = checkpoints.Context.build(model.graph, found)
    return model, found, ctx, [n for n in checkpoints.bottlenecks(ctx)][1::2]


def ahead_rewrite(name="resnet_cnn", first=2):
    """The memory policy's checkpoints with the first `first` of them recomputed ahead."""
    from graphrewrite.passes import recompute

    model, found, ctx, kept = every_other_bottleneck(name)
    rewrite = recompute.apply(ctx, set(kept), frozenset(kept[:first]))
    rewrite.pads = recompute.pad_readers(rewrite.graph, model.graph, found,
                                         {c: o for o, c in rewrite.recomputed.items()})
    return model, found, kept[:first], rewrite


def test_checkpoints_recomputed_ahead_are_read_by_the_forward_pass_only():
    from graphrewrite.core.names import AHEAD_SUFFIX, GATE_PREFIX

    model, found, ahead, rewrite = ahead_rewrite()
    graph, flow = rewrite.graph, found.split.gradient_flow
    assert set(rewrite.ahead) >= set(ahead) and graph.check() == []
    for name in ahead:
        readers = {v for v, _ in graph.consumers(name)}
        assert not readers & flow and not readers & set(rewrite.recomputed.values())
        copy = rewrite.ahead[name]
        assert copy == name + AHEAD_SUFFIX and graph.successors(copy)
    roots = [c for c in rewrite.ahead.values()
             if not any(r.node in rewrite.ahead.values() for r in graph.data_inputs(c))]
    gated = [r for r in roots if any(t.startswith(TRIGGER_PREFIX) for t in graph.control_inputs(
        r) + [w for g in graph.data_inputs(r) if g.node.startswith(GATE_PREFIX)
              for w in graph.control_inputs(g.node)])]  # a convolution waits through its gate
    assert roots and gated == roots  # gated, so they run during the backward pass
    assert len(graph.topological_order()) == len(graph)  # no cycle


def test_a_graph_input_is_never_recomputed_ahead():
    """A fed input among the checkpoints chosen to be recomputed ahead (a U-Net's per-pixel
    labels, which the loss's recomputation reads) stays as fed: a copy of a placeholder is a
    second input that nobody feeds, and the step cannot run."""
    from graphrewrite.passes import recompute

    model, _, ctx, kept = every_other_bottleneck()
    inputs = [n for n in model.graph.nodes() if model.graph.op(n) == "Placeholder"]
    assert inputs
    rewrite = recompute.apply(ctx, set(kept) | set(inputs), frozenset(inputs + kept[:2]))
    added = set(rewrite.graph.nodes()) - set(model.graph.nodes())
    assert not [n for n in added if rewrite.graph.op(n) == "Placeholder"]
    assert set(rewrite.ahead) >= set(kept[:2]) and not set(rewrite.ahead) & set(inputs)


@pytest.mark.tf
def test_checkpoints_recomputed_ahead_run_bitwise_equal(tmp_path):
    from graphrewrite.execution import verify

    model, _, _, rewrite = ahead_rewrite()
    path = tmp_path / "ahead.pb"
    io.save(model, rewrite.graph, path)
    outcome = verify.verify(io.load(fixture_path("resnet_cnn")), io.load(path),
                            verify.VerifyOptions(runs=1), isolated=False)
    assert outcome.match and outcome.max_abs_diff == 0.0


def reuse_rewrites():
    """Every other bottleneck of the dropout transformer kept, the first two recomputed ahead,
    applied without and with `reuse`."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.passes import recompute
    from graphrewrite.planning import checkpoints

    model = io.load(fixture_path("transformer_dropout"))
    found = analysis.analyse(model)
    ctx = checkpoints.Context.build(model.graph, found)
    kept = checkpoints.bottlenecks(ctx)[1::2]
    plain = recompute.apply(ctx, set(kept), frozenset(kept[:2]))
    reused = recompute.apply(ctx, set(kept), frozenset(kept[:2]), reuse=True)
    for rewrite in (plain, reused):  # as `recompute.run` pads the plan it chose
        rewrite.pads = recompute.pad_readers(
            rewrite.graph, model.graph, found,
            {c: o for o, c in [*rewrite.recomputed.items(), *rewrite.ahead.items()]})
    return model, found, ctx, plain, reused


def test_reuse_removes_served_copies_that_others_wait_for():
    """Served copies that wait for one another by control edges (a diet pass's dequantization
    waits for the activation its reader multiplies, and copies mirror such waits) are all
    removed, whatever order they are removed in: the waits move to the ahead copies. A copy
    removed before the copy waiting for it was refused (a recompute pass error that came and
    went with the order a set of names iterated in)."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.core.names import COPY_SUFFIX
    from graphrewrite.passes import recompute
    from graphrewrite.planning import checkpoints

    model, _, _, plain, reused = reuse_rewrites()
    served = set(plain.recomputed) & set(plain.ahead) - set(reused.recomputed)
    graph = model.graph
    order = [n for n in graph.topological_order() if n in served]
    for before in order[:-1]:  # each waits on the one after it: the last waits on them all
        graph.add_control(before, order[-1])
    found = analysis.analyse(model)
    ctx = checkpoints.Context.build(graph, found)
    kept = checkpoints.bottlenecks(ctx)[1::2]
    rewrite = recompute.apply(ctx, set(kept), frozenset(kept[:2]), reuse=True)
    assert rewrite.reuse and not any(n + COPY_SUFFIX in rewrite.graph for n in served)
    last = rewrite.ahead[order[-1]]
    assert {rewrite.ahead[n] for n in order[:-1]} <= set(rewrite.graph.control_inputs(last))
    assert rewrite.graph.check() == []


def test_reuse_serves_the_first_segment_from_the_ahead_pass():
    """With reuse, the segment back-propagation reaches first among those the ahead pass
    computes reads the ahead pass's values instead of computing them a third time."""
    _, found, ctx, plain, reused = reuse_rewrites()
    assert reused.reuse and not plain.reuse
    served = set(plain.recomputed) & set(plain.ahead) - set(reused.recomputed)
    assert served
    graph, flow = reused.graph, found.split.gradient_flow
    assert not any(n + COPY_SUFFIX in graph for n in served)
    assert any(v in flow for n in served for v in graph.successors(reused.ahead[n]))
    assert graph.check() == [] and len(graph.topological_order()) == len(graph)
    assert ctx.flops([*reused.recomputed, *reused.ahead]) < \
        ctx.flops([*plain.recomputed, *plain.ahead])


@pytest.mark.tf
def test_reuse_runs_bitwise_equal(tmp_path):
    from graphrewrite.execution import verify

    model, _, _, _, reused = reuse_rewrites()
    path = tmp_path / "reuse.pb"
    io.save(model, reused.graph, path)
    outcome = verify.verify(io.load(fixture_path("transformer_dropout")), io.load(path),
                            verify.VerifyOptions(runs=1), isolated=False)
    assert outcome.match and outcome.max_abs_diff == 0.0


def test_a_too_dear_two_level_plan_is_taken_when_reuse_makes_it_affordable(monkeypatch):

    def plan(peak, flops, reuse=False):
        return search.Rewrite(None, {"a"}, {}, {}, 0, {}, None,
                              ahead_checkpoints=frozenset({"a"}), peak=peak,
                              extra_flops=flops, reuse=reuse)

    single, dear = plan(100, 10), plan(90, 40)  # 10% lower, 30% of the step's FLOPs more
    for reused_peak, taken in ((91, True), (99, False)):
        pricer = types.SimpleNamespace(
            ctx=None, simulate=lambda ctx, c, a, reuse=False: plan(reused_peak, 20, reuse))
        chosen, _ = search.decide([single], [dear], 0, 100, pricer)
        assert (chosen.reuse and chosen.peak == reused_peak) if taken else chosen is single


def test_a_plan_replays_reuse():
    from graphrewrite.pipeline import plan

    decision = {"checkpoints": ["a", "b"], "recomputed_ahead": ["a"], "reuse_ahead": True}
    text = plan.pipeline_of({"pipeline": "recompute(policy=memory)", "recompute": decision})
    assert "reuse=true" in text and 'ahead=a' in text
    del decision["reuse_ahead"]
    assert "reuse" not in plan.pipeline_of({"pipeline": "recompute", "recompute": decision})


def test_a_budget_takes_the_least_recomputation_within_it():
    _, lowest = rewrite("resnet_cnn", "memory")
    budget = (lowest.peak_before + lowest.peak_after) // 2  # halfway: cheaper choices fit
    _, within = rewrite("resnet_cnn", "memory", budget=str(budget))
    assert lowest.peak_after < within.peak_after <= budget
    assert 0 < within.of(RecomputeResult).extra_flops < lowest.of(RecomputeResult).extra_flops
    assert within.of(RecomputeResult).note == ""  # met: no note


def test_a_loose_budget_buys_back_compute_by_keeping_segments_whole():
    _, lowest = rewrite("resnet_cnn", "memory")
    budget = int(lowest.peak_before * 0.9)
    _, loose = rewrite("resnet_cnn", "memory", budget=str(budget))
    assert lowest.peak_after < loose.peak_after <= budget
    cheap, best = loose.of(RecomputeResult), lowest.of(RecomputeResult)
    assert 0 < cheap.extra_flops < best.extra_flops / 2
    assert len(cheap.checkpoints) > len(best.checkpoints)  # what is kept whole is held


def test_an_unreachable_budget_gives_the_lowest_peak_and_says_so():
    _, lowest = rewrite("resnet_cnn", "memory")
    _, result = rewrite("resnet_cnn", "memory", budget="1%")
    assert result.peak_after <= lowest.peak_after
    assert "not reached" in result.of(RecomputeResult).note
    _, met = rewrite("resnet_cnn", "memory", budget="100%")
    unchanged = met.of(RecomputeResult)
    assert not unchanged.recomputed and "already within" in unchanged.note


def test_a_budget_needs_a_mode_that_searches():
    with pytest.raises(GraphRewriteError, match="budget needs mode memory or swap"):
        rewrite("resnet_cnn", "speed", budget="50%")
    with pytest.raises(GraphRewriteError, match="budget 'half'"):
        rewrite("resnet_cnn", "memory", budget="half")


def test_a_batch_norm_read_only_for_its_statistics_is_not_copied():
    _, result = rewrite("resnet_cnn", "memory")
    graph = result.graph
    grads = [n for n in graph.nodes() if graph.op(n) == "FusedBatchNormGradV3"]
    held = copied = 0
    for grad in grads:
        x, statistics = graph.data_inputs(grad)[1], graph.data_inputs(grad)[3:5]
        source = {r.node for r in statistics}
        assert len(source) == 1  # both from the same node, original or copy
        bn = source.pop()
        if copied_from(bn):  # copied anyway (its output feeds a recomputed Relu)
            copied += 1
        elif copied_from(x.node):  # x recomputed, statistics held: no copy of bn
            held += 1
            assert bn + COPY_SUFFIX not in graph
    assert held and copied


@pytest.mark.parametrize("name", ["keras_step_tf2", "cnn_step_tf2"])
def test_a_tf2_steps_returned_loss_is_held_not_run_again(name):
    """A TF2 step returns its scalar loss through an Identity that waits for every update, so
    the backward pass reads it. Copying it saved four bytes and ran the loss again (a chunked
    loss's every projection with it, dequantized weights included)."""
    model, result = rewrite(name, "memory")
    graph = result.graph
    assert result.of(RecomputeResult).recomputed
    returned = [n for n in model.graph.nodes() if model.graph.op(n) == "Identity"
                and model.graph.control_inputs(n)]  # waits for the updates
    assert returned
    for output in returned:
        loss = model.graph.data_inputs(output)[0].node
        assert graph.data_inputs(output)[0].node == loss and loss + COPY_SUFFIX not in graph


@pytest.mark.parametrize("mode", ["memory", "speed"])
def test_a_dropout_mask_is_held_not_its_uniform_draw(mode):
    """Copies read the one-byte mask `GreaterEqual(uniform, rate)`, so the four-byte uniform
    floats die in the forward pass instead of waiting for the backward."""
    model, result = rewrite("keras_train", mode)
    graph = result.graph
    masks = [n for n in model.graph.nodes() if model.graph.op(n) == "GreaterEqual"]
    assert masks
    for mask in masks:
        assert mask + COPY_SUFFIX not in graph
        drawn = graph.data_inputs(mask)[0].node
        assert "Random" in graph.op(drawn)
        assert all(copied_from(v) is None for v, _ in graph.consumers(drawn))
    assert any(copied_from(v) for m in masks for v, _ in graph.consumers(m))


def test_a_graph_deeper_than_pythons_recursion_limit_is_planned(tmp_path):
    """Why a node may not be copied can depend on its inputs' reasons; found for a chain of
    1,200 layers at once, they must not recurse through all of them."""
    def chain():
        h = tf.compat.v1.placeholder(tf.float32, [8, 16], name="x")
        for i in range(1200):
            h = tf.tanh(h, name=f"t{i}")
        tf.gradients(tf.reduce_sum(h), [h.op.inputs[0]], name="gradients")

    path = tmp_path / "deep.pb"
    path.write_bytes(build(chain).to_graph_def().SerializeToString())
    from graphrewrite.analysis import step as analysis
    from graphrewrite.planning.context import Context

    model = io.load(str(path))
    blockers = Context.build(model.graph, analysis.analyse(model)).forward_blockers()
    assert blockers["x"] == "graph input" and blockers["t1199"] is None


def test_a_trusted_estimate_skips_simulations_and_keeps_the_plan(monkeypatch):
    """The mlp fixture's estimates equal its simulated peaks: after the first plans the
    estimate planner stops applying and simulating finalists, and chooses what it chose when
    it simulated them all."""
    (trusted, *plan), (untrusted, *same) = _evaluations(monkeypatch, "TRUST_ERROR",
                                                        (search.TRUST_ERROR, -1.0))  # -1: never
    assert plan == same
    assert search.TRUST_AFTER <= trusted < untrusted


def test_a_huge_graph_trusts_the_estimate_from_the_start(monkeypatch):
    """Above HUGE_NODES nodes the finalists are taken as estimated from the start (the final
    graph's simulation checks the plan): fewer plans are applied and simulated, and the plan is
    the same."""
    # the mlp fixture as it is, then as if it were huge
    (small, *plan), (huge, *same) = _evaluations(monkeypatch, "HUGE_NODES", (10**9, 0))
    assert plan == same
    assert huge < small


def test_a_plan_chosen_on_estimates_its_simulation_refutes_is_planned_again(monkeypatch):
    """The final graph's simulation checks a plan the estimate planner took on trust: when its
    peak is not the estimated one, the pass plans again with every finalist simulated, and
    returns what that careful search chooses."""
    from graphrewrite.passes import recompute

    def optimized():
        return pipeline.optimize(io.load(fixture_path("mlp")), "memory", as_run=False)

    monkeypatch.setattr(search, "TRUST_ERROR", -1.0)  # never trusted: the careful search
    careful = optimized()
    monkeypatch.undo()
    finished, finals = recompute.finish, []

    def refuted_once(ctx, best):
        final = finished(ctx, best)
        if not finals:  # the first plan: its simulated peak made to disagree
            final.report.peak_bytes[memory.DEVICE] *= 2
        finals.append(final)
        return final

    monkeypatch.setattr(recompute, "finish", refuted_once)
    again = optimized()
    assert len(finals) == 2
    assert again.results["recompute"].checkpoints == careful.results["recompute"].checkpoints
    assert again.peak_after == careful.peak_after


def test_the_pipeline_reports_the_step_the_pass_simulated(monkeypatch):
    """The recompute pass simulates its final graph (the check of its plan); the pipeline
    reports that simulation instead of making it again (5 s on a 99k-node graph)."""
    simulate, graphs = memory.simulate, []
    monkeypatch.setattr(memory, "simulate",
                        lambda graph, *a, **k: graphs.append(graph) or simulate(graph, *a, **k))
    result = pipeline.optimize(io.load(fixture_path("mlp")), "memory", as_run=False)
    assert result.results["recompute"].modified
    assert sum(g is result.graph for g in graphs) == 1
    assert result.peak_after == result.results["recompute"].memory.peak()


def test_a_priced_rewrite_leaves_nothing_for_the_cyclic_collector():
    """Each applied and simulated plan is dropped at once (`Graph.drop_views`): nothing of it
    waits for a collection, which took 1.4 s per plan on a 99k-node graph."""
    import gc

    from graphrewrite.analysis import step as analysis
    from graphrewrite.passes import recompute
    from graphrewrite.planning import checkpoints
    from graphrewrite.planning.context import Context

    model = io.load(fixture_path("mlp"))
    ctx = Context.build(model.graph, analysis.analyse(model))
    plan = checkpoints.POLICIES["memory"](ctx)[0]
    recompute.evaluate(ctx, plan)  # first use: fills the context's caches
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        found = recompute.evaluate(ctx, plan)
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
    assert found.peak and found.graph is None


def _evaluations(monkeypatch, constant: str, values) -> list[tuple]:
    """For each value of `search.<constant>`: how many plans the mlp fixture's memory mode
    applied and simulated, its checkpoints and its peak."""
    from graphrewrite.passes import recompute

    evaluate, calls = recompute.evaluate, []
    monkeypatch.setattr(recompute, "evaluate",
                        lambda *a, **k: calls.append(1) or evaluate(*a, **k))
    found = []
    for value in values:
        monkeypatch.setattr(search, constant, value)
        calls.clear()
        result = pipeline.optimize(io.load(fixture_path("mlp")), "memory", as_run=False)
        found.append((len(calls), result.results["recompute"].checkpoints, result.peak_after))
    return found


def test_a_train_op_that_runs_no_gradient_is_named_not_planned(tmp_path):
    """A graph with a backward pass whose train op only counts iterations (a Keras optimizer's
    `minimize` in TF1 graph mode can return that, its updates left outside it): the step runs no
    gradient, and the note says so and what the train op writes, not that nothing could be
    recomputed."""
    from graphrewrite.analysis.step import AnalysisOptions
    from graphrewrite.core.graph import Graph

    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(tf.float32, (256, 64), name="x")
        w = tf.compat.v1.placeholder(tf.float32, (64, 64), name="w")
        h = tf.nn.relu(tf.matmul(tf.nn.relu(tf.matmul(x, w)), w))
        loss = tf.reduce_mean(tf.square(h), name="loss")
        tf.identity(tf.gradients(loss, w)[0], name="unused_grad")
        count = tf.Variable(0, name="iteration")
        step = count.assign_add(1, name="train_op")
    path = tmp_path / "counting.pb"
    path.write_bytes(Graph.from_graph_def(g.as_graph_def(add_shapes=True)).to_graph_def()
                     .SerializeToString())
    model = io.load(path)
    result = pipeline.optimize(model, "memory", AnalysisOptions(fetches=[step.name, "loss"]),
                               as_run=False)
    note = result.of(RecomputeResult).note
    assert not result.changed and note.startswith("the step runs no backward pass"), note
    assert "it writes only iteration" in note
