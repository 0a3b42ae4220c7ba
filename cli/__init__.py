"""The `graphrewrite` command line: thin click commands over the library."""
