"""Diet for a graph without variables (a frozen graph): its large float constants stored in
16 bits, dequantized where read."""

from __future__ import annotations

import numpy as np
from tensorflow.core.framework import types_pb2

from ...analysis.step import Analysis
from ...core.graph import Graph
from .build import INT16_MAX, PREFIX, Builder, dequantize, dequantize_attrs
from .facts import record_shape
from .options import FORMATS, DietOptions, DietResult
from .reads import choose_reads

__all__ = ["FLOAT_CONST", "diet_constants"]

FLOAT_CONST = types_pb2.DT_FLOAT


def diet_constants(graph: Graph, options: DietOptions, analysis: Analysis | None = None,
                    model=None) -> DietResult:
    """Large float32 constants stored in 16 bits: int16 with a per-constant scale (its largest
    magnitude over 32767: no constant clips) or bfloat16, dequantized where read from a
    DeepCopy of the 16-bit constant (stateful, so no constant folding turns the dequantized
    value back into a float32 constant); the constant keeps its name, as the
    dequantization."""
    from tensorflow.python.framework import tensor_util

    graph = graph.copy()
    fmt = FORMATS[options.format]
    done, saved, firsts = [], 0, {}
    for name in list(graph.nodes()):
        node = graph.node_def(name)
        if node.op != "Const" or node.attr["dtype"].type != FLOAT_CONST:
            continue
        value = tensor_util.MakeNdarray(node.attr["value"].tensor)
        if value.size < max(options.min_size, 1) or not np.all(np.isfinite(value)):
            continue
        b = Builder(graph, f"{name}/{PREFIX}", node.device)
        if fmt == types_pb2.DT_BFLOAT16:
            import tensorflow as tf

            raw = b.const("raw", value.astype(tf.bfloat16.as_numpy_dtype),
                          tf.bfloat16.as_numpy_dtype)
            scale = 1.0
        else:
            peak = float(np.max(np.abs(value))) or 1.0
            scale = peak / INT16_MAX
            raw = b.const("raw", np.clip(np.round(value / scale), -INT16_MAX, INT16_MAX),
                          np.int16)
        # Grappler and the session's own graph optimizer fold Cast(Const) * scale back into a
        # float32 constant when the session starts (the saving would vanish at run time);
        # neither folds a stateful op. (A PlaceholderWithDefault stops Grappler only: the
        # session's constant folding folded it, ResNet-50 measured as the original.)
        stored = b.op("stored", "DeepCopy", [raw], T=graph.node_def(raw.node).attr["dtype"])
        record_shape(graph, stored.node, value.shape)
        op, args = dequantize(b, stored, fmt, scale)
        graph.redefine(name, op, args, dequantize_attrs(fmt))
        done.append(name)
        firsts[name] = stored.node
        saved += value.size * 2
    if not done:
        return DietResult(graph, False, note=f"diet: no variables, and no float32 constant of "
                                             f"at least min_size={options.min_size} elements")
    graph, choice = choose_reads(graph, firsts, analysis, model)
    return DietResult(graph, True, choice.shapes, constants=done, bytes_saved=saved,
                      forward_reads=choice.kept, read_peaks=choice.peaks)
