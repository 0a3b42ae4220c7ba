"""Swap mode: activations to host memory and back, in both forms."""

import json

import pytest
import tensorflow as tf

from graphrewrite import analysis, io, pipeline
from graphrewrite.errors import GraphRewriteError
from graphrewrite.names import SWAP_IN_SUFFIX, SWAP_OUT_SUFFIX
from graphrewrite.passes.swap import parse_budget
from graphrewrite.split import split

from conftest import fixture_path, run_cli


def swapped(name="resnet_cnn", **options):
    model = io.load(fixture_path(name))
    return model, pipeline.optimize(model, "swap", swap_options=options)


def test_swap_moves_the_peak_to_host_memory():
    model, result = swapped()
    after = analysis.analyse(model, result.graph)
    assert result.peak_after <= 0.6 * result.peak_before
    assert after.memory.peak("host") >= result.stats["bytes_moved"] // 2 > 0
    assert result.graph.check() == []


def test_swap_pairs_rewire_only_the_gradient_flow():
    model, result = swapped()
    graph, flow = result.graph, split(model.graph).gradient_flow
    outs = [n for n in graph.nodes() if n.endswith(SWAP_OUT_SUFFIX)]
    assert outs and len(outs) == len(result.stats["swapped"])
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
    assert 0 < len(budgeted.stats["swapped"]) < len(everything.stats["swapped"])
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


def test_grappler_form_emits_copy_pairs_that_import():
    _, result = swapped(form="grappler")
    ops = [result.graph.op(n) for n in result.graph.nodes()]
    assert ops.count("_CopyFromGpuToHost") == ops.count("_CopyFromHostToGpu") > 0
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(result.graph.to_graph_def(), name="")
    assert result.peak_after < result.peak_before  # its output is host memory


def test_constants_inputs_and_small_tensors_are_never_swapped():
    _, result = swapped()
    names = {s.split(":")[0] for s in result.stats["swapped"]}
    model = io.load(fixture_path("resnet_cnn"))
    assert not {n for n in names if model.graph.op(n) in ("Const", "Placeholder")}
    assert "smaller than 1 KiB" in result.stats["swap_skipped"]


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
    assert inspected["peak_bytes"] <= 0.6 * facts["peak_bytes"]["before"]


@pytest.mark.tf
@pytest.mark.parametrize("name", ["resnet_cnn", "mlp", "transformer_dropout"])
def test_swapped_graph_runs_bitwise_equal_on_the_cpu(name, tmp_path):
    from graphrewrite import verify

    model, result = swapped(name)
    path = tmp_path / fixture_path(name).name
    io.save(model, result.graph, path)
    outcome = verify.verify(io.load(fixture_path(name)), io.load(path), runs=1, isolated=False)
    assert outcome.match and outcome.max_abs_diff == 0.0
