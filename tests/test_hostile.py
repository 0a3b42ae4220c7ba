"""Hostile input: one line on stderr naming the file, exit code 2, no traceback, no output."""

import random

import pytest

from conftest import fixture_path, graph_def, run_cli

RESNET = fixture_path("resnet_cnn").read_bytes()


def node_boundary_cut(data: bytes) -> int:
    """Offset just after the 10th node record: a cut protobuf parses without complaint."""
    offset = 0
    for _ in range(10):
        assert data[offset] == 0x0A  # field 1 (node), length-delimited
        length, shift, pos = 0, 0, offset + 1
        while True:
            byte = data[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            shift += 7
            if not byte & 0x80:
                break
        offset = pos + length
    return offset


def write(path, content):
    path.write_bytes(content)
    return path


CASES = {
    "empty file": (lambda d: write(d / "empty.pb", b""), "the file is empty"),
    "random bytes": (lambda d: write(d / "random.pb", random.Random(1).randbytes(4096)),
                     "not a TensorFlow GraphDef"),
    "truncated mid-node": (lambda d: write(d / "cut.pb", RESNET[: len(RESNET) // 2]),
                           "not a TensorFlow GraphDef"),
    "truncated at a node boundary": (
        lambda d: write(d / "cut.pb", RESNET[: node_boundary_cut(RESNET)]), "truncated"),
    "truncated before versions": (lambda d: write(d / "cut.pb", _without_versions(RESNET)),
                                  "no 'versions' record"),
    "directory, not a SavedModel": (lambda d: (d / "dir").mkdir() or d / "dir",
                                    "not a SavedModel"),
    "missing path": (lambda d: d / "nowhere.pb", "no such file"),
    "cycle": (lambda d: write(d / "cycle.pb", graph_def(
        ("a", "Relu", ["b"]), ("b", "Relu", ["a"])).SerializeToString()), "cycle"),
    "duplicate names": (lambda d: write(d / "dup.pb", graph_def(
        ("a", "NoOp", []), ("a", "NoOp", [])).SerializeToString()), "duplicate node name 'a'"),
    "dangling input": (lambda d: write(d / "dangling.pb", graph_def(
        ("a", "Relu", ["ghost"])).SerializeToString()), "no node 'ghost'"),
    "swap hint out of range (crashes Grappler)": (
        lambda d: write(d / "hinted.pb", _swap_hint(7).SerializeToString()),
        "_swap_to_host names input 7, but it has 1 data inputs"),
    "broken text proto": (lambda d: write(d / "broken.pbtxt", b'node {\n  name: "a"\n  op: '),
                          "broken text proto"),
    "unexpected text": (lambda d: write(d / "notes.pbtxt", b"hello: world\n"),
                        "unexpected field 'hello'"),
    "over protobuf's 2 GB limit": (lambda d: _sparse(d / "huge.pb", 3 * 2**30),
                                   "over protobuf's 2 GiB limit"),
}


def _without_versions(data: bytes) -> bytes:
    """A whole graph cut just before its trailing `versions` record (field 4, written last)."""
    from tensorflow.core.framework import graph_pb2

    graph = graph_pb2.GraphDef.FromString(data)
    graph.ClearField("versions")
    cut = graph.SerializeToString(deterministic=True)
    assert data.startswith(cut)
    return cut


def _swap_hint(index):
    hinted = graph_def(("x", "Placeholder", []), ("a", "Relu", ["x"]))
    hinted.node[1].attr["_swap_to_host"].i = index
    return hinted


def _sparse(path, size):
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


@pytest.mark.parametrize("command", ["optimize", "inspect", "dump"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_one_line_and_exit_2(case, command, tmp_path):
    make, expected = CASES[case]
    bad = make(tmp_path)
    out = tmp_path / "out.pb"
    extra = ["-o", out, "--mode", "none"] if command == "optimize" else []
    result = run_cli(command, bad, *extra)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("graphrewrite: error: ") and bad.name in lines[0]
    assert expected in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != bad.name) == []


def test_truncation_anywhere_is_refused(tmp_path):
    """Every cut of a real graph is refused: protobuf errors, or our checks catch the rest."""
    rng = random.Random(3)
    for cut in sorted(rng.sample(range(1, len(RESNET)), 40)):
        path = write(tmp_path / "cut.pb", RESNET[:cut])
        result = run_cli("inspect", path)
        assert result.exit_code == 2, (cut, result.stdout[:200])


def test_unknown_op_is_a_warning_not_a_refusal(tmp_path):
    path = write(tmp_path / "custom.pb", graph_def(
        ("x", "Placeholder", []), ("y", "MyCustomOp", ["x"])).SerializeToString())
    out = tmp_path / "out.pb"
    result = run_cli("optimize", path, "-o", out, "--mode", "none")
    assert result.exit_code == 0
    assert "warning: " in result.stderr and "MyCustomOp" in result.stderr
    assert out.exists()


def test_debug_shows_a_traceback(tmp_path):
    result = run_cli("--debug", "inspect", write(tmp_path / "empty.pb", b""))
    assert result.exit_code == 2
    assert "Traceback" in result.stderr


# Hostile command lines (after `optimize IN`, where IN is a copy of a fixture in a fresh
# directory): each is refused with one line naming what is wrong, exit 2, nothing written.
CLI_CASES = {
    "output is the input": (lambda src: ["-o", src], "the output is the input"),
    "output is the input through a link": (
        lambda src: ["-o", _link(src.parent / "link.pbtxt", src)], "the output is the input"),
    "output is a hard link to the input": (
        lambda src: ["-o", _hard_link(src.parent / "same.pbtxt", src)], "the output is the input"),
    "unreadable pipeline": (lambda src: ["--passes", "!!"], "cannot read '!!'"),
    "unreadable text before a pass": (lambda src: ["--passes", "!! recompute"],
                                      "cannot read '!! recompute'"),
    "unclosed options": (lambda src: ["--passes", "recompute("], "cannot read 'recompute('"),
    "blank pipeline": (lambda src: ["--passes", " "], "--passes ' ' names no pass"),
    "empty pipeline": (lambda src: ["--passes", ""], "use --mode none"),
    "semicolon between passes": (lambda src: ["--passes", "recompute; swap"],
                                 "cannot read '; swap' (passes are separated by spaces"),
    "integer option not an integer": (
        lambda src: ["--passes", "accumulate(min_inputs=x)"],
        "pass 'accumulate': option 'min_inputs' expects an integer, not 'x'"),
    "number option not a number": (lambda src: ["--passes", "swap(bandwidth=x)"],
                                   "pass 'swap': option 'bandwidth' expects a number, not 'x'"),
    "budget zero": (lambda src: ["--budget", "0"], "a budget must be positive"),
    "budget zero percent": (lambda src: ["--budget", "0%"], "a budget must be positive"),
    "budget negative": (lambda src: ["--budget", "-2GiB"], "a budget must be positive"),
    "backward scope naming no node": (  # it read as "no backward pass found", exit 0
        lambda src: ["--backward-scope", "nonexistent/"],
        "no node's name starts with --backward-scope 'nonexistent/'"),
}


def _link(link, target):
    link.symlink_to(target)
    return link


def _hard_link(link, target):
    import os

    os.link(target, link)
    return link


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_hostile_command_lines_are_refused_with_one_line(case, tmp_path):
    source = tmp_path / "model.pbtxt"
    source.write_bytes(fixture_path("mlp").read_bytes())
    args, expected = CLI_CASES[case]
    arguments = args(source)
    if "-o" not in arguments:
        arguments += ["-o", tmp_path / "out.pbtxt"]
    before = sorted(tmp_path.iterdir())
    result = run_cli("optimize", source, *arguments)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphrewrite: error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert sorted(tmp_path.iterdir()) == before  # nothing written, nothing left behind
    assert source.read_bytes() == fixture_path("mlp").read_bytes()


def test_a_tf2_step_exported_without_shapes_is_refused_before_planning(tmp_path):
    """A TF2 step's captured variables record their shapes only in `_output_shapes`: exported
    without them (a CTC step built outside the repo), the memory model saw 120 of its 311 MiB,
    optimize wrote a plan made on that, and verify refused the result. It is refused at once,
    with what to do."""
    from tensorflow.core.framework import graph_pb2

    unshaped = graph_pb2.GraphDef.FromString(fixture_path("keras_step_tf2").read_bytes())
    for node in unshaped.node:
        node.attr.pop("_output_shapes", None)
    path = write(tmp_path / "unshaped.pb", unshaped.SerializeToString())
    out = tmp_path / "out.pb"
    result = run_cli("optimize", path, "-o", out)
    assert result.exit_code == 2 and not out.exists()
    assert "add_shapes=True" in result.stderr and "Traceback" not in result.stderr

