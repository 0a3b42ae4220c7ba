"""What holds the modelled peak, and the note that says why a rewrite saved little."""

import dataclasses

from graphrewrite.analysis import step as analysis
from graphrewrite.analysis.memory import DEVICE
from graphrewrite.core import io
from graphrewrite.passes import recompute
from graphrewrite.planning import peak
from graphrewrite.planning.context import Context

from conftest import fixture_path


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
    assert "--mode diet" in peak.why_so_little(ctx, only_state)


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
