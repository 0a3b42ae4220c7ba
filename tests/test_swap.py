"""Swap mode: activations to host memory and back, in both forms."""

import json

import pytest
import tensorflow as tf

from graphrewrite.analysis import step as analysis
from graphrewrite.analysis.split import split
from graphrewrite.core import io
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.core.names import SWAP_IN_SUFFIX, SWAP_OUT_SUFFIX
from graphrewrite.core.tensor_ref import TensorRef
from graphrewrite.passes.recompute import RecomputeResult
from graphrewrite.passes.swap import SwapResult
from graphrewrite.pipeline import run as pipeline
from graphrewrite.planning.budget import parse_budget

from conftest import fixture_path, run_cli


def swapped(name="resnet_cnn", budget=None, **options):
    model = io.load(fixture_path(name))
    return model, pipeline.optimize(model, "swap", swap_options=options, budget=budget)


def test_swap_moves_the_peak_to_host_memory():
    model, result = swapped()
    after = analysis.analyse(model, result.graph)
    assert result.peak_after <= 0.6 * result.peak_before
    assert after.memory.peak("host") >= result.of(SwapResult).bytes_moved // 2 > 0
    assert result.graph.check() == []


def test_swap_pairs_rewire_only_the_gradient_flow():
    model, result = swapped()
    graph, flow = result.graph, split(model.graph).gradient_flow
    outs = [n for n in graph.nodes() if n.endswith(SWAP_OUT_SUFFIX)]
    assert outs and len(outs) == len(result.of(SwapResult).swapped)
    for out in outs:
        assert graph.op(out) == "Identity" and graph.node_def(out).device == "/device:CPU:0"
        (swap_in,) = [v for v, _ in graph.consumers(out)]
        assert swap_in.endswith(SWAP_IN_SUFFIX) and graph.node_def(swap_in).device == ""
        assert all(reader in flow for reader, _ in graph.consumers(swap_in))
        assert all(w in flow for w in graph.control_inputs(swap_in))  # its trigger
    for node in model.graph.nodes():  # the forward still reads the originals
        assert result.graph.node_def(node) == model.graph.node_def(node)


def test_budget_swaps_the_fewest_largest_tensors():
    _, everything = swapped()
    _, budgeted = swapped(budget="75%")
    assert 0 < len(budgeted.of(SwapResult).swapped) < len(everything.of(SwapResult).swapped)
    assert budgeted.peak_after <= 0.75 * budgeted.peak_before


@pytest.mark.parametrize("text, expected", [
    ("60%", 600), ("1KiB", 1024), ("2 MB", 2_000_000), ("1.5GiB", 3 * 2**29), ("700", 700),
    (None, 0),
])
def test_parse_budget(text, expected):
    assert parse_budget(text, 1000) == expected


def test_parse_budget_refuses_nonsense():
    with pytest.raises(GraphRewriteError, match="budget"):
        parse_budget("lots", 1000)


def test_a_bad_budget_is_a_usage_error_and_a_met_budget_swaps_nothing(tmp_path):
    out = tmp_path / "o.pb"
    shown = run_cli("optimize", fixture_path("resnet_cnn"), "-o", out, "--mode", "swap",
                    "--budget", "lots")
    assert shown.exit_code == 2 and "budget 'lots'" in shown.stderr and not out.exists()
    _, result = swapped(budget="100%")
    assert not result.of(SwapResult).swapped


def test_grappler_form_emits_copy_pairs_that_import():
    _, result = swapped(form="grappler")
    ops = [result.graph.op(n) for n in result.graph.nodes()]
    assert ops.count("_CopyFromGpuToHost") == ops.count("_CopyFromHostToGpu") > 0
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(result.graph.to_graph_def(), name="")
    assert result.peak_after < result.peak_before  # its output is host memory


def test_constants_inputs_and_small_tensors_are_never_swapped():
    _, result = swapped()
    names = {s.split(":")[0] for s in result.of(SwapResult).swapped}
    model = io.load(fixture_path("resnet_cnn"))
    assert not {n for n in names if model.graph.op(n) in ("Const", "Placeholder")}
    assert "smaller than 1 KiB" in result.of(SwapResult).skipped


