"""`verify --trace DIR` and `--plot FILE`: a Chrome trace and a TensorBoard run per graph, that
the tools load, and a chart of both measured steps."""

import json

import pytest

from conftest import fixture_path, run_cli

pytestmark = pytest.mark.tf


def test_verify_writes_traces_and_a_plot_of_both_measured_steps(tmp_path):
    rewritten = tmp_path / "mlp_opt.pbtxt"
    assert run_cli("optimize", fixture_path("mlp"), "-o", rewritten).exit_code == 0
    traces = tmp_path / "traces"
    chart = tmp_path / "measured.svg"
    shown = run_cli("verify", fixture_path("mlp"), rewritten, "--runs", "1", "--trace", traces,
                    "--plot", chart)
    assert shown.exit_code == 0, shown.stderr
    svg = chart.read_text()
    assert "original (measured)" in svg and "rewritten (measured)" in svg
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for label in ("original", "rewritten"):
        events = json.loads((traces / f"{label}.trace.json").read_text())["traceEvents"]
        assert any(e.get("ph") == "X" and e.get("dur", 0) >= 0 for e in events)  # node times
        assert any(e.get("ph") == "C" for e in events)                            # memory
        run = EventAccumulator(str(traces / label))
        run.Reload()  # TensorBoard's own loader
        assert run.Tags()["graph"] and run.Tags()["run_metadata"] == ["step"]
        nodes = {n.node_name for d in run.RunMetadata("step").step_stats.dev_stats
                 for n in d.node_stats}
        assert "loss" in nodes or any(n.startswith("gradients/") for n in nodes)
    assert len(run.Graph().node) > len(EventAccumulator(str(traces / "original")).Reload()
                                       .Graph().node)  # the rewritten graph has the copies
