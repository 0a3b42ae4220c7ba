"""The command line as a user meets it: exit codes, outputs, help."""

import json
import os
import sys

import pytest

from graphrewrite.core import io
from graphrewrite.core.names import AHEAD_SUFFIX, GATE_PREFIX, PAD_PREFIX

from conftest import FIXTURE_NAMES, fixture_path, run_cli

CLI = "graphrewrite.cli.main"  # python -m CLI runs the command line

INSPECT_KEYS = ["file", "format", "nodes", "ops", "inputs", "outputs", "train_op", "signatures",
                "functions", "control_flow", "variables", "warnings", "inlined_calls", "peak_bytes",
                "live_peak_bytes", "peak_bytes_as_written", "peak_bytes_bound", "modelled_as", "modelled_on", "host_peak_bytes", "bytes_moved", "transfer_seconds", "persistent_bytes", "peak_node", "lossless_floor", "live_at_peak",
                "forward_nodes", "backward_nodes", "gradient_seeds", "flops", "fetches",
                "unknown_shapes", "sized_by_data", "estimated_sizes", "trainable_parameters", "bytes_per_parameter",
                "bytes_per_parameter_2d"]


def test_optimize_mode_none_writes_an_equal_model(tmp_path):
    out = tmp_path / "mlp_opt.pbtxt"
    report = tmp_path / "report.json"
    result = run_cli("optimize", fixture_path("mlp"), "-o", out, "--mode", "none",
                     "--report", report)
    assert result.exit_code == 0, result.stderr
    assert "mode            none" in result.stdout
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


def test_json_output_is_strict_a_loss_that_went_nan_is_null():
    from graphrewrite.cli.main import to_json

    text = to_json({"final_loss": {"original": float("nan"), "rewritten": 4.5},
                    "curve": (2.0, float("inf"))})
    assert json.loads(text, parse_constant=pytest.fail) == {
        "final_loss": {"original": None, "rewritten": 4.5}, "curve": [2.0, None]}


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


@pytest.mark.tf
def test_inspect_sees_the_loops_of_called_functions(tmp_path):
    import tensorflow as tf

    @tf.function
    def inner(x):
        return tf.while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2.0), [0, x])[1]

    @tf.function(input_signature=[tf.TensorSpec([4], tf.float32)])
    def step(x):
        return inner(x)

    path = tmp_path / "step.pb"
    graph_def = step.get_concrete_function().graph.as_graph_def(add_shapes=True)
    assert not {n.op for n in graph_def.node} & {"While", "StatelessWhile"}
    path.write_bytes(graph_def.SerializeToString())
    facts = json.loads(run_cli("inspect", "--json", str(path)).stdout)
    assert set(facts["control_flow"]["functional"]) & {"While", "StatelessWhile"}


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


def test_inspect_models_memory_and_split():
    facts = json.loads(run_cli("inspect", "--json", fixture_path("mlp")).stdout)
    assert facts["gradient_seeds"] == ["gradients/grad_ys_0"]
    assert facts["forward_nodes"] + facts["backward_nodes"] == facts["nodes"]
    assert facts["peak_bytes"] > facts["persistent_bytes"] > 0
    # on a CPU the session holds the fed inputs (labels int32[512], x float[512,64]) itself
    assert facts["host_peak_bytes"] == 512 * 4 + 512 * 64 * 4
    assert facts["unknown_shapes"]["count"] == 0
    sizes = [t["bytes"] for t in facts["live_at_peak"]]
    assert sizes == sorted(sizes, reverse=True) and len(sizes) == 10
    # 6 layers of [16,64]x[64,64] plus the logits, forward and two gradient matmuls each
    assert facts["flops"] > 3 * 2 * 16 * 64 * 64 * 6