def test_cli_swap_report(tmp_path):
    out = tmp_path / "swap.pb"
    shown = run_cli("optimize", fixture_path("resnet_cnn"), "-o", out, "--mode", "swap",
                    "--bandwidth", "16e9", "--json")
    assert shown.exit_code == 0, shown.stderr
    facts = json.loads(shown.stdout)
    assert facts["swapped"] and facts["bytes_moved"] > 0
    assert facts["transfer_seconds"] == pytest.approx(facts["bytes_moved"] / 16e9)
    inspected = json.loads(run_cli("inspect", "--json", out).stdout)
    assert inspected["host_peak_bytes"] > 0
    assert inspected["live_peak_bytes"] <= 0.6 * facts["peak_bytes"]["before"]


@pytest.mark.tf
@pytest.mark.parametrize("name", ["resnet_cnn", "mlp", "transformer_dropout"])
def test_swapped_graph_runs_bitwise_equal_on_the_cpu(name, tmp_path):
    from graphrewrite.execution import verify

    model, result = swapped(name)
    path = tmp_path / fixture_path(name).name
    io.save(model, result.graph, path)
    outcome = verify.verify(io.load(fixture_path(name)), io.load(path),
                            verify.VerifyOptions(runs=1), isolated=False)
    assert outcome.match and outcome.max_abs_diff == 0.0


def test_triggers_are_never_ops_grappler_regroups_nor_outputs():
    from graphrewrite.analysis.step import sinks
    from graphrewrite.passes.pads import GROUPED_OPS

    model, result = swapped("transformer_dropout")
    outputs = set(sinks(model.graph))
    swap_ins = [n for n in result.graph.nodes() if n.endswith(SWAP_IN_SUFFIX)]
    triggers = [w for n in swap_ins for w in result.graph.control_inputs(n)]
    assert triggers
    assert not [t for t in triggers if model.graph.op(t) in GROUPED_OPS or t in outputs]
    assert set(sinks(result.graph)) == outputs  # the rewritten graph has the same outputs


def test_the_rewritten_graph_still_splits_into_forward_and_backward():
    model, result = swapped()
    before, after = split(model.graph), split(result.graph)
    assert after.seeds == before.seeds
    assert before.forward <= after.forward


def with_attr(model, node, **attrs):
    from tensorflow.core.framework import attr_value_pb2

    graph = model.graph.copy()
    for key, value in attrs.items():
        attr = (attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(i=value))
                if isinstance(value, list) else attr_value_pb2.AttrValue(i=value))
        graph.set_attr(node, key, attr)
    return model.with_graph(graph)


def test_swap_to_host_attribute_swaps_that_input_for_that_reader_only(tmp_path):
    model = io.load(fixture_path("mlp"))
    reader = "gradients/dense_2/Relu_grad/ReluGrad"   # inputs: the gradient, dense_2/Relu
    path = tmp_path / "hinted.pbtxt"
    io.write_atomic(path, str(with_attr(model, reader, _swap_to_host=[1])).encode())
    result = pipeline.optimize(io.load(path), "manual")
    assert result.of(SwapResult).swapped == ["dense_2/Relu"]
    graph = result.graph
    assert graph.data_inputs(reader)[1].node == "dense_2/Relu" + SWAP_IN_SUFFIX
    other = [v for v, _ in graph.consumers(TensorRef("dense_2/Relu"))
             if v.startswith("gradients/")]
    assert other  # the weight gradient still reads the original
    assert graph.check() == []


def test_swap_to_host_index_out_of_range_is_an_error(tmp_path):
    model = io.load(fixture_path("mlp"))
    path = tmp_path / "hinted.pbtxt"
    io.write_atomic(path, str(with_attr(model, "dense_1/Relu", _swap_to_host=7)).encode())
    shown = run_cli("optimize", path, "-o", tmp_path / "out.pbtxt", "--mode", "manual")
    assert shown.exit_code == 2 and "_swap_to_host names input 7" in shown.stderr
    assert not (tmp_path / "out.pbtxt").exists()


def test_swap_selectors_swap_exactly_what_they_name():
    _, result = swapped("mlp", tensors="dense_1/Relu, scope:dense_3")
    assert result.of(SwapResult).swapped == ["dense_1/Relu", "dense_3/Relu"]  # others: no readers


