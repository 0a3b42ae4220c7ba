"""Rewrite a TF2 training step inside the running program and run it on the same variables.

`rewrite(fn, *input_signature)` traces the `tf.function` (or takes a concrete function), exports
its graph with shapes, runs the same pipeline as `graphrewrite optimize`, and returns a
`RewrittenStep`: a function with the original's arguments and outputs that imports the rewritten
graph with every captured placeholder bound to what the original captured (its variables'
handles, not copies), so the step's updates land in the program's own variables, optimizer slots
and batch-norm statistics. It is a `tf.function` underneath: callable eagerly and from inside
another `tf.function`, placed by the devices the graph names (a GPU where the program has one).

A lossy rewrite changes the variables themselves (`mode="diet"`: 16-bit weights, new optimizer
slots, slots removed). The step then runs on variables of its own, made here: each dieted
weight's 16-bit variable starts from the program's value, quantized; each new slot starts at
zero; removed slots are not bound. `RewrittenStep.variables` lists them and `write_back()`
stores the dieted weights, dequantized, in the program's own variables (to save or evaluate
the model with its own code).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .analysis import bind
from .analysis import shapes as shapes_mod
from .analysis import split as split_mod
from .core import io
from .core.errors import GraphRewriteError
from .core.graph import Graph
from .pipeline import grammar, levers
from .pipeline import run as pipeline
from .reporting import report as report_mod

__all__ = ["StepError", "RewrittenStep", "rewrite"]

log = logging.getLogger(__name__)


class StepError(GraphRewriteError):
    """A function that cannot be rewritten as a training step (no gradient, unknown shapes,
    a capture that is not a tensor)."""


class RewrittenStep:
    """The rewritten step: call it like the original. `.report` is `optimize --json`'s dict,
    `.graph_def` the rewritten GraphDef, `.function` the underlying concrete function."""

    def __init__(self, function, structured_outputs, graph_def, report: dict,
                 variables: dict | None = None, originals: dict | None = None,
                 signature: "_Signature | None" = None):
        self.function = function
        self._signature = signature
        self.graph_def = graph_def
        self.report = report
        self.variables = variables or {}  # placeholder -> tf.Variable made for this step
        self._originals = originals or {}  # placeholder -> (program's handle, diet mark)
        self._structure = structured_outputs

    def write_back(self) -> None:
        """Store each dieted weight, dequantized, in the program's own float variable."""
        import tensorflow as tf

        for name, (handle, mark) in self._originals.items():
            fmt, _, scale = mark.partition(" ")
            value = tf.cast(self.variables[name], tf.float32)
            if fmt == "int16":
                value = value * float(scale)
            tf.raw_ops.AssignVariableOp(resource=handle, value=value)

    def __call__(self, *args, **kwargs):
        import tensorflow as tf

        flat = self._signature.flatten(args, kwargs) if self._signature else list(args)
        outputs = self.function(*flat)
        return tf.nest.pack_sequence_as(self._structure, outputs, expand_composites=True)


def rewrite(fn, *input_signature, mode: str = "memory", budget: str | None = None,
            device_profile: str | None = None, **options) -> RewrittenStep:
    """Rewrite the training step `fn` with `mode` (and `budget`, and the pipeline options of
    `grammar.compose`) and return the function that runs the result on fn's own variables.
    `device_profile` (`devices.PROFILES`) times the swap pass and a budget's levers, and makes
    swapping one of those on a device with a host, as `optimize --device-profile` does.

    `fn` is a `tf.function` (its own `input_signature`, or the `tf.TensorSpec`s given here) or a
    concrete function (`step.get_concrete_function(...)`, for keyword or nested specs). Every
    tensor argument must have a fully known shape. The result is called as `fn` is: the same
    parameters, positional or by keyword, nested structures (a dict or tuple batch) included.

    A step compiled with XLA (`jit_compile=True`) is rewritten and run without XLA, with a
    warning, not refused: XLA would undo the rewrite (its common-subexpression pass merges each
    recomputed copy back into its original, and it schedules the graph by its own rules), so
    keeping XLA means keeping the original step, which the caller still has. What is lost is
    XLA's fusion: step time, the intermediates fused kernels never write out, and XLA's own
    numerics (the result is bitwise the step without `jit_compile`, not the compiled one)."""
    import tensorflow as tf

    concrete = _concrete(fn, input_signature)
    graph = concrete.graph
    name = concrete.name.decode() if isinstance(concrete.name, bytes) else concrete.name
    if _compiled_with_xla(concrete):
        log.warning("'%s' is compiled with XLA (jit_compile=True); the rewritten step runs "
                    "without XLA, because XLA would merge the recomputed copies back: its "
                    "fused kernels, their speed and XLA's numerics are lost (it trains as the "
                    "step without jit_compile does); measure both", name)
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
    if budget and options.get("passes") is None:  # as the CLI: the budget of the step as run
        result = levers.fit(model, mode, None, budget, device_profile, **options)
    else:
        if device_profile:  # the swap pass's transfers timed on it
            options["swap_options"] = {**(options.get("swap_options") or {}),
                                       "profile": device_profile}
        result = pipeline.optimize(model, mode, composed=grammar.compose(mode, budget=budget,
                                                                         **options))
    rewritten = result.graph.to_graph_def()
    outputs = [t.name for t in graph.outputs]
    bindings = [(placeholder.name, handle) for placeholder, handle in
                zip(graph.internal_captures, concrete.captured_inputs)]
    own, originals = _own_variables(result.graph, bindings)
    present = {f"{n}:0" for n in bind.resource_placeholders(result.graph)}
    bindings = [(p, h) for p, h in bindings if p in present and p.split(":")[0] not in own] + [
        (f"{p}:0", v.handle) for p, v in own.items()]
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
    return RewrittenStep(function, concrete.structured_outputs, rewritten, facts, own,
                         originals, _Signature(concrete, inputs))


