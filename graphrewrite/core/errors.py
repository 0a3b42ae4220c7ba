"""Typed errors. The CLI turns each into one line on stderr and exit code 2 (3 for PassError).

A message names the options it is about by their library parameter, written `${name}`
(`${input_shapes} names 'x', which is not a node of the graph`): `str(err)` shows the parameter
(`input_shapes`), as a `tf2.rewrite` or `pipeline.run.optimize` caller spelled it; `render`
shows what another front end calls it (the CLI: `--input-shape`). Logged warnings may name
parameters so too; the CLI renders them alike."""

from __future__ import annotations

import re

__all__ = ["GraphRewriteError", "InputError", "GraphError", "PassError", "render"]

_PARAMETER = re.compile(r"\$\{(\w+)\}")


class GraphRewriteError(Exception):
    """Base of every error graphrewrite raises on purpose."""

    def __str__(self) -> str:
        return self.render({})

    def render(self, names: dict[str, str]) -> str:
        """The message with each `${parameter}` as `names` calls it (else its own name)."""
        return render(super().__str__(), names)


def render(text: str, names: dict[str, str]) -> str:
    """`text` (an error's or a logged warning's) with each `${parameter}` as `names` calls it
    (else its own name)."""
    return _PARAMETER.sub(lambda m: names.get(m.group(1), m.group(1)), text)


class InputError(GraphRewriteError):
    """A file that cannot be read as a model: missing, empty, corrupt, unsupported, too large."""

    def __init__(self, path, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class GraphError(GraphRewriteError):
    """A structurally broken graph, or a mutation that would break one."""


class PassError(GraphRewriteError):
    """A pass that raised unexpectedly or left a graph `Graph.check` rejects: a bug in
    graphrewrite, not in the input, so the CLI gives it an exit code of its own."""

    def __init__(self, name: str, before: list[str], problem: str):
        after = f"after {' '.join(before)}" if before else "the first pass"
        super().__init__(f"pass '{name}' ({after}) {problem}; this is a bug in graphrewrite")
        self.name = name
        self.before = before
