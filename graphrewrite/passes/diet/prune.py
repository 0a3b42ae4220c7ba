"""Removing what a diet left unread: a slot variable with its reads, writes and initializer,
then whatever computed only for them."""

from __future__ import annotations

import logging

from ...analysis import bind, parameters
from ...core import ops
from ...core.graph import Graph
from .facts import ancestors_in, escapes
from .saver import drop_control

__all__ = ["remove_variable", "prune"]

log = logging.getLogger(__name__)


def remove_variable(graph: Graph, var: str, warn: bool = True) -> bool:
    """Remove `var` with everything that reads or writes it, unless its value flows further
    (then False, with a warning if `warn`)."""
    doomed, todo = set(), [var]
    while todo:
        name = todo.pop()
        if name in doomed:
            continue
        doomed.add(name)
        todo.extend(u for u, slot in graph.consumers(name) if slot >= 0)
    strangers = sorted(n for n in doomed - {var} if escapes(graph, n, doomed))
    if strangers:  # its value flows further than its own reads and writes: keep it
        if warn:
            log.warning("diet: slot %s is not removed: %s reads it", var, strangers[0])
        return False
    producers = {r.node for n in doomed for r in graph.data_inputs(n)} - doomed
    for name in doomed:
        for user in graph.successors(name):
            if user not in doomed:
                drop_control(graph, user, name)
    for name in sorted(doomed, key=lambda n: -len(ancestors_in(graph, n, doomed))):
        graph.remove_node(name)
    prune(graph, producers)
    return True


def prune(graph: Graph, candidates) -> None:
    """Remove candidates nothing reads that compute a value (no variables, no feeds, no
    stateful ops other than reads), and then their inputs likewise."""
    todo = list(candidates)
    while todo:
        name = todo.pop()
        if name not in graph or graph.successors(name):
            continue
        op = graph.op(name)
        node = graph.node_def(name)
        if parameters.is_variable(graph, name) or bind.is_resource_placeholder(node) or \
                op in ("Placeholder", "PlaceholderWithDefault", "NoOp") or (
                op not in parameters.READ_OPS and ops.is_stateful(op)):
            continue
        inputs = [r.node for r in graph.inputs(name)]
        graph.remove_node(name)
        todo.extend(inputs)
