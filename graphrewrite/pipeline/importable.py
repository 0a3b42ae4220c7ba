"""The last check before a rewrite is written: TensorFlow imports it, and its init ops still
initialise every variable.

`Graph.check` sees structure only. TensorFlow's importer also runs every op's shape function
against the `_output_shapes` the graph records, checks dtypes and attributes, and, for a
MetaGraphDef, rebuilds the variables and the Saver from its collections: a pass's slip there
(diet's embedding read, issue 31) would reach the user as a file no session loads. And an init
op (`global_variables_initializer()`'s `init`, the Saver's restore) that ran every variable's
initializer before the rewrite must still do so after it, or the user has to build a new one.

A failure is a PassError naming the first pass whose output fails, unless the original fails the
same check (then it is the input's, not graphrewrite's: a custom op, an old graph), which is
logged and let through. One import of the final graph per rewrite, by the C++ importer alone for
a GraphDef (`tf_import`), of the bytes `io.save` then writes; the passes' own outputs are
imported only to name the culprit.
"""

from __future__ import annotations

import logging

from ..core import lifetime, tf_import
from ..core.errors import PassError
from ..core.graph import Graph
from ..core.io import GRAPHDEF, METAGRAPH, Model, serialize

__all__ = ["VARIABLES", "INITIALIZES", "check", "importing", "uninitialised"]

log = logging.getLogger(__name__)

VARIABLES = ("VarHandleOp", "VariableV2", "Variable")
INITIALIZES = ("Assign", "AssignVariableOp")


def check(model: Model, made: list[tuple[str, list[str], Graph]]):
    """Raise a PassError if the last graph of `made` ((pass, passes before it, its output) in
    order) cannot be imported as `io.save` would write it, or leaves a variable its init ops
    initialised uninitialised; the error names the first pass that did it. Returns the bytes
    of the binary GraphDef imported when the C++ importer alone read them, for `io.save` to
    write instead of building and serializing it again (a few seconds at 150k nodes), else
    None."""
    if not made:
        return None
    built = []
    problem = _problem(model, made[-1][2], built)
    if problem is None:
        return built[0] if built else None
    if _problem(model, model.graph) is not None:
        log.warning("the rewritten graph was not checked: TensorFlow cannot import the "
                    "original either (%s)", problem)
        return None
    for name, before, graph in made:
        found = _problem(model, graph) if graph is not made[-1][2] else problem
        if found is not None:
            raise PassError(name, before, f"left a graph {found}")
    return None


def _problem(model: Model, graph: Graph, built: list | None = None) -> str | None:
    return importing(model, graph, built) or uninitialised(model.graph, graph)


def importing(model: Model, graph: Graph, built: list | None = None) -> str | None:
    """Why TensorFlow cannot import `graph` in `model`'s container (as `io.save` writes it:
    a MetaGraphDef with its collections and Saver), or None. The bytes of a GraphDef the C++
    importer alone read (binary, deterministic: as `io.save` writes them) are appended to
    `built`."""
    import tensorflow as tf

    message = model.with_graph(graph)
    kind = model.format.kind
    try:
        if kind == GRAPHDEF and not message.library.function:
            serialized = serialize(message, text=False)
            if _c_imports(message, serialized):
                if built is not None:
                    built.append(serialized)
                return None
        with tf.Graph().as_default():
            if kind == GRAPHDEF:
                tf.graph_util.import_graph_def(message, name="")
            else:
                meta = message if kind == METAGRAPH else \
                    message.meta_graphs[model.meta_graph_index]
                tf.compat.v1.train.import_meta_graph(meta)
    except Exception as err:  # noqa: BLE001  (whatever TensorFlow raises: it did not import)
        return f"TensorFlow cannot import ({type(err).__name__}: " \
               f"{(str(err).strip().splitlines() or [''])[0][:300]})"
    return None


def _c_imports(graph_def, serialized: bytes) -> bool:
    """Whether the C++ importer took `graph_def` (`serialized`: its bytes; a function library
    aside, all the public importer checks: its Python side only wraps the operations,
    `tf_import`), or False when TensorFlow's internals differ and the public importer must
    say. Raises what the importer raises."""
    try:
        lifetime.hold(tf_import.c_import(graph_def, validate_colocation=True,
                                         serialized=serialized))
    except (AttributeError, ImportError) as err:  # not this TensorFlow's internals
        log.debug("import checked by the public importer (%s)", err)
        return False
    return True


def uninitialised(original: Graph, graph: Graph) -> str | None:
    """Which init op of `original` (a NoOp waiting, directly or through NoOps, for an
    initializer or restore of every variable) leaves variables of `graph` out, or None."""
    everything = _variables(original)
    if not everything:
        return None
    before = _covered(original)
    now = _covered(graph)
    variables = _variables(graph)
    for op in sorted(n for n, found in before.items() if found >= everything):
        missing = sorted(variables - now.get(op, set())) if op in graph else []
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            return (f"in which '{op}', which initialised or restored every variable, leaves "
                    f"variable '{missing[0]}'{more} out")
    return None


def _variables(graph: Graph) -> set[str]:
    return {n for n in graph.nodes() if graph.op(n) in VARIABLES}


def _covered(graph: Graph) -> dict[str, set[str]]:
    """NoOp -> the variables whose assigns it waits for, through other NoOps."""
    memo: dict[str, set[str]] = {}

    def cover(noop: str) -> set[str]:
        if noop not in memo:
            memo[noop] = set()  # a cycle of NoOps would be refused by `Graph.check`
            found = set()
            for before in graph.control_inputs(noop):
                op = graph.op(before)
                if op == "NoOp":
                    found |= cover(before)
                elif op in INITIALIZES and graph.data_inputs(before):
                    found.add(graph.data_inputs(before)[0].node)
            memo[noop] = found
        return memo[noop]

    for name in graph.nodes():
        if graph.op(name) == "NoOp":
            cover(name)
    return memo
