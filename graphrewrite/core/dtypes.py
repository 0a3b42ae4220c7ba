"""Named TensorFlow dtypes and the few facts about them the passes ask.

A `NodeDef` holds a dtype as the `DataType` enum number; a reference type (what a TF1
`VariableV2` outputs) is its base type plus 100 (`DT_FLOAT_REF = DT_FLOAT + 100`).
"""

from __future__ import annotations

from tensorflow.core.framework import types_pb2 as t

__all__ = ["REF_OFFSET", "FLOATING", "PLAIN", "HANDLES", "RESOURCE", "STRING", "base", "is_ref",
           "is_floating"]

REF_OFFSET = 100  # DT_<TYPE>_REF = DT_<TYPE> + REF_OFFSET

FLOATING = frozenset({t.DT_FLOAT, t.DT_DOUBLE, t.DT_BFLOAT16, t.DT_HALF})
# Numbers and booleans: what can be copied to host memory and back as plain bytes.
PLAIN = FLOATING | frozenset({
    t.DT_INT32, t.DT_UINT8, t.DT_INT16, t.DT_INT8, t.DT_INT64, t.DT_BOOL, t.DT_UINT16,
    t.DT_UINT32, t.DT_UINT64, t.DT_COMPLEX64, t.DT_COMPLEX128})
# No numpy value to fetch: a handle or an opaque container.
HANDLES = frozenset({t.DT_RESOURCE, t.DT_VARIANT})
RESOURCE = t.DT_RESOURCE
STRING = t.DT_STRING  # its bytes are its values' lengths: no shape tells them


def base(dtype: int) -> int:
    """The dtype a reference type refers to; other dtypes unchanged."""
    return dtype - REF_OFFSET if dtype > REF_OFFSET else dtype


def is_ref(dtype: int) -> bool:
    return dtype > REF_OFFSET


def is_floating(dtype: int) -> bool:
    return base(dtype) in FLOATING