def test_inspect_input_shape_fixes_unknown_dimensions(tmp_path):
    import tensorflow as tf

    from tfgraphs import build

    def graph():
        x = tf.compat.v1.placeholder(tf.float32, (None, 256), name="x")
        tf.reduce_sum(tf.nn.relu(tf.negative(x)), name="loss")
    path = tmp_path / "unknown_batch.pb"
    path.write_bytes(build(graph).to_graph_def().SerializeToString())
    unknown = run_cli("inspect", "--json", path)
    assert json.loads(unknown.stdout)["unknown_shapes"]["count"] == 3  # x, Neg, Relu
    assert "--input-shape" in unknown.stderr
    fixed = json.loads(run_cli("inspect", "--json", path, "--input-shape", "x:8,256").stdout)
    assert fixed["unknown_shapes"]["count"] == 0
    # Neg (Relu writes in place), the int32[2] axes constant and the scalar sum; the
    # allocator rounds each of the last two up to its 256 bytes; x is the session's (fed)
    assert fixed["live_peak_bytes"] == 8 * 256 * 4 + 8 + 4
    assert fixed["host_peak_bytes"] == 8 * 256 * 4
    assert fixed["peak_bytes"] == 8 * 256 * 4 + 256 + 256
    bad = run_cli("inspect", path, "--input-shape", "x:a,b")
    assert bad.exit_code == 2 and "must be integers" in bad.stderr
    missing = run_cli("inspect", path, "--input-shape", "nope:1")
    assert missing.exit_code == 2 and "not a node" in missing.stderr


def test_inspect_outputs_and_backward_scope():
    facts = json.loads(run_cli("inspect", "--json", fixture_path("mlp"), "--outputs",
                               "outputs/loss").stdout)
    assert facts["fetches"] == ["outputs/loss"]
    assert facts["flops"] < json.loads(run_cli("inspect", "--json",
                                               fixture_path("mlp")).stdout)["flops"]
    scoped = json.loads(run_cli("inspect", "--json", fixture_path("mlp"), "--backward-scope",
                                "gradients/").stdout)
    assert scoped["backward_nodes"] > 0
    bad = run_cli("inspect", fixture_path("mlp"), "--outputs", "nope")
    assert bad.exit_code == 2 and "'nope' is not a node" in bad.stderr


