"""Semantic diff of two graphs: what a CI log should show when a rewritten fixture changes.

Nodes are matched by name, so the order of nodes and of attribute maps does not matter; tensor
payloads compare by content hash (as `dump` prints them); inputs compare canonically (`a:0` is
`a`). Library functions compare by their canonical dump.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.graph import Graph
from ..core.text import dump_function, format_attr, node_line

__all__ = ["MARKS", "GraphDiff", "diff", "format_diff"]

MARKS = {"added": "+", "removed": "-", "changed": "~"}


@dataclass
class GraphDiff:
    added: list[str] = field(default_factory=list)           # node lines only in B
    removed: list[str] = field(default_factory=list)         # node lines only in A
    changed: list[dict] = field(default_factory=list)        # {node, op/device/attrs: [a, b]}
    rewired: list[dict] = field(default_factory=list)        # {node, before, after}
    functions: dict = field(default_factory=dict)            # added/removed/changed names

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed or self.rewired
                    or any(self.functions.values()))

    def to_json(self) -> dict:
        return {"identical": self.identical, "added": self.added, "removed": self.removed,
                "changed": self.changed, "rewired": self.rewired, "functions": self.functions}


def diff(a: Graph, b: Graph) -> GraphDiff:
    """What changed from `a` to `b`, node by node, in a stable order."""
    result = GraphDiff()
    names_a, names_b = set(a.nodes()), set(b.nodes())
    result.added = [_line(b, n) for n in sorted(names_b - names_a)]
    result.removed = [_line(a, n) for n in sorted(names_a - names_b)]
    for name in sorted(names_a & names_b):
        node_a, node_b = a.node_def(name), b.node_def(name)
        change = {}
        if node_a.op != node_b.op:
            change["op"] = [node_a.op, node_b.op]
        if node_a.device != node_b.device:
            change["device"] = [node_a.device, node_b.device]
        for key in sorted(set(node_a.attr) | set(node_b.attr)):
            before = format_attr(node_a.attr[key]) if key in node_a.attr else None
            after = format_attr(node_b.attr[key]) if key in node_b.attr else None
            if before != after:
                change.setdefault("attrs", {})[key] = [before, after]
        if change:
            result.changed.append({"node": name, **change})
        inputs_a = [str(r) for r in a.inputs(name)]
        inputs_b = [str(r) for r in b.inputs(name)]
        if inputs_a != inputs_b:
            result.rewired.append({"node": name, "before": inputs_a, "after": inputs_b})
    functions_a = {f.signature.name: dump_function(f) for f in a.shell.library.function}
    functions_b = {f.signature.name: dump_function(f) for f in b.shell.library.function}
    result.functions = {
        "added": sorted(set(functions_b) - set(functions_a)),
        "removed": sorted(set(functions_a) - set(functions_b)),
        "changed": sorted(n for n in set(functions_a) & set(functions_b)
                          if functions_a[n] != functions_b[n]),
    }
    return result


def format_diff(result: GraphDiff) -> str:
    """Readable, stable text for a CI log: `+` added, `-` removed, `~` changed, `>` rewired."""
    if result.identical:
        return "identical"
    lines = [f"{len(result.added)} added, {len(result.removed)} removed, "
             f"{len(result.changed)} changed, {len(result.rewired)} rewired"]
    lines += [f"+ {line}" for line in result.added]
    lines += [f"- {line}" for line in result.removed]
    for change in result.changed:
        for key, (before, after) in change.get("attrs", {}).items():
            lines.append(f"~ {change['node']}: {key} {before} -> {after}")
        for key in ("op", "device"):
            if key in change:
                lines.append(f"~ {change['node']}: {key} {change[key][0]!r} -> "
                             f"{change[key][1]!r}")
    for rewire in result.rewired:
        lines.append(f"> {rewire['node']}: ({', '.join(rewire['before'])}) -> "
                     f"({', '.join(rewire['after'])})")
    for kind, names in result.functions.items():
        lines += [f"{MARKS[kind]} function {n}" for n in names]
    return "\n".join(lines)


def _line(graph: Graph, name: str) -> str:
    node = graph.node_def(name)
    return node_line(name, node.op, [str(r) for r in graph.inputs(name)], node.attr, node.device)