def test_swap_selectors_need_a_mode_with_a_swap_pass():
    model = io.load(fixture_path("mlp"))
    with pytest.raises(GraphRewriteError, match="tensors needs a swap pass: mode manual or swap"):
        pipeline.optimize(model, "memory", swap_options={"tensors": "dense_1/Relu"})


def deep_chain(tmp_path, layers=24):
    """A chain of tanh(x @ w) layers with weight gradients: many checkpoints to keep."""
    import numpy as np

    from tfgraphs import build

    def chain():
        x = tf.compat.v1.placeholder(tf.float32, (512, 256), name="x")
        weights, h = [], x
        for i in range(layers):
            w = tf.constant(np.eye(256, dtype=np.float32) * 0.9, name=f"w{i}")
            weights.append(w)
            h = tf.tanh(tf.matmul(h, w), name=f"layer{i}")
        for i, g in enumerate(tf.gradients(tf.reduce_sum(h), weights)):
            tf.identity(g, name=f"grad{i}")

    path = tmp_path / "chain.pb"
    io.write_atomic(path, build(chain).to_graph_def().SerializeToString())
    return io.load(path)


def test_swap_checkpoints_moves_the_kept_checkpoints_to_host(tmp_path):
    model = deep_chain(tmp_path)
    kept = ",".join(f"layer{i}" for i in range(1, 23, 2))  # layer1's transfer can be hidden
    plain = pipeline.optimize(model, "collection", checkpoints=kept)
    both = pipeline.optimize(model, "collection", checkpoints=kept, swap_checkpoints=True)
    assert both.pipeline.endswith("swap")
    swapped_nodes = {s.split(":")[0] for s in both.of(SwapResult).swapped}
    assert swapped_nodes and swapped_nodes <= set(both.of(RecomputeResult).checkpoints)
    assert both.peak_after < plain.peak_after < plain.peak_before
    assert both.graph.check() == []
    with pytest.raises(GraphRewriteError, match="needs a recompute mode"):
        pipeline.optimize(model, "swap", swap_checkpoints=True)


def test_inspect_counts_the_bytes_moved(tmp_path):
    out = tmp_path / "swap.pbtxt"
    assert run_cli("optimize", fixture_path("mlp"), "-o", out, "--mode", "swap").exit_code == 0
    before = json.loads(run_cli("inspect", "--json", fixture_path("mlp")).stdout)
    after = json.loads(run_cli("inspect", "--json", out).stdout)
    assert before["bytes_moved"] == 0
    assert after["bytes_moved"] > 0
    assert after["transfer_seconds"] == pytest.approx(after["bytes_moved"] / 16e9)
    assert after["outputs"] == before["outputs"]


@pytest.mark.tf
def test_swapped_checkpoints_run_bitwise_equal(tmp_path):
    from graphrewrite.execution import verify

    model = deep_chain(tmp_path)
    result = pipeline.optimize(model, "memory", swap_checkpoints=True)
    path = tmp_path / "rewritten.pb"
    io.save(model, result.graph, path)
    outcome = verify.verify(model, io.load(path), verify.VerifyOptions(runs=1), isolated=False)
    assert outcome.match and outcome.max_abs_diff == 0.0


