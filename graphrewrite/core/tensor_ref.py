"""TensorRef: one tensor `node:port`, or a control dependency `^node`.

It prints exactly what a `NodeDef.input` string holds, so parsing and printing round-trip for the
canonical spellings TensorFlow writes (`a`, `a:1`, `^a`).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CONTROL", "TensorRef"]

CONTROL = -1


class TensorRef(NamedTuple):
    """Output `port` of node `node`; `port == CONTROL` (-1) is a control dependency. A tuple,
    so hashing and comparing it (millions of times in a simulation) run in C.

    >>> TensorRef.parse("conv1/Relu:1")
    TensorRef(node='conv1/Relu', port=1)
    >>> str(TensorRef("a", 0)), str(TensorRef("a", CONTROL))
    ('a', '^a')
    """

    node: str
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> "TensorRef":
        if not text:
            raise ValueError("empty input name")
        if text.startswith("^"):
            return cls(text[1:], CONTROL)
        name, sep, port = text.rpartition(":")
        if sep and port.isdigit():
            return cls(name, int(port))
        return cls(text, 0)

    @property
    def is_control(self) -> bool:
        return self.port == CONTROL

    def __str__(self) -> str:
        if self.port == CONTROL:
            return "^" + self.node
        return self.node if self.port == 0 else f"{self.node}:{self.port}"
