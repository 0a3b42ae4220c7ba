"""TensorFlow's GraphDef importer without the Python side `import_graph_def` builds.

`tf.graph_util.import_graph_def` runs the C++ importer (which checks every op against its
registered definition, runs its shape function, and checks dtypes, attributes and colocation)
and then builds a Python `Operation` for every node, with its colocation group and device:
most of its time on a large graph (a 152k-node rewrite: 66 s of 80 under the profiler), and
none of it needed to check that a graph imports or to read its shapes.
"""

from __future__ import annotations

__all__ = ["c_import"]


def c_import(graph_def, validate_colocation: bool = False, serialized: bytes | None = None):
    """A `tf.Graph` holding `graph_def` as the C++ importer made it, called as the public
    importer calls it (its operations not yet wrapped: `graph.new_operations()` lists them).
    `serialized`: `graph_def`'s bytes, if the caller has them (0.8 s to make at 150k nodes).
    Raises what the C++ importer raises (InvalidArgumentError and others; the public importer
    turns InvalidArgumentError into ValueError), and AttributeError or ImportError should
    TensorFlow's internals differ."""
    import tensorflow as tf
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import c_api_util, importer

    graph = tf.Graph()
    scoped = c_api_util.ScopedTFImportGraphDefOptions()
    importer._PopulateTFImportGraphDefOptions(scoped.options, "", {}, None, validate_colocation,
                                              False)
    data = graph_def.SerializeToString() if serialized is None else serialized
    with c_api_util.tf_buffer(data) as buffer:
        with graph._c_graph.get() as c_graph:
            results = c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, scoped.options)
    c_api_util.ScopedTFImportGraphDefResults(results)  # frees them
    return graph