def _skip_on_a_gpu(why: str) -> None:
    """These tests check what a CPU-only machine says; with a GPU, `why` holds instead."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip(f"a GPU is present: {why}")


@pytest.mark.tf
def test_verify_explains_that_the_grappler_form_needs_a_gpu(tmp_path):
    _skip_on_a_gpu("the copy pairs can run")
    out = tmp_path / "grappler.pb"
    made = run_cli("optimize", fixture_path("resnet_cnn"), "-o", out, "--mode", "swap",
                   "--swap-form", "grappler")
    assert made.exit_code == 0 and "GPU kernels only" in made.stderr
    shown = run_cli("verify", fixture_path("resnet_cnn"), out)
    assert shown.exit_code == 2 and "GPU kernels only" in shown.stderr
    assert len(shown.stderr.strip().splitlines()) == 1


@pytest.mark.tf
def test_optimize_and_verify_say_a_cpu_cannot_show_what_a_swap_saves(tmp_path):
    _skip_on_a_gpu("the swap can lower the measured peak")
    out = tmp_path / "swapped.pbtxt"
    made = run_cli("optimize", fixture_path("mlp"), "-o", out, "--mode", "swap",
                   "--json")
    swapped = len(json.loads(made.stdout)["swapped"])
    assert "on this CPU-only machine host and device are one memory" in \
        json.loads(made.stdout)["note"]
    shown = run_cli("verify", fixture_path("mlp"), out, "--runs", "1")
    assert shown.exit_code == 0 and f"{swapped} tensors swapped to the host" in shown.stdout
    facts = json.loads(run_cli("verify", fixture_path("mlp"), out, "--runs", "1",
                               "--json").stdout)
    assert facts["swapped"] == swapped > 0
    unswapped = json.loads(run_cli("verify", fixture_path("mlp"), fixture_path("mlp"),
                                   "--runs", "1", "--json").stdout)
    assert unswapped["swapped"] == 0


def test_explain_names_the_swap_pair_and_its_trigger(tmp_path):
    shown = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "o.pbtxt", "--mode", "swap",
                    "--explain", "dense_1/Relu", "--explain", "x")
    swapped_line, input_line = shown.stdout.splitlines()[-2:]
    assert swapped_line.startswith("dense_1/Relu: swapped to host memory as dense_1/Relu"
                                   + SWAP_OUT_SUFFIX)
    assert "after trigger gradients/" in swapped_line
    assert input_line == "x: not swapped (graph input)"


def _stochastic_depth(path):
    """A TF1 step with v1 control flow: each residual branch kept or dropped by a `tf.cond` on
    a draw in the step (stochastic depth), as a ResNet built outside the repo was."""
    tf.compat.v1.disable_control_flow_v2()
    try:
        with tf.Graph().as_default() as g:
            tf.compat.v1.set_random_seed(3)
            h = tf.compat.v1.placeholder(tf.float32, [1024, 512], name="x")
            for i in range(4):
                dense = tf.compat.v1.layers.Dense(512, activation=tf.nn.relu, name=f"d{i}")
                keep = tf.random.uniform([], seed=i) < 0.5
                h = h + tf.cond(keep, lambda: dense(h), lambda: tf.zeros_like(h))
            loss = tf.reduce_mean(tf.square(h), name="loss")
            tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
            tf.compat.v1.global_variables_initializer()
            meta = tf.compat.v1.train.export_meta_graph(graph=g)
    finally:
        tf.compat.v1.enable_control_flow_v2()
    path.write_bytes(meta.SerializeToString())
    return io.load(path)


def test_a_v1_cond_branchs_tensors_swap_but_never_trigger(tmp_path):
    """A tensor of an untaken branch is dead, and so is a node waiting on one: a swap-in
    triggered by a node inside a branch never ran when the branch was not taken (a
    stochastic-depth ResNet's swap: 157 of 172 variables differed). A branch's own tensor may
    swap: its copies are dead exactly when it and its backward readers are (a Keras batch
    norm on the learning phase reads every activation through a cond: h20 swapped nothing)."""
    from graphrewrite.analysis.split import cond_branch_nodes
    from graphrewrite.execution import verify

    model = _stochastic_depth(tmp_path / "depth.meta")
    branches = cond_branch_nodes(model.graph)
    assert branches
    result = pipeline.optimize(model, "swap", swap_options={"profile": "v100"})
    swaps = result.of(SwapResult).swapped
    graph = result.graph
    for name in graph.nodes():
        if name.endswith(SWAP_IN_SUFFIX):
            assert not set(graph.control_inputs(name)) & branches, name
    assert {TensorRef.parse(s).node for s in swaps} & branches
    path = tmp_path / "depth_swap.meta"
    io.save(model, graph, path)
    outcome = verify.verify(model, io.load(path), verify.VerifyOptions(runs=1), isolated=False)
    assert outcome.match and outcome.max_abs_diff == 0.0


def test_nothing_swapped_says_why():
    """An Estimator-style step built outside the repo was told "nothing to swap" alone. The
    tape fixture's two candidates, swapped, do not lower its peak: the note says so and what
    holds the peak."""
    result = pipeline.optimize(io.load(fixture_path("tape_tf2")), "swap", as_run=False)
    note = result.of(SwapResult).note
    assert not result.of(SwapResult).swapped
    assert note.startswith("nothing to swap: swapping all 2 activations") and "%" in note, note
    # what goes further is recomputation, not the mode that ran (a distillation step was told
    # to "try --mode swap" by mode swap)
    assert "try --mode memory" in note and "--mode swap" not in note, note
