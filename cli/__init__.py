"""The `graphrewrite` command line: thin click commands over the library."""

__all__ = ["main", "options", "tables"]
