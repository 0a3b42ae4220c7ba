"""Node selectors, as `--checkpoints` and `--swap` take them: comma-separated items, each

- an exact node or tensor name (`conv1/Relu`, `conv1/Relu:0`: a tensor selects its node),
- `regex:PATTERN` (nodes whose name the pattern matches anywhere, as `re.search`),
- `scope:PREFIX` (the name scope: `PREFIX` itself and everything under `PREFIX/`),
- `op:TYPE` (every node of that op type).

>>> parse("scope:block1, op:Conv2D")
[('scope', 'block1'), ('op', 'Conv2D')]
"""

from __future__ import annotations

import re

from .errors import GraphRewriteError
from .graph import Graph

__all__ = ["KINDS", "parse", "select"]

KINDS = ("regex", "scope", "op")


def parse(text: str) -> list[tuple[str, str]]:
    """(kind, value) pairs; kind is `name` for exact names. Commas separate items."""
    items = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        kind, sep, value = item.partition(":")
        if sep and kind in KINDS:
            if not value:
                raise GraphRewriteError(f"selector '{item}' is missing its value")
            if kind == "regex":
                try:
                    re.compile(value)
                except re.error as err:
                    raise GraphRewriteError(f"selector '{item}': bad regular expression: "
                                            f"{err}") from None
            items.append((kind, value.rstrip("/") if kind == "scope" else value))
        else:
            items.append(("name", item))
    return items


def select(graph: Graph, text: str) -> list[str]:
    """Names of the nodes `text` selects, in file order; an exact name that is absent is an error."""
    chosen = set()
    for kind, value in parse(text):
        if kind == "name":
            node = value.lstrip("^").rsplit(":", 1)[0] if _has_port(value) else value.lstrip("^")
            if node not in graph:
                raise GraphRewriteError(f"selector names '{value}', which is not in the graph")
            chosen.add(node)
        elif kind == "regex":
            pattern = re.compile(value)
            chosen.update(n for n in graph.nodes() if pattern.search(n))
        elif kind == "scope":
            chosen.update(n for n in graph.nodes() if n == value or n.startswith(value + "/"))
        else:
            chosen.update(n for n in graph.nodes() if graph.op(n) == value)
    return [n for n in graph.nodes() if n in chosen]


def _has_port(name: str) -> bool:
    head, sep, port = name.rpartition(":")
    return bool(sep and head and port.isdigit())
