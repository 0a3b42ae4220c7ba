"""Building the diet rewrite's nodes: 16-bit formats, quantize and dequantize, seeded rounding."""

from __future__ import annotations

import zlib

import numpy as np
from tensorflow.core.framework import attr_value_pb2, tensor_shape_pb2, types_pb2

from ...analysis import bind
from ...core.graph import Graph
from ...core.tensor_ref import TensorRef

__all__ = ["INT16_MAX", "PREFIX", "type_attr", "bool_attr", "int_attr", "shape_attr", "known_shape",
           "Builder", "dequantize", "dequantize_attrs", "quantize", "SEED"]

INT16_MAX = bind.INT16_MAX
PREFIX = "graphrewrite_diet"


def type_attr(dtype: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(type=dtype)


def bool_attr(value: bool) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(b=value)


def int_attr(value: int) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(i=value)


def shape_attr(dims) -> attr_value_pb2.AttrValue:
    return attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in dims]))


def _tensor(value: np.ndarray) -> attr_value_pb2.AttrValue:
    """`value` as a TensorProto; one value filling a shape as that value and the shape (a new
    slot's zeros written out in full made a ResNet-50's diet output three times its size)."""
    from tensorflow.python.framework import tensor_util

    if value.size > 1 and np.all(value == value.flat[0]):
        return attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(
            value.flat[0], value.dtype, value.shape))
    return attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(value))


def known_shape(node) -> tuple | None:
    shape = node.attr["shape"].shape
    if shape.unknown_rank or any(d.size < 0 for d in shape.dim):
        return None
    return tuple(d.size for d in shape.dim)


# --------------------------------------------------------------------------- building

class Builder:
    """Adds nodes under one name prefix, on one device, and hands back their outputs."""

    def __init__(self, graph: Graph, prefix: str, device: str = ""):
        self.graph, self.prefix, self.device = graph, prefix, device
        self.gate: TensorRef | None = None  # a control input for nodes reading no tensor

    def gated(self, name: str, op: str, inputs, **attrs) -> TensorRef:
        """`op` waiting for `gate` (when set): for reads and random draws."""
        return self.op(name, op, [*inputs, *([self.gate] if self.gate else [])], **attrs)

    def op(self, name: str, op: str, inputs, **attrs) -> TensorRef:
        node = self.graph.unique_name(f"{self.prefix}/{name}")
        self.graph.add_node(node, op, inputs, attrs, self.device)
        return TensorRef(node)

    def const(self, name: str, value, dtype=np.float32) -> TensorRef:
        array = np.asarray(value, dtype)
        return self.op(name, "Const", [], dtype=type_attr(_dtype_enum(array.dtype)),
                       value=_tensor(array))

    def binary(self, op: str, a: TensorRef, b: TensorRef, name: str | None = None) -> TensorRef:
        return self.op(name or op.lower(), op, [a, b], T=type_attr(types_pb2.DT_FLOAT))

    def unary(self, op: str, a: TensorRef, name: str | None = None) -> TensorRef:
        return self.op(name or op.lower(), op, [a], T=type_attr(types_pb2.DT_FLOAT))

    def max(self, name: str, value: TensorRef, axes, axes_name: str, keep: bool) -> TensorRef:
        """The largest value over `axes`."""
        axes = self.const(axes_name, axes, np.int32)
        return self.op(name, "Max", [value, axes], T=type_attr(types_pb2.DT_FLOAT),
                       Tidx=type_attr(types_pb2.DT_INT32), keep_dims=bool_attr(keep))

    def reshape(self, name: str, value: TensorRef, shape, shape_name: str) -> TensorRef:
        shape = self.const(shape_name, shape, np.int32)
        return self.op(name, "Reshape", [value, shape], T=type_attr(types_pb2.DT_FLOAT),
                       Tshape=type_attr(types_pb2.DT_INT32))

    def cast(self, value: TensorRef, src: int, dst: int, name: str = "cast") -> TensorRef:
        return self.op(name, "Cast", [value], SrcT=type_attr(src), DstT=type_attr(dst),
                       Truncate=bool_attr(False))


