"""Typed errors. The CLI turns each into one line on stderr and exit code 2 (3 for PassError)."""


class GraphRewriteError(Exception):
    """Base of every error graphrewrite raises on purpose."""


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
        super().__init__(f"pass '{name}' ({after}) {problem}; this is a bug in graphrewrite "
                         "(--debug shows where)")
        self.name = name
        self.before = before