def test_optimize_memory_reports_and_explains(tmp_path):
    out = tmp_path / "resnet_cnn_opt.pb"
    result = run_cli("optimize", fixture_path("resnet_cnn"), "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["mode"] == "memory"
    assert facts["pipeline"] == ("inline ungate loop_recompute rerun defer "
                                  "accumulate(min_share=0.1) micro_batches "
                                  "recompute(policy=memory) serialize tails_first apply_early")
    assert facts["peak_bytes"]["after"] < facts["peak_bytes"]["before"]
    as_run = facts["peak_bytes_as_run"]  # after Grappler, as inspect models the graphs
    assert 0 < as_run["after"] < as_run["before"]
    written = io.load(out).graph.nodes()
    ahead = sum(n.endswith(AHEAD_SUFFIX) and not n.startswith(PAD_PREFIX)  # its segment
                for n in written)
    gates = sum(n.startswith(GATE_PREFIX) for n in written)  # a copied convolution's wait
    assert facts["nodes_added"] == (len(facts["recomputed"]) + ahead + facts["triggers"]
                                    + gates + facts["fanout_pads"]) > 0
    assert ahead >= len(facts["recomputed_ahead"])
    assert facts["extra_flops"] > 0 and facts["checkpoints"]
    assert "x" in facts["skipped"]["graph input"]["examples"]  # never copied
    kept, copied = facts["checkpoints"][0], facts["recomputed"][0]
    explained = run_cli("optimize", fixture_path("resnet_cnn"), "-o", out, "--explain", kept,
                        "--explain", copied, "--explain", "x")
    lines = explained.stdout.splitlines()[-3:]
    assert lines[0].startswith(f"{kept}: kept (a checkpoint")
    assert lines[1].startswith(f"{copied}: recomputed as {copied}-graphrewrite_recompute")
    assert lines[2] == "x: kept, it cannot be recomputed (graph input)"
    bad = run_cli("optimize", fixture_path("resnet_cnn"), "-o", tmp_path / "o.pb", "--explain",
                  "nope")
    assert bad.exit_code == 2 and not (tmp_path / "o.pb").exists()


def test_optimize_without_the_as_run_report_writes_the_same_bytes(tmp_path):
    full, fast = tmp_path / "full.pb", tmp_path / "fast.pb"
    assert run_cli("optimize", fixture_path("resnet_cnn"), "-o", full).exit_code == 0
    result = run_cli("optimize", fixture_path("resnet_cnn"), "-o", fast, "--no-as-run", "--json")
    assert result.exit_code == 0, result.stderr
    assert fast.read_bytes() == full.read_bytes()
    facts = json.loads(result.stdout)
    assert facts["peak_bytes_as_run"] == {"before": None, "after": None}
    assert facts["peak_bytes"]["after"] < facts["peak_bytes"]["before"]
    refused = run_cli("optimize", fixture_path("resnet_cnn"), "-o", tmp_path / "x.pb",
                      "--no-as-run", "--plot", tmp_path / "x.png")
    assert refused.exit_code == 2 and "--no-as-run" in refused.stderr
    assert not (tmp_path / "x.pb").exists()


def test_optimize_planner_is_written_into_the_pipeline_and_needs_a_recompute_pass(tmp_path):
    out = tmp_path / "o.pb"
    search = run_cli("optimize", fixture_path("mlp"), "-o", out, "--planner", "search", "--json")
    assert search.exit_code == 0, search.stderr
    facts = json.loads(search.stdout)
    assert facts["pipeline"] == (
        "inline ungate loop_recompute rerun defer accumulate(min_share=0.1) "
        "micro_batches recompute(policy=memory, planner=search) serialize tails_first apply_early")
    replayed = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "p.pb", "--passes",
                       facts["pipeline"], "--json")
    assert (tmp_path / "p.pb").read_bytes() == out.read_bytes()
    assert json.loads(replayed.stdout)["pipeline"] == facts["pipeline"]
    for args, message in ((["--planner", "guess"], "guess"),
                          (["--mode", "swap", "--planner", "search"], "recompute")):
        refused = run_cli("optimize", fixture_path("mlp"), "-o", tmp_path / "x.pb", *args)
        assert refused.exit_code == 2 and message in refused.stderr
        assert not (tmp_path / "x.pb").exists()


def test_optimize_collection_needs_selectors(tmp_path):
    out = tmp_path / "o.pb"
    result = run_cli("optimize", fixture_path("resnet_cnn"), "-o", out, "--mode", "collection")
    assert result.exit_code == 2 and "--checkpoints" in result.stderr and not out.exists()
    chosen = run_cli("optimize", fixture_path("resnet_cnn"), "-o", out, "--mode", "collection",
                     "--checkpoints", "op:Conv2D,regex:Relu$", "--json")
    assert chosen.exit_code == 0
    assert "stem/Relu" in json.loads(chosen.stdout)["checkpoints"]


def test_start_is_quick_without_tensorflow():
    import subprocess
    import sys
    import time

    check = "import sys, graphrewrite.cli.main; print('tensorflow' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert loaded.stdout.strip() == "False", loaded.stderr
    start = time.perf_counter()
    shown = subprocess.run([sys.executable, "-m", CLI, "--version"], capture_output=True,
                           text=True)
    assert shown.returncode == 0 and "0.1.0" in shown.stdout
    assert time.perf_counter() - start < 1.5  # 0.25 s here; TensorFlow alone takes 3 s


