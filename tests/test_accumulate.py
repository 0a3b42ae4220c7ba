"""The accumulate pass: AddN as a running sum, in Grappler's order, that Grappler keeps."""

import pytest
import tensorflow as tf

from graphrewrite.core import io
from graphrewrite.core.names import ACCUMULATE_GUARD_SUFFIX, ACCUMULATE_SUFFIX
from graphrewrite.passes import accumulate
from graphrewrite.passes.accumulate import AccumulateResult
from graphrewrite.pipeline import run as pipeline

from conftest import fixture_path
from tfgraphs import build, placeholder


def four_term_sum():
    def fn():
        terms = [tf.tanh(placeholder(f"x{i}"), name=f"t{i}") for i in (3, 1, 0, 2)]
        tf.identity(tf.math.add_n(terms, name="total"), name="out")
    return build(fn)


def test_addn_becomes_a_chain_in_name_order_under_the_same_name():
    graph = four_term_sum()
    result = accumulate.run(graph, None, accumulate.AccumulateOptions())
    new = result.graph
    assert result.accumulated == ["total"] and result.terms == 4
    assert new.op("total") == "AddV2"
    first, second = (f"total{ACCUMULATE_SUFFIX}_{i}" for i in (1, 2))
    assert [str(r) for r in new.data_inputs(first)] == ["t0", "t1"]
    assert [str(r) for r in new.data_inputs(second)] == [first, "t2"]
    assert [str(r) for r in new.data_inputs("total")] == [second, "t3"]
    for link in (first, second):  # each its own guard: no edge the others imply
        guard = link + ACCUMULATE_GUARD_SUFFIX
        assert new.op(guard) == "NoOp" and new.control_inputs(guard) == [link]
    assert new.data_inputs("out")[0].node == "total"
    assert new.check() == [] and graph.op("total") == "AddN"  # the input graph is untouched


@pytest.mark.parametrize("share, changed", [(0.3, True), (0.5, False)])
def test_mode_memory_accumulates_only_sums_whose_terms_hold_a_share_of_the_peak(share, changed):
    """Four 1 KiB terms of a 10 KiB peak: 40% of it. Mode memory asks for a tenth (an unrolled
    LSTM's weight gradient held 84%); a GAN's small sums, rewritten, changed Grappler's fusions."""
    from types import SimpleNamespace

    found = SimpleNamespace(memory=SimpleNamespace(peak=lambda: 10 * 1024),
                            shapes=SimpleNamespace(nbytes=lambda ref: 1024))
    result = accumulate.run(four_term_sum(), found, accumulate.AccumulateOptions(min_share=share))
    assert result.modified is changed and result.note == ""


def test_a_sum_of_sums_is_left_alone():
    """Grappler's AddOpsRewrite folds `AddN(AddN(a, b), c, d)` into one AddN of the four leaves
    in name order; a chain over the outer sum's own terms adds in another order (a WGAN-GP
    step built outside the repo: its critic's kernel gradient differed by 2e-4)."""
    def fn():
        a, b, c, d = (tf.tanh(placeholder(f"x{i}"), name=f"t{i}") for i in range(4))
        inner = tf.math.add_n([a, d], name="inner")
        tf.identity(tf.math.add_n([inner, b, c], name="total"), name="out")
        tf.identity(tf.math.add_n([a, b, c], name="alone"), name="out2")

    result = accumulate.run(build(fn), None, accumulate.AccumulateOptions(min_inputs=2))
    assert result.accumulated == ["alone"]


def test_small_sums_are_left_alone():
    result = accumulate.run(four_term_sum(), None, accumulate.AccumulateOptions(min_inputs=5))
    assert not result.modified and "5+ inputs" in result.note


@pytest.mark.tf
def test_accumulated_sums_are_bitwise_equal(tmp_path):
    from graphrewrite.execution import verify

    model = io.load(fixture_path("transformer_dropout"))
    result = pipeline.optimize(model, "none", passes="accumulate(min_inputs=2)")
    assert len(result.of(AccumulateResult).accumulated) == 4
    path = tmp_path / "accumulated.pb"
    io.save(model, result.graph, path)
    outcome = verify.verify(model, io.load(path), verify.VerifyOptions(runs=1), isolated=False)
    assert outcome.match and outcome.max_abs_diff == 0.0


@pytest.mark.parametrize("count, groups", [(2, [2]), (4, [4]), (8, [8]), (9, [9]),
                                           (10, [2, 8]), (16, [8, 8]), (17, [9, 8]),
                                           (20, [4, 8, 8])])
def test_the_groups_are_the_addn_kernels(count, groups):
    assert accumulate.kernel_groups(count) == groups


@pytest.mark.tf
def test_a_sum_of_twenty_is_bitwise_equal_in_the_kernels_groups(tmp_path):
    """TensorFlow's AddN kernel adds each group of 8 inputs after the first on its own, then to
    the total: one chain of an unrolled LSTM's 20 weight-gradient terms differed by 6e-8."""
    from graphrewrite.execution import verify

    def fn():
        x = placeholder("x", [64, 64])
        terms = [tf.matmul(tf.sin(x * (0.3 + i)), x, name=f"t{i}") for i in range(20)]
        tf.identity(tf.math.add_n(terms, name="total"), name="out")

    path, out = tmp_path / "sum.pb", tmp_path / "sum_acc.pb"
    path.write_bytes(build(fn).to_graph_def().SerializeToString())
    model = io.load(path)
    result = pipeline.optimize(model, "none", passes="accumulate")
    assert result.of(AccumulateResult).terms == 20
    io.save(model, result.graph, out)
    outcome = verify.verify(model, io.load(out), verify.VerifyOptions(runs=0), isolated=False)
    assert outcome.match, outcome.max_abs_diff


@pytest.mark.tf
def test_a_sum_of_thirty_small_terms_stays_a_chain_through_grappler(tmp_path):
    """An unrolled LSTM's bias gradient, 30 terms of 4 KiB: with one guard for the whole chain
    Grappler's dependency optimizer dropped the edges each later link implies, AddOpsRewrite
    folded the links it freed, and the sum differed by 2e-9."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.execution import verify

    def fn():  # a bias used at 30 steps: its gradient an AddN of 30 BiasAddGrads
        x = placeholder("x", [32, 256])
        b = tf.constant(0.1, shape=[256], name="b")
        h, losses = x, []
        for step in range(30):
            h = tf.tanh(tf.nn.bias_add(h * 0.9, b))
            losses.append(tf.reduce_sum(h))
        tf.identity(tf.gradients(tf.add_n(losses), b)[0], name="out")

    path, out = tmp_path / "sum.pb", tmp_path / "sum_acc.pb"
    path.write_bytes(build(fn).to_graph_def().SerializeToString())
    model = io.load(path)
    result = pipeline.optimize(model, "none", passes="accumulate")
    io.save(model, result.graph, out)
    rewritten = io.load(out)
    found = analysis.analyse(rewritten)
    grappled, _, _ = analysis.as_run_step(rewritten, rewritten.graph, found)
    assert not [n for n in grappled.nodes() if "AddOpsRewrite" in n]
    outcome = verify.verify(model, rewritten, verify.VerifyOptions(runs=0), isolated=False)
    assert outcome.match, outcome.max_abs_diff
