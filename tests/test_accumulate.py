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
    guard = "total" + ACCUMULATE_GUARD_SUFFIX
    assert new.op(guard) == "NoOp" and sorted(new.control_inputs(guard)) == [first, second]
    assert new.data_inputs("out")[0].node == "total"
    assert new.check() == [] and graph.op("total") == "AddN"  # the input graph is untouched


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