def _own_variables(graph: Graph, bindings) -> tuple[dict, dict]:
    """Variables for the captured placeholders a lossy rewrite added or changed the dtype of:
    ({placeholder: tf.Variable}, {placeholder: (the program's handle, diet mark)})."""
    import numpy as np
    import tensorflow as tf

    handles = {p.split(":")[0]: h for p, h in bindings}
    changed = [n for n in bind.resource_placeholders(graph)
               if n not in handles or bind.diet_mark(graph, n)]
    if not changed:
        return {}, {}
    shapes = shapes_mod.infer(graph)
    own, originals = {}, {}
    for name in changed:
        spec = bind.value_spec(graph, shapes, name)
        dtype = tf.dtypes.as_dtype(spec.dtype)
        mark = bind.diet_mark(graph, name)
        if name in handles:  # a dieted weight: the program's value, quantized
            value = tf.raw_ops.ReadVariableOp(resource=handles[name], dtype=tf.float32)
            fmt, _, scale = mark.partition(" ")
            if fmt == "int16":
                value = tf.cast(tf.clip_by_value(tf.round(value / float(scale)),
                                                 -bind.INT16_MAX, bind.INT16_MAX), tf.int16)
            initial = tf.cast(value, dtype)
            originals[name] = (handles[name], mark)
        else:  # a new optimizer slot
            initial = np.zeros(spec.shape, dtype.as_numpy_dtype)
        own[name] = tf.Variable(initial, trainable=False, name=f"graphrewrite/{name}")
    log.info("made %d variables for the rewritten step", len(own))
    return own, originals


def _concrete(fn, input_signature):
    """The concrete function to rewrite."""
    if hasattr(fn, "get_concrete_function"):
        try:
            return fn.get_concrete_function(*input_signature)
        except (TypeError, ValueError) as err:
            hint = ""
            if not input_signature and getattr(fn, "input_signature", None) is None:
                hint = ("; the tf.function has no input_signature: pass the arguments' specs, "
                        "rewrite(step, tf.TensorSpec([64, 32], tf.float32), ...), or a concrete "
                        "function, rewrite(step.get_concrete_function(...))")
            raise StepError(f"cannot trace the step: {err}{hint}") from None
    if hasattr(fn, "graph") and hasattr(fn, "captured_inputs"):
        return fn
    raise StepError(f"expected a tf.function or a concrete function, got {type(fn).__name__}")


def _compiled_with_xla(concrete) -> bool:
    """Whether the step was traced with `jit_compile=True` (its function carries XLA's mark)."""
    attr = concrete.function_def.attr.get("_XlaMustCompile")
    return bool(attr is not None and attr.b)


class _Signature:
    """The traced step's parameters: binds a call's arguments as the step binds them and
    flattens them, with `tf.nest`, to the tensors its graph takes, in the graph's order.

    Parameters traced with a Python value (a flag such as `training=True`) may be left out or
    given the same value; another value would need another trace, so it is refused."""

    def __init__(self, concrete, inputs):
        import inspect

        args, kwargs = concrete.structured_input_signature
        parameters = list(concrete.function_type.parameters.values())
        self.traced = {p.name: args[i] if i < len(args) else kwargs[p.name]
                       for i, p in enumerate(parameters)}
        self.signature = inspect.Signature([inspect.Parameter(p.name, p.kind)
                                            for p in parameters])
        self.count = len(inputs)

    def flatten(self, args, kwargs) -> list:
        import tensorflow as tf

        try:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError as err:
            raise TypeError(f"the rewritten step takes {self.signature}: {err}") from None
        flat = []
        for name, traced in self.traced.items():
            specs = tf.nest.flatten(traced, expand_composites=True)
            if name not in bound:
                if any(isinstance(s, tf.TypeSpec) for s in specs):
                    raise TypeError(f"the rewritten step takes {self.signature}: missing a "
                                    f"required argument: '{name}'")
                continue
            try:
                tf.nest.assert_same_structure(traced, bound[name], expand_composites=True)
            except (TypeError, ValueError) as err:
                raise TypeError(f"argument '{name}' is not structured as the traced "
                                f"{traced}: {err}") from None
            for spec, value in zip(specs, tf.nest.flatten(bound[name], expand_composites=True)):
                if isinstance(spec, tf.TypeSpec):
                    flat.append(value)
                elif not _same_value(spec, value):
                    raise TypeError(f"argument '{name}' was traced as {spec!r}, got {value!r}: "
                                    "rewrite the step traced with that value")
        assert len(flat) == self.count, (len(flat), self.count)
        return flat


def _same_value(traced, value) -> bool:
    try:
        return bool(traced is value or traced == value)
    except (TypeError, ValueError):  # an array's ambiguous truth value
        return False
