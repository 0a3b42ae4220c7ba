"""What every layer shares: the Graph, tensor references, reading and writing models, canonical
text, dtypes, the names of added nodes, facts about op types, and what a command never frees."""

__all__ = ["dtypes", "errors", "graph", "io", "lifetime", "metagraph", "names", "ops", "selectors",
           "tensor_ref", "text", "topo"]
