"""The largest batch that fits a device (`planning.fit`, `inspect/optimize --device-memory`)."""

import json

import pytest
import tensorflow as tf

from graphrewrite.analysis.step import AnalysisOptions
from graphrewrite.core import io
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.planning import fit

from conftest import fixture_path, run_cli

MIB = 2**20


def _mlp_meta(path, width=256, layers=4):
    """A TF1 training MetaGraphDef whose inputs have an unknown batch dimension."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, (None, width), name="x")
        y = tf.compat.v1.placeholder(tf.int32, (None,), name="y")
        h = x
        for i in range(layers):
            h = tf.nn.relu(tf.matmul(h, tf.compat.v1.get_variable(f"w{i}", (width, width))))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h),
                              name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        path.write_bytes(tf.compat.v1.train.export_meta_graph().SerializeToString())
    return io.load(path)


def test_the_largest_batch_fits_and_the_next_does_not(tmp_path):
    model = _mlp_meta(tmp_path / "mlp.meta")
    found = fit.largest_batch(model, 64 * MIB)
    assert found.inputs == ["x", "y"] and found.batch > 1
    assert found.peak_bytes <= 64 * MIB < found.next_peak_bytes
    half = fit.largest_batch(model, 32 * MIB)
    assert half.batch < found.batch and half.peak_bytes <= 32 * MIB < half.next_peak_bytes
    assert fit.largest_batch(model, 1024).batch == 0  # not one example


def test_a_graph_of_fixed_shapes_has_no_batch_to_search():
    with pytest.raises(GraphRewriteError, match="no input has an unknown batch dimension"):
        fit.largest_batch(io.load(fixture_path("mlp")), 64 * MIB)


def test_inspect_and_optimize_report_the_largest_batch(tmp_path):
    _mlp_meta(tmp_path / "mlp.meta")
    shown = run_cli("inspect", tmp_path / "mlp.meta", "--json", "--device-memory", "64MiB")
    assert shown.exit_code == 0, shown.stderr
    facts = json.loads(shown.stdout)["largest_batch"]
    assert facts["device_memory"] == 64 * MIB and facts["batch"] > 1
    assert (facts["model"], facts["device"]) == ("as_run", "gpu")
    table = run_cli("inspect", tmp_path / "mlp.meta", "--device-memory", "64MiB").stdout
    assert f"largest batch {facts['batch']} in 64.0 MiB" in table
    done = run_cli("optimize", tmp_path / "mlp.meta", "-o", tmp_path / "out.meta", "--json",
                   "--input-shape", "x:1024,256", "--input-shape", "y:1024",
                   "--device-memory", "64MiB")
    assert done.exit_code == 0, done.stderr
    both = json.loads(done.stdout)["largest_batch"]
    assert both["before"]["batch"] == facts["batch"]
    assert both["after"]["batch"] >= both["before"]["batch"]
    written = run_cli("optimize", tmp_path / "mlp.meta", "-o", tmp_path / "out2.meta", "--json",
                      "--input-shape", "x:1024,256", "--input-shape", "y:1024",
                      "--device-memory", "64MiB", "--no-as-run", "--device", "cpu")
    assert written.exit_code == 0, written.stderr
    assert {(fit_["model"], fit_["device"]) for fit_ in json.loads(
        written.stdout)["largest_batch"].values()} == {("as_written", "cpu")}
    refused = run_cli("inspect", tmp_path / "mlp.meta", "--device-memory", "50%")
    assert refused.exit_code == 2 and "--device-memory" in refused.stderr


@pytest.mark.tf
def test_the_predicted_batch_fits_as_measured_and_the_next_does_not(tmp_path):
    """On the CPU's allocator (regions grown as they fill), the model predicts where the step
    stops fitting; the measured peaks of that batch and the next one straddle the limit."""
    from graphrewrite.execution import verify

    model = _mlp_meta(tmp_path / "mlp.meta")
    found = fit.largest_batch(model, 64 * MIB, analysis=AnalysisOptions(device="cpu"))

    def measured(batch):
        options = verify.VerifyOptions(input_shapes={"x": (batch, 256), "y": (batch,)}, runs=0)
        return verify.verify(model, model, options, isolated=True).original.peak_bytes

    assert measured(found.batch) <= 64 * MIB < measured(found.batch + 1)


def test_each_analysis_warning_is_said_once_over_the_probes(tmp_path, monkeypatch, caplog):
    """Every probe analyses the step again; the same warning at every batch is said once."""
    from graphrewrite.analysis import step as analysis_mod

    model = _mlp_meta(tmp_path / "mlp.meta")
    analyse = analysis_mod.analyse

    def warning_analyse(*args, **kwargs):
        analysis_mod.log.warning("%d tensors have an unknown size", 3)
        return analyse(*args, **kwargs)

    monkeypatch.setattr(analysis_mod, "analyse", warning_analyse)
    with caplog.at_level("WARNING", logger=analysis_mod.__name__):
        found = fit.largest_batch(model, 16 * MIB, as_run=False)
    assert found.batch > 1 and found.model == "as_written"
    assert [r.getMessage() for r in caplog.records] == ["3 tensors have an unknown size"]
    analysis_mod.log.warning("after the search")  # the filter is gone with it
    assert caplog.records[-1].getMessage() == "after the search"
