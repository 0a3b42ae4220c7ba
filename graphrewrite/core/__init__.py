"""What every layer shares: the Graph, tensor references, reading and writing models, canonical
text, dtypes, the names of added nodes, facts about op types, what a command never frees, and
warnings said once over repeated work."""

__all__ = ["dtypes", "errors", "graph", "io", "lifetime", "metagraph", "names", "once", "ops",
           "selectors", "tensor_ref", "text", "topo"]
