"""Rewrite a TF2 training step inside the running program and run it on the same variables.

`rewrite(fn, *input_signature)` traces the `tf.function` (or takes a concrete function), exports
its graph with shapes, runs the same pipeline as `graphrewrite optimize`, and returns a
`RewrittenStep`: a function with the original's arguments and outputs that imports the rewritten
graph with every captured placeholder bound to what the original captured (its variables'
handles, not copies), so the step's updates land in the program's own variables, optimizer slots
and batch-norm statistics. It is a `tf.function` underneath: callable eagerly and from inside
another `tf.function`, placed by the devices the graph names (a GPU where the program has one).
"""

from __future__ import annotations

import logging
from pathlib import Path

from . import io, pipeline, report as report_mod, split as split_mod
from .errors import GraphRewriteError
from .graph import Graph

log = logging.getLogger(__name__)


class StepError(GraphRewriteError):
    """A function that cannot be rewritten as a training step (no gradient, unknown shapes,
    a capture that is not a tensor)."""


class RewrittenStep:
    """The rewritten step: call it like the original. `.report` is `optimize --json`'s dict,
    `.graph_def` the rewritten GraphDef, `.function` the underlying concrete function."""

    def __init__(self, function, structured_outputs, graph_def, report: dict):
        self.function = function
        self.graph_def = graph_def
        self.report = report
        self._structure = structured_outputs

    def __call__(self, *args):
        import tensorflow as tf

        flat = self.function(*args)
        return tf.nest.pack_sequence_as(self._structure, flat, expand_composites=True)


def rewrite(fn, *input_signature, mode: str = "memory", budget: str | None = None,
            **options) -> RewrittenStep:
    """Rewrite the training step `fn` with `mode` (and `budget`, and the pipeline options of
    `pipeline.compose`) and return the function that runs the result on fn's own variables.

    `fn` is a `tf.function` (its own `input_signature`, or the `tf.TensorSpec`s given here) or a
    concrete function. Every argument must be a tensor of fully known shape."""
    import tensorflow as tf

    concrete = _concrete(fn, input_signature)
    graph = concrete.graph
    name = concrete.name.decode() if isinstance(concrete.name, bytes) else concrete.name
    captured = {id(t) for t in graph.internal_captures}
    inputs = [t for t in graph.inputs if id(t) not in captured]
    unknown = [t for t in inputs if not t.shape.is_fully_defined()]
    if unknown:
        raise StepError(f"argument '{unknown[0].name}' has shape {unknown[0].shape}; trace the "
                        "step with fully defined tf.TensorSpec shapes (the memory model needs "
                        "every size)")
    graph_def = graph.as_graph_def(add_shapes=True)
    model = io.Model(Path(f"<{name}>"), io.Format(io.GRAPHDEF), graph_def,
                     Graph.from_graph_def(graph_def))
    if not split_mod.split(model.graph).seeds:
        raise StepError(f"'{name}' computes no gradient: there is no training step to "
                        "rewrite (an inference function keeps no activations for a backward "
                        "pass)")
    text = pipeline.compose(mode, budget=budget, **options)
    result = pipeline.optimize(model, mode, composed=text)
    rewritten = result.graph.to_graph_def()
    outputs = [t.name for t in graph.outputs]
    bindings = [(placeholder.name, handle) for placeholder, handle in
                zip(graph.internal_captures, concrete.captured_inputs)]
    names = [t.name for t in inputs]

    def imported(*args):
        outer = tf.compat.v1.get_default_graph()
        input_map = {name: outer.capture(handle) for name, handle in bindings}
        input_map.update(zip(names, args))
        return tf.graph_util.import_graph_def(rewritten, input_map=input_map,
                                              return_elements=outputs, name="")

    specs = [tf.TensorSpec(t.shape, t.dtype, name=t.op.name) for t in inputs]
    # A tf.function, not a v1 wrapped one: its automatic control dependencies make every update
    # of the imported graph a control output, so a caller that inlines it (another tf.function)
    # still orders one step's updates before the next step's reads.
    function = tf.function(imported, input_signature=specs, autograph=False)
    facts = report_mod.optimize_report(model.path, "<in memory>", model.format, result)
    log.info("rewrote %s: %d -> %d nodes", name, result.nodes_before,
             result.nodes_after)
    return RewrittenStep(function, concrete.structured_outputs, rewritten, facts)


def _concrete(fn, input_signature):
    """The concrete function to rewrite."""
    if hasattr(fn, "get_concrete_function"):
        try:
            return fn.get_concrete_function(*input_signature)
        except (TypeError, ValueError) as err:
            raise StepError(f"cannot trace the step: {err}") from None
    if hasattr(fn, "graph") and hasattr(fn, "captured_inputs"):
        return fn
    raise StepError(f"expected a tf.function or a concrete function, got {type(fn).__name__}")
