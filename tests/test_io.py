"""Loading and saving: every fixture round-trips to an equal message, in every format."""

import os
import random
import shutil
import stat

import pytest
from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from graphrewrite.core import io
from graphrewrite.core.errors import GraphRewriteError
from graphrewrite.core.text import dump

from conftest import FIXTURE_NAMES, fixture_path, graph_def, run_cli

EXPECTED_FORMAT = {"mlp": "graphdef-text", "adam_train": "metagraph", "keras_train": "metagraph",
                   "tiny_savedmodel": "savedmodel"}


def original_message(model):
    """The container read straight from disk, without going through our Graph."""
    path = model.path / "saved_model.pb" if model.path.is_dir() else model.path
    message = type(model.container)()
    if model.format.text:
        text_format.Parse(path.read_text(), message)
    else:
        message.ParseFromString(path.read_bytes())
    return message


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_unchanged_graph_comes_back_equal(name, tmp_path):
    model = io.load(fixture_path(name))
    assert str(model.format) == EXPECTED_FORMAT.get(name, "graphdef")
    assert model.with_graph() == original_message(model)
    out = tmp_path / fixture_path(name).name
    io.save(model, model.graph, out)
    again = io.load(out)
    assert again.format == model.format
    assert again.container == original_message(model)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_saving_is_deterministic(name, tmp_path):
    model = io.load(fixture_path(name))
    first, second = tmp_path / "a" / fixture_path(name).name, tmp_path / "b" / fixture_path(name).name
    io.save(model, model.graph, first)
    io.save(model, model.graph, second)
    files = sorted(p.relative_to(first) for p in first.rglob("*")) if first.is_dir() else [None]
    for rel in files:
        a, b = (first / rel, second / rel) if rel else (first, second)
        if a.is_file():
            assert a.read_bytes() == b.read_bytes(), rel


def test_shuffled_nodes_dump_identically(tmp_path):
    model = io.load(fixture_path("resnet_cnn"))
    shuffled = graph_pb2.GraphDef()
    shuffled.CopyFrom(model.container)
    nodes = list(shuffled.node)
    random.Random(7).shuffle(nodes)
    del shuffled.node[:]
    shuffled.node.extend(nodes)
    (tmp_path / "shuffled.pb").write_bytes(shuffled.SerializeToString())
    assert dump(io.load(tmp_path / "shuffled.pb").graph) == dump(model.graph)


def test_format_is_read_from_content_not_extension(tmp_path):
    binary_named_text = tmp_path / "graph.pbtxt"
    shutil.copy(fixture_path("resnet_cnn"), binary_named_text)
    assert str(io.load(binary_named_text).format) == "graphdef"
    text_named_binary = tmp_path / "graph.pb"
    shutil.copy(fixture_path("mlp"), text_named_binary)
    assert str(io.load(text_named_binary).format) == "graphdef-text"
    meta_named_pb = tmp_path / "model.pb"
    shutil.copy(fixture_path("adam_train"), meta_named_pb)
    assert str(io.load(meta_named_pb).format) == "metagraph"


def test_text_metagraph_round_trips(tmp_path):
    model = io.load(fixture_path("adam_train"))
    out = tmp_path / "adam.meta.txt"
    assert str(io.save(model, model.graph, out)) == "metagraph-text"
    again = io.load(out)
    assert str(again.format) == "metagraph-text"
    assert again.container == model.container


@pytest.mark.parametrize("out_name, expected", [
    ("o.pb", "graphdef"), ("o.pbtxt", "graphdef-text"), ("o.meta", "metagraph"),
    ("o.meta.txt", "metagraph-text"), ("o", "graphdef-text"),
])
def test_output_name_picks_format(out_name, expected, tmp_path):
    model = io.load(fixture_path("mlp"))
    assert str(io.save(model, model.graph, tmp_path / out_name)) == expected
    assert str(io.load(tmp_path / out_name).format) == expected


def test_graphdef_saved_as_meta_wraps_it(tmp_path):
    model = io.load(fixture_path("mlp"))
    io.save(model, model.graph, tmp_path / "m.meta")
    meta = meta_graph_pb2.MetaGraphDef()
    meta.ParseFromString((tmp_path / "m.meta").read_bytes())
    assert meta.graph_def == model.container