def test_the_command_ends_without_freeing_and_keeps_its_exit_code_and_output(tmp_path):
    """`entry` ends the process at once (`os._exit`): the exit code, the report on stdout and
    the one-line error on stderr still come out whole."""
    import subprocess

    def run(*args):  # TensorFlow's C++ logs off, as the CLI sets them by default: one dry
        # run had TensorFlow's plugin-registration errors above the CLI's line
        return subprocess.run([sys.executable, "-m", CLI, *args], capture_output=True,
                              text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})

    out = tmp_path / "mlp_opt.pbtxt"
    done = run("optimize", str(fixture_path("mlp")), "-o", str(out), "--no-as-run", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["output"] == str(out)
    assert out.exists()
    refused = run("inspect", str(tmp_path / "missing.pb"))
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("graphrewrite: error:") and refused.stderr.count("\n") == 1
    usage = run("optimize")
    assert usage.returncode == 2 and "Missing argument" in usage.stderr


def test_exit_codes_and_output_rules_are_documented():
    import re
    from pathlib import Path

    import graphrewrite.cli.main

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    codes = readme.split("**Exit codes.**")[1].split("\n\n")[0]
    for text in (graphrewrite.cli.main.__doc__, run_cli("--help").stdout, codes):
        assert all(re.search(rf"(?<![\w.]){code}(?![\w.])", text) for code in "0123"), text
    optimize_help = " ".join(run_cli("optimize", "--help").stdout.split())
    assert "symlink is written through" in optimize_help and "--in-place" in optimize_help
    assert "Missing directories are created" in optimize_help
    assert "planned, not built yet" not in readme and ".venv/bin/graphrewrite" in readme


def test_license_is_an_spdx_string():
    import re
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.MULTILINE)
    assert '"setuptools>=77' in pyproject  # the first setuptools that reads SPDX strings


def test_optimize_shows_its_stages_on_a_terminal_only(monkeypatch, capsys):
    import graphrewrite.cli.tables

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    shown = graphrewrite.cli.tables.Stages()
    shown("loading")
    assert capsys.readouterr().err.endswith("s  loading\n")
    assert not graphrewrite.cli.tables.Stages(enabled=False).shown  # -q
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    quiet = graphrewrite.cli.tables.Stages()
    quiet("loading")
    assert capsys.readouterr().err == ""
    graphrewrite.cli.tables.Stages(logged=True)("loading")  # -v: in logs too
    assert capsys.readouterr().err.endswith("s  loading\n")


# Usage a new user tries (issue 32): each refused before anything runs, with one line on stderr
# naming what is wrong, the exit code given, nothing written. Each case: (command line after
# `graphrewrite`, given the scratch directory; a setup taking (monkeypatch, scratch) or None;
# the exit code; what the line says).
def _full_disk(monkeypatch, scratch):
    import errno
    import os

    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)


def _read_only(monkeypatch, scratch):
    import errno
    import os
    import tempfile

    def refused(*args, dir=None, prefix="", **kwargs):  # what a read-only directory says
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), f"{dir}/{prefix}x.tmp")

    monkeypatch.setattr(tempfile, "mkstemp", refused)


def _no_matplotlib(monkeypatch, scratch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails


def _interrupted(monkeypatch, scratch):
    from graphrewrite.pipeline import run as pipeline

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "optimize", ctrl_c)


