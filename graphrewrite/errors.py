"""Typed errors. The CLI turns each into one line on stderr and exit code 2."""


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
