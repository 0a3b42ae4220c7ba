"""Reading and writing models: GraphDef, MetaGraphDef (binary or text) and SavedModel directories.

The format is detected from the content (the extension only breaks ties). A `Model` keeps the whole
container message so that everything around the graph (function library, versions, collections,
signatures, saver, debug info, other MetaGraphs of a SavedModel) is written back untouched, and an
unchanged graph comes back as an equal message. Writes are atomic: a temporary sibling renamed into
place, nothing left behind on failure. They behave as `cp` does: a new file gets the umask's mode
(an existing one keeps its own), missing directories are created, and a symlink is written through
(its target is replaced, the link stays). Writing over the input is refused unless asked for.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import message as pb_message
from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from . import ops
from .errors import GraphRewriteError, InputError
from .graph import Graph

__all__ = ["GRAPHDEF", "METAGRAPH", "SAVEDMODEL", "KINDS", "PROTOBUF_LIMIT", "SAVEDMODEL_FILES",
           "TEXT_FIELDS", "RESTORE_FROM", "Format", "Model", "load", "select_meta_graph",
           "output_format", "serialize", "refuse_overwriting", "save", "FILE_SUFFIXES",
           "write_atomic"]

log = logging.getLogger(__name__)

GRAPHDEF, METAGRAPH, SAVEDMODEL = "graphdef", "metagraph", "savedmodel"
KINDS = {GRAPHDEF: graph_pb2.GraphDef, METAGRAPH: meta_graph_pb2.MetaGraphDef,
         SAVEDMODEL: saved_model_pb2.SavedModel}
PROTOBUF_LIMIT = 2**31 - 1  # protobuf refuses messages of 2 GiB and more
SAVEDMODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
# Top-level field names that tell the kinds apart in a text proto.
TEXT_FIELDS = {
    GRAPHDEF: {"node", "versions", "library", "debug_info", "version"},
    METAGRAPH: {"meta_info_def", "graph_def", "saver_def", "collection_def", "signature_def",
                "asset_file_def", "object_graph_def"},
    SAVEDMODEL: {"saved_model_schema_version", "meta_graphs"},
}
RESTORE_FROM = "graphrewrite_restore_from"  # `Model.runnable`: a SavedModel's checkpoint
_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_>.\-]*\Z")


@dataclass(frozen=True)
class Format:
    """How a model is stored: its kind (graphdef, metagraph, savedmodel) and text or binary."""

    kind: str
    text: bool = False

    def __str__(self) -> str:
        return self.kind + ("-text" if self.text else "")


@dataclass
class Model:
    """A loaded model: the container message, where its graph is, and the graph itself."""

    path: Path
    format: Format
    container: pb_message.Message
    graph: Graph
    meta_graph_index: int | None = None  # which MetaGraph of a SavedModel holds the graph
    warnings: list[str] = field(default_factory=list)

    @property
    def meta_graph(self) -> meta_graph_pb2.MetaGraphDef | None:
        if self.format.kind == METAGRAPH:
            return self.container
        if self.format.kind == SAVEDMODEL:
            return self.container.meta_graphs[self.meta_graph_index]
        return None

    def runnable(self) -> pb_message.Message:
        """What a session imports: the MetaGraphDef itself (its variables and collections come
        along), else the GraphDef. A SavedModel's MetaGraphDef names its variables' checkpoint
        in the collection RESTORE_FROM: a session restores them from it, as TensorFlow's loader
        does, instead of running initialisers (a TF2 SavedModel has none)."""
        if self.format.kind == METAGRAPH:
            return self.container
        if self.format.kind != SAVEDMODEL:
            return self.graph.to_graph_def()
        meta = meta_graph_pb2.MetaGraphDef()
        meta.CopyFrom(self.meta_graph)
        prefix = self.path / "variables" / "variables"
        if meta.saver_def.restore_op_name and prefix.with_suffix(".index").is_file():
            meta.collection_def[RESTORE_FROM].bytes_list.value.append(str(prefix).encode())
        return meta

    def with_graph(self, graph: Graph | None = None) -> pb_message.Message:
        """A copy of the container with `graph` (default: the model's own) in place of the old."""
        graph_def = (graph or self.graph).to_graph_def()
        if self.format.kind == GRAPHDEF:  # the container is the old GraphDef: nothing to copy
            return graph_def
        out = type(self.container)()
        out.CopyFrom(self.container)
        target = out if self.format.kind == METAGRAPH else out.meta_graphs[self.meta_graph_index]
        target.graph_def.CopyFrom(graph_def)
        if graph is not None:  # collections naming removed or new variables (diet's slots)
            from . import metagraph

            metagraph.sync(target, self.graph, graph)
        return out


# --------------------------------------------------------------------------- loading

def load(path: str | os.PathLike, tag: str | None = None) -> Model:
    """Read a model file or SavedModel directory; raise InputError on anything unusable.

    Structural problems (`Graph.check`) are fatal here: a dangling input, a cycle or a duplicate
    name is what a truncated or corrupt file looks like after protobuf parsed it without complaint.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(path, "no such file or directory")
    if path.is_dir():
        fmt, container = _read_saved_model(path)
    else:
        data = _read_bytes(path)
        fmt, container = _parse(path, data)
    graph_def, index = _graph_def_of(path, fmt, container, tag)
    if not graph_def.HasField("versions"):
        raise InputError(path, "the graph has no 'versions' record; the file looks truncated")
    graph = Graph.from_graph_def(graph_def)
    problems = graph.check()
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise InputError(path, f"invalid graph: {problems[0]}{more}")
    model = Model(path, fmt, container, graph, index)
    model.warnings.extend(_unknown_op_warnings(graph_def) + _drop_dangling_entries(model))
    for warning in model.warnings:
        log.warning("%s: %s", path, warning)
    return model


def _read_bytes(path: Path) -> bytes:
    size = path.stat().st_size
    if size == 0:
        raise InputError(path, "the file is empty")
    if size > PROTOBUF_LIMIT:
        raise InputError(path, f"the file is {size / 2**30:.1f} GiB, over protobuf's 2 GiB limit "
                               "for one message")
    try:
        return path.read_bytes()
    except OSError as err:
        raise InputError(path, f"cannot read: {err.strerror or err}") from None


def _read_saved_model(path: Path) -> tuple[Format, saved_model_pb2.SavedModel]:
    for name in SAVEDMODEL_FILES:
        if (path / name).is_file():
            data = _read_bytes(path / name)
            fmt, container = _parse(path / name, data, expect=SAVEDMODEL)
            return Format(SAVEDMODEL, fmt.text), container
    raise InputError(path, "a directory that is not a SavedModel (no saved_model.pb or "
                           "saved_model.pbtxt in it)")


def _parse(path: Path, data: bytes, expect: str | None = None) -> tuple[Format, pb_message.Message]:
    text = _as_text(data)
    if text is not None:
        kind = expect or _text_kind(path, text)
        message = KINDS[kind]()
        try:
            text_format.Parse(text, message)
        except text_format.ParseError as err:
            raise InputError(path, f"broken text proto ({kind}): {err}") from None
        return Format(kind, text=True), message
    candidates = [expect] if expect else _kind_preference(path)
    for kind in candidates:
        message = KINDS[kind]()
        try:
            message.ParseFromString(data)
        except (pb_message.DecodeError, RuntimeError, ValueError):
            continue
        if _plausible(kind, message):
            return Format(kind), message
    raise InputError(path, "not a TensorFlow GraphDef, MetaGraphDef or SavedModel (binary or "
                           "text protobuf); the file is corrupt or of another kind")


def _as_text(data: bytes) -> str | None:
    """The content as text if it looks like a text proto (printable UTF-8 with a field name)."""
    if b"\x00" in data[:4096]:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    first = _first_field(text)
    return text if first is not None else None


def _first_field(text: str) -> str | None:
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s*[:{<]", stripped)
        return match.group(1) if match else None
    return None


def _text_kind(path: Path, text: str) -> str:
    first = _first_field(text)
    for kind, names in TEXT_FIELDS.items():
        if first in names:
            return kind
    raise InputError(path, f"text proto starts with an unexpected field '{first}' (expected a "
                           "GraphDef, MetaGraphDef or SavedModel)")


def _kind_preference(path: Path) -> list[str]:
    """Binary kinds to try, the one the file name suggests first."""
    name = path.name.lower()
    if name.endswith(".meta"):
        return [METAGRAPH, GRAPHDEF, SAVEDMODEL]
    if name == "saved_model.pb":
        return [SAVEDMODEL, METAGRAPH, GRAPHDEF]
    return [GRAPHDEF, METAGRAPH, SAVEDMODEL]


def _plausible(kind: str, message: pb_message.Message) -> bool:
    """Whether a successful binary parse really is that kind (protobuf accepts a lot)."""
    if kind == GRAPHDEF:
        return len(message.node) > 0 and all(n.name and _OP_NAME.match(n.op)
                                              for n in message.node)
    if kind == METAGRAPH:
        return message.HasField("graph_def") and _plausible(GRAPHDEF, message.graph_def)
    return len(message.meta_graphs) > 0 and all(
        _plausible(METAGRAPH, m) for m in message.meta_graphs)


def _graph_def_of(path: Path, fmt: Format, container, tag: str | None):
    if fmt.kind == GRAPHDEF:
        if tag:
            raise InputError(path, "${tag} applies to SavedModels only")
        return container, None
    if fmt.kind == METAGRAPH:
        if not container.HasField("graph_def"):
            raise InputError(path, "the MetaGraphDef holds no graph_def")
        return container.graph_def, None
    index = select_meta_graph(path, container, tag)
    return container.meta_graphs[index].graph_def, index


def select_meta_graph(path: Path, saved_model, tag: str | None) -> int:
    """Index of the MetaGraph whose tag set is `tag` (comma-separated); default: the only one,
    else the one tagged exactly `serve`."""
    tag_sets = [frozenset(m.meta_info_def.tags) for m in saved_model.meta_graphs]
    available = "; ".join(",".join(sorted(t)) or "(no tags)" for t in tag_sets)
    if tag is None:
        if len(tag_sets) == 1:
            return 0
        wanted = frozenset({"serve"})
    else:
        wanted = frozenset(t.strip() for t in tag.split(",") if t.strip())
    matches = [i for i, tags in enumerate(tag_sets) if tags == wanted]
    if not matches:
        raise InputError(path, f"no MetaGraph tagged '{','.join(sorted(wanted))}'; available tag "
                               f"sets: {available} (choose one with ${{tag}})")
    return matches[0]


def _drop_dangling_entries(model: Model) -> list[str]:
    """Drop the collection entries naming nodes the graph lacks from the model (and so from
    what is written: TensorFlow's `import_meta_graph` refuses the file as it is); a warning
    for each collection."""
    from . import metagraph

    if model.meta_graph is None:
        return []
    found = metagraph.dangling(model.meta_graph, model.graph)
    metagraph.drop_dangling(model.meta_graph, found)
    return [f"collection '{key}' names {', '.join(repr(n) for n in names[:3])}"
            f"{' and more' if len(names) > 3 else ''}, not a node of the graph (an op made "
            "inside a cond branch or a loop body lives in that function; TensorFlow's "
            "import_meta_graph refuses the file): left out here and in what is written; "
            "give the step's outputs with ${fetches} if it is not found" for key, names
            in found.items()]


def _unknown_op_warnings(graph_def: graph_pb2.GraphDef) -> list[str]:
    functions = frozenset(f.signature.name for f in graph_def.library.function)
    unknown = sorted({n.op for n in graph_def.node if not ops.is_known(n.op, functions)})
    return [f"op '{op}' is not in TensorFlow's op registry (a custom op?); it is kept as is, "
            "but cannot be run or analysed" for op in unknown]


# --------------------------------------------------------------------------- saving

def output_format(model: Model, out: str | os.PathLike) -> Format:
    """The input's format, unless the output name asks for another (`.meta`, `.pbtxt`, `.pb`).

    SavedModels stay SavedModel directories unless the name ends in `.meta`.
    """
    name = Path(out).name.lower()
    kind = model.format.kind
    if name.endswith((".meta", ".meta.txt", ".meta.pbtxt")):
        kind = METAGRAPH
    if kind == SAVEDMODEL:
        return model.format
    if name.endswith((".pbtxt", ".txt")):
        return Format(kind, text=True)
    if name.endswith((".pb", ".meta")):
        return Format(kind, text=False)
    return Format(kind, model.format.text)


def serialize(message: pb_message.Message, text: bool) -> bytes:
    """Deterministic bytes of `message` (sorted maps) in binary or text form."""
    if text:
        return text_format.MessageToString(message).encode("utf-8")
    return message.SerializeToString(deterministic=True)


def refuse_overwriting(source: str | os.PathLike, out: str | os.PathLike) -> None:
    """A GraphRewriteError if `out` is the file (or SavedModel directory) `source`: the same
    path once symlinks are followed, or the same file under another name (a hard link)."""
    same = os.path.realpath(source) == os.path.realpath(out)
    if not same and os.path.exists(source) and os.path.exists(out):
        same = os.path.samefile(source, out)
    if same:
        raise GraphRewriteError(f"{out}: the output is the input {source} (${{in_place}} to "
                                "overwrite it)")


def save(model: Model, graph: Graph, out: str | os.PathLike, fmt: Format | None = None,
         in_place: bool = False, serialized: bytes | None = None) -> Format:
    """Write `graph` in the container of `model` to `out`, atomically; returns the format used.
    Writing over the model's own file is refused unless `in_place`. `serialized`: the bytes
    of a GraphDef model's `model.with_graph(graph)` in binary, if already made (the import
    check's), written as they are when the output is a binary GraphDef."""
    if not in_place:
        refuse_overwriting(model.path, out)
    fmt = fmt or output_format(model, out)
    given, out = out, _through_links(out)
    if serialized is not None and fmt == Format(GRAPHDEF, False) and \
            model.format.kind == GRAPHDEF:
        write_atomic(out, serialized, name=given)
        return fmt
    container = model.with_graph(graph)
    if fmt.kind == METAGRAPH and model.format.kind != METAGRAPH:
        container = _as_meta_graph(model, container)
    if fmt.kind == SAVEDMODEL:
        if Path(given).suffix.lower() in FILE_SUFFIXES:
            log.warning("%s: a SavedModel is written as a directory, named as given (end the "
                        "name in .meta for a MetaGraphDef file)", given)
        try:
            _save_saved_model(model, container, out, fmt.text)
        except OSError as err:
            raise GraphRewriteError(f"cannot write {given}: {_reason(err, out)}") from None
    else:
        write_atomic(out, serialize(container, fmt.text), name=given)
    return fmt


FILE_SUFFIXES = (".pb", ".pbtxt", ".txt")  # names that look like a file, not a SavedModel


def _reason(err: OSError, path) -> str:
    """Why a write failed, in a user's words: the OS's reason, and the directory it concerns
    when that is one of the output's parents (a parent that is a file); a temporary sibling's
    name would only confuse."""
    reason = err.strerror or str(err)
    if err.filename and Path(os.path.abspath(err.filename)) in Path(
            os.path.abspath(path)).parents:
        reason += f" ({err.filename})"
    return reason


def _as_meta_graph(model: Model, container) -> meta_graph_pb2.MetaGraphDef:
    if model.format.kind == SAVEDMODEL:
        return container.meta_graphs[model.meta_graph_index]
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(container)
    return meta


def _through_links(path: str | os.PathLike) -> Path:
    """Where a write to `path` lands: a symlink's target (the link itself stays)."""
    return Path(os.path.realpath(path))


def _mode_for(path: Path, fresh: int) -> int:
    """The permissions a write to `path` leaves: those of what is there (as `cp` keeps them),
    else `fresh` less the umask (mkstemp and mkdtemp would give 0600 and 0700)."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0o022)
        os.umask(umask)
        return fresh & ~umask


def write_atomic(path: str | os.PathLike, data: bytes, name: str | os.PathLike | None = None
                 ) -> None:
    """Write `data` to `path` via a temporary sibling and a rename: all or nothing. A failure
    (a read-only directory, a full disk) is a GraphRewriteError naming `name` (default: `path`)."""
    name, path = name or path, _through_links(path)
    try:
        _write_atomic(path, data)
    except OSError as err:
        raise GraphRewriteError(f"cannot write {name}: {_reason(err, path)}") from None


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), _mode_for(path, 0o666))
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_saved_model(model: Model, container, out: Path, text: bool) -> None:
    """Build the directory beside `out`, copying variables/ and assets/, then swap it in.

    `fingerprint.pb` is not copied: it hashes the old graph and would be stale.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    old = None
    try:
        tmp.chmod(_mode_for(out, 0o777))
        source = model.path
        for sub in ("variables", "assets", "assets.extra"):
            if (source / sub).is_dir():
                shutil.copytree(source / sub, tmp / sub)
        (tmp / SAVEDMODEL_FILES[int(text)]).write_bytes(serialize(container, text))
        if out.exists():
            old = out.parent / f".{out.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