MLP = fixture_path("mlp")
USAGE_CASES = {
    "plot format from a .jpg": (
        lambda d: ["optimize", MLP, "-o", d / "o.pbtxt", "--plot", d / "a.jpg"], None, 2,
        "--plot"),
    "inspect plot format from a .jpg": (lambda d: ["inspect", MLP, "--plot", d / "a.jpg"], None,
                                        2, "use one of .png, .svg, .pdf"),
    "plot without matplotlib": (
        lambda d: ["optimize", MLP, "-o", d / "o.pbtxt", "--plot", d / "a.png"], _no_matplotlib,
        2, "--plot needs matplotlib"),
    "verify --runs 0": (lambda d: ["verify", MLP, MLP, "--runs", "0"], None, 2, "--runs"),
    "inspect --top -3": (lambda d: ["inspect", MLP, "--top", "-3"], None, 2, "--top"),
    "budget over 100%": (lambda d: ["optimize", MLP, "-o", d / "o.pbtxt", "--budget", "150%"],
                         None, 2, "budget '150%': a share of the original's peak is at most"),
    "batch --jobs 0": (lambda d: ["batch", MLP, "--out-dir", d / "out", "--jobs", "0"], None, 2,
                       "--jobs"),
    "output under a file": (
        lambda d: ["optimize", MLP, "-o", (d / "file").touch() or d / "file" / "o.pbtxt",
                   "--mode", "none", "--no-as-run"], None, 2, "cannot write "),
    "read-only directory": (lambda d: ["optimize", MLP, "-o", d / "o.pbtxt", "--mode", "none",
                                       "--no-as-run"], _read_only, 2,
                            "o.pbtxt: Permission denied"),
    "full disk": (lambda d: ["optimize", MLP, "-o", d / "o.pbtxt", "--mode", "none",
                             "--no-as-run"], _full_disk, 2,
                  "o.pbtxt: No space left on device"),
    "Ctrl-C": (lambda d: ["optimize", MLP, "-o", d / "o.pbtxt"], _interrupted, 130,
               "graphrewrite: interrupted"),
}


@pytest.mark.parametrize("case", sorted(USAGE_CASES))
def test_usage_is_refused_with_one_line_before_anything_is_written(case, tmp_path, monkeypatch):
    args, setup, code, expected = USAGE_CASES[case]
    arguments = args(tmp_path)
    if setup:
        setup(monkeypatch, tmp_path)
    before = sorted(tmp_path.iterdir())
    result = run_cli(*arguments)
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphrewrite: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert sorted(tmp_path.iterdir()) == before  # nothing written, nothing left behind


def test_cannot_write_names_the_output_given(tmp_path):
    (tmp_path / "file").touch()
    out = tmp_path / "file" / "o.pbtxt"
    result = run_cli("optimize", MLP, "-o", out, "--mode", "none", "--no-as-run")
    assert result.stderr == (f"graphrewrite: error: cannot write {out}: File exists "
                             f"({tmp_path / 'file'})\n")


def test_a_saved_model_is_written_as_a_directory_with_a_warning_on_a_file_name(tmp_path):
    out = tmp_path / "model_opt.pb"
    result = run_cli("optimize", fixture_path("tiny_savedmodel"), "-o", out, "--mode", "none",
                     "--no-as-run")
    assert result.exit_code == 0, result.stderr
    assert (out / "saved_model.pb").is_file()
    assert f"warning: {out}: a SavedModel is written as a directory" in result.stderr
    quiet = run_cli("optimize", fixture_path("tiny_savedmodel"), "-o", tmp_path / "model_opt",
                    "--mode", "none", "--no-as-run")
    assert "SavedModel is written as a directory" not in quiet.stderr
    assert "SavedModel is written as a directory" in " ".join(
        run_cli("optimize", "--help").stdout.split())


def test_optimize_stops_when_there_is_no_backward_pass(monkeypatch):
    """Nothing to rewrite: the steps are not modelled as run either (45 s at 100k nodes)."""
    from graphrewrite.analysis import step as analysis
    from graphrewrite.pipeline import run as pipeline

    def refused(*args, **kwargs):
        raise AssertionError("modelled as run")

    monkeypatch.setattr(analysis, "start_as_run", refused)
    monkeypatch.setattr(analysis, "as_run_step", refused)
    model = io.load(fixture_path("tiny_savedmodel"))
    result = pipeline.optimize(model, "memory")
    assert result.run_reports == (None, None)
    assert result.graph.to_graph_def() == model.graph.to_graph_def()
    assert "nothing to do" in result.results["recompute"].note