def test_saved_model_copies_variables_and_drops_stale_fingerprint(tmp_path):
    model = io.load(fixture_path("tiny_savedmodel"))
    out = tmp_path / "sm"
    io.save(model, model.graph, out)
    source = fixture_path("tiny_savedmodel")
    for variable_file in (source / "variables").iterdir():
        assert (out / "variables" / variable_file.name).read_bytes() == variable_file.read_bytes()
    assert not (out / "fingerprint.pb").exists()
    saved = saved_model_pb2.SavedModel()
    saved.ParseFromString((out / "saved_model.pb").read_bytes())
    assert saved == model.container
    # Writing over an existing SavedModel replaces it whole and leaves no temporary behind.
    io.save(model, model.graph, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sm"]


def test_saved_model_tag_selection(tmp_path):
    model = io.load(fixture_path("tiny_savedmodel"), tag="serve")
    assert model.meta_graph_index == 0
    with pytest.raises(io.InputError, match="no MetaGraph tagged 'train'.*available tag sets: "
                                            "serve"):
        io.load(fixture_path("tiny_savedmodel"), tag="train")
    # Two MetaGraphs: the default is the one tagged exactly 'serve'.
    two = saved_model_pb2.SavedModel()
    two.CopyFrom(model.container)
    extra = two.meta_graphs.add()
    extra.CopyFrom(two.meta_graphs[0])
    extra.meta_info_def.tags[:] = ["train"]
    directory = tmp_path / "two"
    directory.mkdir()
    (directory / "saved_model.pb").write_bytes(two.SerializeToString())
    assert io.load(directory).meta_graph_index == 0
    assert io.load(directory, tag="train").meta_graph_index == 1


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    model = io.load(fixture_path("mlp"))

    def broken(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)  # a file's write
    with pytest.raises(GraphRewriteError, match="cannot write .*out.pb: No space left"):
        io.save(model, model.graph, tmp_path / "out.pb")
    monkeypatch.setattr(io, "serialize", broken)  # a SavedModel's
    with pytest.raises(GraphRewriteError, match="cannot write .*sm: No space left"):
        io.save(io.load(fixture_path("tiny_savedmodel")), model.graph, tmp_path / "sm")
    assert list(tmp_path.iterdir()) == []


def test_unknown_op_is_a_warning(tmp_path, caplog):
    path = tmp_path / "custom.pb"
    path.write_bytes(graph_def(("x", "Placeholder", []),
                               ("y", "MyCustomOp", ["x"])).SerializeToString())
    model = io.load(path)
    assert any("MyCustomOp" in w for w in model.warnings)
    assert "MyCustomOp" in caplog.text


def test_collections_naming_nodes_the_graph_lacks_are_dropped_with_a_warning(tmp_path, caplog):
    """TF1 gradient accumulation applying Adam inside a `tf.cond` (control flow v2): the
    optimizer put its op, which lives in the branch's function, in `train_op`. TensorFlow's
    own `import_meta_graph` refused the file (KeyError), and verify exited 3 on it."""
    import tensorflow as tf

    message = original_message(io.load(fixture_path("adam_train")))
    message.collection_def["train_op"].node_list.value.append("Adam_in_branch")
    message.collection_def["only_ghosts"].node_list.value.append("ghost:0")
    path = tmp_path / "dangling.meta"
    path.write_bytes(message.SerializeToString())
    model = io.load(path)
    assert "collection 'train_op' names 'Adam_in_branch', not a node of the graph" in caplog.text
    assert "Adam_in_branch" not in model.meta_graph.collection_def["train_op"].node_list.value
    assert "only_ghosts" not in model.meta_graph.collection_def  # emptied: gone
    out = tmp_path / "written.meta"
    io.save(model, model.graph, out)
    with tf.Graph().as_default():
        tf.compat.v1.train.import_meta_graph(str(out))  # raised KeyError on the input


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_written_files_get_the_umasks_mode_as_cp_gives(tmp_path, umask_022):
    model = io.load(fixture_path("mlp"))
    out = tmp_path / "new" / "mlp.pbtxt"  # a missing directory is created
    io.save(model, model.graph, out)
    assert _mode(out) == 0o644 and _mode(out.parent) == 0o755
    out.chmod(0o600)  # an existing file keeps its own mode
    io.save(model, model.graph, out)
    assert _mode(out) == 0o600
    saved = io.load(fixture_path("tiny_savedmodel"))
    directory = tmp_path / "sm"
    io.save(saved, saved.graph, directory)
    assert _mode(directory) == 0o755 and _mode(directory / "saved_model.pb") == 0o644


def test_a_symlink_is_written_through(tmp_path):
    model = io.load(fixture_path("mlp"))
    target = tmp_path / "real.pbtxt"
    target.write_text("old")
    link = tmp_path / "link.pbtxt"
    link.symlink_to(target)
    io.save(model, model.graph, link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert io.load(target).container == model.container
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.pbtxt", "real.pbtxt"]


def test_writing_over_the_input_needs_in_place(tmp_path):
    source = tmp_path / "model.pbtxt"
    source.write_bytes(fixture_path("mlp").read_bytes())
    model = io.load(source)
    with pytest.raises(GraphRewriteError, match="the output is the input"):
        io.save(model, model.graph, tmp_path / "." / "model.pbtxt")
    result = run_cli("optimize", source, "-o", source, "--in-place")
    assert result.exit_code == 0, result.stderr
    assert io.load(source).graph.__len__() > len(model.graph)  # rewritten in place


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)
