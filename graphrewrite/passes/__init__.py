"""Rewrite passes, one per module; each is `fn(graph, options) -> PassResult`."""
