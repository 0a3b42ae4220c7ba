"""graphrewrite: offline rewriting of TensorFlow training graphs for lower peak memory.

Data flow: `io.load` -> `Graph` -> analyses -> plan -> rewrite passes -> `Graph.check` -> `io.save`.
"""

__version__ = "0.1.0"
