"""The command line as a user meets it: exit codes, outputs, help."""

import json

from graphrewrite import io

from conftest import FIXTURE_NAMES, fixture_path, run_cli

INSPECT_KEYS = ["file", "format", "nodes", "ops", "inputs", "outputs", "train_op", "signatures",
                "functions", "control_flow", "variables", "warnings", "peak_bytes",
                "host_peak_bytes", "persistent_bytes", "peak_node", "live_at_peak",
                "forward_nodes", "backward_nodes", "gradient_seeds", "flops", "fetches",
                "unknown_shapes"]


def test_optimize_mode_none_writes_an_equal_model(tmp_path):
    out = tmp_path / "mlp_opt.pbtxt"
    report = tmp_path / "report.json"
    result = run_cli("optimize", fixture_path("mlp"), "-o", out, "--mode", "none",
                     "--report", report)
    assert result.exit_code == 0, result.stderr
    assert "mode none" in result.stdout
    assert io.load(out).container == io.load(fixture_path("mlp")).container
    facts = json.loads(report.read_text())
    assert facts["mode"] == "none" and facts["nodes_before"] == facts["nodes_after"] == 95


def test_optimize_saved_model_directory(tmp_path):
    out = tmp_path / "sm_opt"
    result = run_cli("optimize", fixture_path("tiny_savedmodel"), "-o", out, "--mode", "none")
    assert result.exit_code == 0, result.stderr
    assert (out / "saved_model.pb").is_file() and (out / "variables").is_dir()


def test_unknown_mode_is_a_usage_error_listing_modes(tmp_path):
    out = tmp_path / "o.pb"
    result = run_cli("optimize", fixture_path("mlp"), "-o", out, "--mode", "fastest")
    assert result.exit_code == 2
    assert "unknown mode 'fastest'" in result.stderr and "none" in result.stderr
    assert not out.exists()


def test_inspect_json_has_the_documented_keys():
    result = run_cli("inspect", "--json", fixture_path("adam_train"))
    assert result.exit_code == 0
    facts = json.loads(result.stdout)
    assert list(facts) == INSPECT_KEYS
    assert facts["train_op"] == ["train_op"]
    assert len(facts["variables"]) == 14
    assert {i["name"] for i in facts["inputs"]} == {"x", "labels"}


def test_inspect_reports_control_flow():
    v1 = json.loads(run_cli("inspect", "--json", fixture_path("rnn_while_v1")).stdout)
    v2 = json.loads(run_cli("inspect", "--json", fixture_path("rnn_while_v2")).stdout)
    assert v1["control_flow"]["v1_loop_nodes"] > 0 and v1["control_flow"]["functional"] == []
    assert v2["control_flow"]["functional"] == ["StatelessWhile"] and v2["functions"] == 6
    assert v2["control_flow"]["v1_loop_nodes"] == 0


def test_inspect_table_for_people():
    result = run_cli("inspect", fixture_path("rnn_while_v1"))
    assert result.exit_code == 0
    assert "control flow  v1 loop frames" in result.stdout
    assert "inputs        target float[4,16], x float[4,6,8]" in result.stdout


def test_dump_prints_one_line_per_node():
    result = run_cli("dump", fixture_path("tape_tf2"))
    assert result.exit_code == 0
    node_lines = [l for l in result.stdout.splitlines() if " = " in l and not l.startswith(" ")]
    assert len(node_lines) == io.load(fixture_path("tape_tf2")).graph.__len__()


def test_help_teaches_every_command():
    for command in ["optimize", "dump", "inspect"]:
        result = run_cli(command, "--help")
        assert result.exit_code == 0 and "Usage:" in result.stdout


def test_every_fixture_inspects():
    for name in FIXTURE_NAMES:
        assert run_cli("inspect", fixture_path(name)).exit_code == 0, name
