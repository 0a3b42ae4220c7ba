"""graphrewrite: offline rewriting of TensorFlow training graphs for lower peak memory.

Data flow: `core.io.load` -> `Graph` -> analyses -> plan -> rewrite passes -> `Graph.check` ->
`core.io.save`. The subpackages are layers; each imports only those before it (a test checks):

    core        graph, tensor refs, io, canonical text, dtypes, names, op facts, selectors
    analysis    shapes, forward/backward split, parameters, FLOPs, memory model, loops, as run
    planning    checkpoint policies, the plan estimate, budgets, the exact planner
    passes      the rewrites: recompute, swap, diet, ... (each returns its PassResult)
    pipeline    modes, pipeline text, `optimize`, plan files, the import check before writing
    execution   running graphs in TensorFlow: measure, verify, why outputs differ
    reporting   the optimize and inspect reports, plots, graph diffs
    front ends  `tf2` (rewrite a tf.function in process), `batch` (model zoos), `cli`
"""

__all__ = ["analysis", "batch", "cli", "core", "execution", "passes", "pipeline", "planning",
           "reporting", "tf2"]

__version__ = "0.1.0"
