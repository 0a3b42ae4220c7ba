"""What every layer shares: the Graph, tensor references, reading and writing models, canonical
text, dtypes, the names of added nodes, and facts about op types."""

__all__ = ["dtypes", "errors", "graph", "io", "metagraph", "names", "ops", "selectors",
           "tensor_ref", "text", "topo"]
