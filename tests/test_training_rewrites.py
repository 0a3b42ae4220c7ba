"""Rewritten training steps run two steps bitwise equal to the original's: the losses of both
and every variable after them (weights, optimizer slots, batch-norm statistics, counters)."""

import pytest

from graphrewrite.core import io
from graphrewrite.execution import verify
from graphrewrite.passes.recompute import RecomputeResult
from graphrewrite.pipeline import run as pipeline

from conftest import fixture_path

pytestmark = pytest.mark.tf


@pytest.mark.parametrize("name", ["keras_train", "keras_step_tf2"])
@pytest.mark.parametrize("mode", ["memory", "speed"])
def test_rewritten_training_step_is_bitwise_equal_over_two_steps(name, mode, tmp_path):
    model = io.load(fixture_path(name))
    # The passes' rewrite, whatever the step as run on this machine (see pipeline.optimize).
    result = pipeline.optimize(model, mode, as_run=False)
    assert result.of(RecomputeResult).recomputed, "the fixture should be rewritten"
    out = tmp_path / fixture_path(name).name
    io.save(model, result.graph, out)
    checked = verify.verify(model, io.load(out), verify.VerifyOptions(runs=0), isolated=False)
    facts = checked.to_json()
    assert facts["steps"] == 2
    assert facts["variables_compared"] > 10
    assert checked.match, facts["mismatched"]