def _dtype_enum(dtype) -> int:
    import tensorflow as tf

    return tf.dtypes.as_dtype(dtype).as_datatype_enum


def dequantize(b: Builder, raw: TensorRef, fmt: int, scale: float) -> tuple[str, list]:
    """(op, inputs) of the node that turns 16-bit `raw` into float32, so a caller can give
    that node a name of its choice (`Graph.redefine`): Cast for bfloat16, Cast x scale for
    int16."""
    if fmt == types_pb2.DT_BFLOAT16:
        return "Cast", [raw]
    cast = b.cast(raw, fmt, types_pb2.DT_FLOAT, "dequantize")
    return "Mul", [cast, b.const("scale", scale)]


def dequantize_attrs(fmt: int) -> dict:
    if fmt == types_pb2.DT_BFLOAT16:
        return {"SrcT": type_attr(fmt), "DstT": type_attr(types_pb2.DT_FLOAT),
                "Truncate": bool_attr(False)}
    return {"T": type_attr(types_pb2.DT_FLOAT)}


def quantize(b: Builder, value: TensorRef, shape: tuple, fmt: int, scale: float,
             stochastic: bool, seed: int) -> TensorRef:
    """`value` (float32 of `shape`) as 16 bits. Stochastic rounding rounds up with probability
    equal to the fraction it drops, so its mean is the value: for int16, floor(x / scale + u)
    with u ~ U[0, 1); for bfloat16, a uniform integer below 2^16 added to the float's bits
    before the low 16 bits are cut (rounding the magnitude, so both signs are unbiased)."""
    float_type = types_pb2.DT_FLOAT
    if fmt == types_pb2.DT_BFLOAT16:
        if stochastic:
            bits = b.op("bits", "Bitcast", [value], T=type_attr(float_type),
                        type=type_attr(types_pb2.DT_INT32))
            noise = b.gated("noise", "RandomUniformInt",
                         [b.const("shape", shape, np.int32), b.const("low", 0, np.int32),
                          b.const("high", 1 << 16, np.int32)],
                         T=type_attr(types_pb2.DT_INT32), Tout=type_attr(types_pb2.DT_INT32),
                         seed=int_attr(seed), seed2=int_attr(_seed2(b.prefix)))
            added = b.op("add_noise", "AddV2", [bits, noise], T=type_attr(types_pb2.DT_INT32))
            cut = b.op("cut", "BitwiseAnd", [added, b.const("mask", -(1 << 16), np.int32)],
                       T=type_attr(types_pb2.DT_INT32))
            value = b.op("rounded", "Bitcast", [cut], T=type_attr(types_pb2.DT_INT32),
                         type=type_attr(float_type))
        return b.cast(value, float_type, fmt, "quantize")
    scaled = b.binary("Mul", value, b.const("inverse_scale", 1.0 / scale), "scaled")
    if stochastic:
        noise = b.gated("noise", "RandomUniform", [b.const("shape", shape, np.int32)],
                     T=type_attr(types_pb2.DT_INT32), dtype=type_attr(float_type),
                     seed=int_attr(seed), seed2=int_attr(_seed2(b.prefix)))
        rounded = b.unary("Floor", b.binary("AddV2", scaled, noise, "add_noise"), "rounded")
    else:
        rounded = b.unary("Round", scaled, "rounded")
    clipped = b.op("clip", "ClipByValue", [rounded, b.const("low", -INT16_MAX),
                                           b.const("high", INT16_MAX)], T=type_attr(float_type))
    return b.cast(clipped, float_type, fmt, "quantize")


SEED = 1729  # op-level seeds make the rounding noise repeatable from run to run


def _seed2(prefix: str) -> int:
    return zlib.crc32(prefix.encode()) & 0x7FFFFFFF