def test_exact_planner_json_is_alone_on_stdout(tmp_path):
    """HiGHS prints a banner from C++ on its first solver: not onto the report."""
    import subprocess

    pytest.importorskip("highspy")
    done = subprocess.run([sys.executable, "-m", CLI, "optimize", str(fixture_path("mlp")),
                           "-o", str(tmp_path / "o.pbtxt"), "--planner", "exact", "--json",
                           "--no-as-run"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pipeline"].endswith(
        "planner=exact) serialize tails_first apply_early")


@pytest.mark.tf
def test_verify_shows_its_stages_on_a_terminal_only(monkeypatch, tmp_path):
    import functools

    import graphrewrite.cli.tables
    from graphrewrite.execution import verify

    # in this process: each run takes a second, not a fresh process's thirty on a busy machine
    monkeypatch.setattr(verify, "verify", functools.partial(verify.verify, isolated=False))
    out = tmp_path / "mlp_opt.pbtxt"
    assert run_cli("optimize", MLP, "-o", out, "--no-as-run").exit_code == 0
    piped = run_cli("verify", MLP, out, "--runs", "1")
    assert piped.exit_code == 0 and piped.stderr == ""
    shown = graphrewrite.cli.tables.Stages.__init__

    def on_a_terminal(self, enabled=True, **options):
        shown(self, enabled, **options)
        self.shown = enabled  # what a terminal's stderr gets

    monkeypatch.setattr(graphrewrite.cli.tables.Stages, "__init__", on_a_terminal)
    result = run_cli("verify", MLP, out, "--runs", "1")
    stages = [line.split(" s  ", 1)[1] for line in result.stderr.splitlines()]
    assert stages == ["loading", "running the original", "running the rewritten",
                      "timing both in turns"], result.stderr
    assert run_cli("-q", "verify", MLP, out, "--runs", "1").stderr == ""


def test_measuring_workers_start_deaf_to_ctrl_c():
    """Ctrl-C reaches the terminal's whole process group: `verify`'s workers start with SIGINT
    ignored (a worker keeps that), so only the command reports it, in one line (exit 130)."""
    import signal

    from graphrewrite.execution import measure

    before = signal.getsignal(signal.SIGINT)
    with measure.deaf_to_ctrl_c():
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == before


def test_a_bug_outside_the_passes_is_exit_3_naming_it(monkeypatch, tmp_path):
    """Anything but a refused input is graphrewrite's own failure: exit 3, one line."""
    from graphrewrite.core import io

    def broken(*args, **kwargs):
        raise KeyError("lost")

    monkeypatch.setattr(io, "load", broken)
    result = run_cli("inspect", fixture_path("mlp"))
    assert result.exit_code == 3
    assert result.stderr.strip().splitlines() == [
        "graphrewrite: error: internal error (a bug in graphrewrite): KeyError: 'lost' "
        "(--debug shows where)"]


def test_a_bug_in_the_report_leaves_no_output_behind(monkeypatch, tmp_path):
    """The report is made before the rewritten graph is written: exit 3 writes nothing."""
    from graphrewrite.cli import main

    def broken(facts):
        raise KeyError("lost")

    monkeypatch.setattr(main, "format_optimize", broken)
    result = run_cli("optimize", MLP, "-o", tmp_path / "o.pbtxt", "--mode", "none",
                     "--no-as-run", "--report", tmp_path / "r.json", "--plan-out",
                     tmp_path / "p.json")
    assert result.exit_code == 3, result.output
    assert "KeyError: 'lost'" in result.stderr
    assert sorted(tmp_path.iterdir()) == []


def test_inspect_lists_the_outputs_it_modelled():
    """`--outputs` is what the step fetches: the summary lists those, not the defaults."""
    import json

    result = run_cli("inspect", fixture_path("mlp"), "--json", "--outputs", "outputs/loss")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["outputs"] == ["outputs/loss"]
    default = json.loads(run_cli("inspect", fixture_path("mlp"), "--json").stdout)["outputs"]
    assert "outputs/loss" in default and len(default) > 1
