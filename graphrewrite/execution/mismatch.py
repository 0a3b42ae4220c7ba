"""Why a rewritten graph's outputs differ from the original's: which Grappler optimizer splits them.

Grappler rewrites each graph on its own, and some of its decisions depend on what a rewrite
changes even when the arithmetic written in the graph is the same. The arithmetic optimizer's
MinimizeBroadcasts regroups a chain of Mul (or Add) nodes (TF 2.15, arithmetic_optimizer.cc):
common subgraph elimination has sorted the data inputs of every commutative op by name (as
strings); nodes are visited in reverse topological order and the first Mul reached roots a
group, which absorbs, depth first in input order, each input of the same op that has one data
reader, the root's device and no control edge in or out; the group's leaves are stably sorted
by shape size (scalars first) and paired front to back. So a copy whose name sorts elsewhere
than its original's, or a control edge added to or removed from a chain member (the dependency
optimizer removes an Identity only while its inputs times its readers are at most their sum,
and forwards its control inputs to its readers), turns `s * (a * b)` into `(s * a) * b` in one
graph and `(s * b) * a` in the other, which round differently: by one ulp on a constant such as
sqrt(2/pi) (the GELU gradient), or only where a product falls below the smallest normal float
and TensorFlow flushes it to zero for a power of two such as 0.5. Shapes matter as well: a group
is only formed where Grappler can tell its operands' shapes are broadcast-compatible. The
recompute pass avoids all three (copy names keep their originals' order, triggers wait past
tf.tuple Identities, a Pack pad tells shape inference a copy has its original's shape); this
module tells such a cause from a real difference when it happens anyway.

`diagnose` first looks for random draws whose order is a race (`racing_draws`): a stateful
random op in a loop body that runs iterations at once draws in the order the iterations reach
it. A Keras LSTM with recurrent dropout draws its masks so: traced, its step differed from
itself in one session of twenty, which a few runs do not show (and with the arithmetic
optimizer off the two graphs agreed by chance, blaming it). Then it runs the original
ORIGINAL_RUNS times: a step that differs from itself (a ViT with Keras AdamW did, in one run of
three, by 2.8e-8 in the optimizer's updates; two runs that happened to agree once sent the
diagnosis on to blame Grappler) cannot be matched bitwise by any rewrite. Where its runs agree
but it has sums whose order is a race (`racing_sums`), that race is named: an MLP-Mixer built
outside the repo, its LayerNorm gradients such sums, had its runs agree and Grappler blamed in
one verify of three. Then it runs the rewritten graph once more: where it now repeats the
original's outputs bitwise, the mismatch came from results that vary from run to run (a
PointNet built outside the repo gave three results in eleven runs, from a batch norm's
three-input gradient sum no other op reads, and its three runs here agreed: Grappler was
blamed). Then it asks Grappler whether it runs a sum as a running sum in one step and not the
other (`passes.running_sums`: its memory optimizer does so by the step's estimated peak, which
a rewrite moves; `optimize` writes the original's running sums into the rewrite, so this names
the rest). Then it runs both
graphs with the arithmetic optimizer off, then with Grappler off, and names the first
configuration under which they agree bitwise; an empty cause means they differ whatever
Grappler does (a real difference).
"""

from __future__ import annotations

import logging
from collections import Counter

from ..core import ops
from . import measure

__all__ = ["ORIGINAL_RUNS", "ORIGINAL_CAUSE", "RACING_CAUSE", "ARITHMETIC_CAUSE", "UNSTABLE_CAUSE",
           "GRAPPLER_CAUSE", "RUNNING_SUM_CAUSE", "SUM_ORDER_CAUSE", "WRITES_ORDER_CAUSE",
           "racing_draws", "racing_sums", "running_sums_apart", "unordered_writes",
           "arithmetic_off_config", "grappler_off_config", "diagnose"]

log = logging.getLogger(__name__)

ORIGINAL_RUNS = 3  # runs of the original compared with each other before Grappler is blamed

ORIGINAL_CAUSE = (
    "the original step is not deterministic: run twice on the same inputs it differs from "
    "itself, so no rewrite can be bitwise equal to it (compare within --rtol/--atol)")
SUM_ORDER_CAUSE = (
    "TensorFlow's AddN sums its inputs starting from one whose buffer it can reuse (one no "
    "other op still reads), and which that is depends on the order the other readers "
    "finish: with three or more inputs the rounding changes from run to run")
WRITES_ORDER_CAUSE = (
    "two updates of one variable that nothing orders (each tower's update of a batch norm's "
    "shared moving average) land in either order from run to run")
RACING_CAUSE = (
    "the original step's random draws are not ordered: it has random ops inside loops that "
    "run iterations at once, which draw in the order the iterations reach them, and that order "
    "changes from run to run, so neither graph repeats itself bitwise")
ARITHMETIC_CAUSE = (
    "Grappler's arithmetic optimizer: with it off, both agree bitwise. It regroups chains of "
    "Mul/Add by their operands' names and control edges (MinimizeBroadcasts), which the rewrite "
    "changed, so the two graphs round differently (by an ulp, or where a product falls below "
    "the smallest normal float and is flushed to zero)")
UNSTABLE_CAUSE = (
    f"run again, the rewritten step repeated the original's outputs bitwise: the difference "
    f"comes from results that vary from run to run although the original's {ORIGINAL_RUNS} "
    f"runs here agreed (a sum whose order TensorFlow decides as the step runs is the usual "
    f"reason): run verify again, or compare within --rtol/--atol")
RUNNING_SUM_CAUSE = (
    "Grappler's memory optimizer runs a sum as a running sum (its terms added as they arrive, "
    "in another order) in one step and not in the other: it does so for a sum live at its "
    "estimated peak when that passes 80% of the device's memory, and the rewrite moved the peak")
GRAPPLER_CAUSE = (
    "Grappler: with it off, both agree bitwise; it optimizes the two graphs differently (e.g. a "
    "fusion made in one and not the other)")


def racing_draws(message) -> list[str]:
    """Stateful random ops (a `seed` attribute, or a `Stateful*` generator op) of a runnable
    GraphDef or MetaGraphDef that run in a loop of `parallel_iterations` > 1: in a functional
    While's body or a function it calls (named `function/node`), or in a v1 loop frame."""
    from ..analysis import loops
    from ..core.graph import Graph

    graph_def = getattr(message, "graph_def", message)
    if not hasattr(graph_def, "node"):
        return []
    functions = {f.signature.name: f for f in graph_def.library.function}
    bodies = [n.attr["body"].func.name
              for nodes in [graph_def.node] + [f.node_def for f in functions.values()]
              for n in nodes if n.op in ("While", "StatelessWhile")
              and n.attr["parallel_iterations"].i > 1]
    found, seen = [], set()
    while bodies:
        name = bodies.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        for node in functions[name].node_def:
            if _draws(node):
                found.append(f"{name}/{node.name}")
            bodies += [node.op] + [v.func.name for v in node.attr.values() if v.HasField("func")]
    graph = Graph.from_graph_def(graph_def)
    frames = loops.frame_of(graph)
    at_once = loops.parallel_iterations(graph, frames)
    found += sorted(n for n, frame in frames.items()
                    if frame and at_once.get(frame, 1) > 1 and _draws(graph.node_def(n)))
    return found


def racing_sums(message) -> list[str]:
    """AddN ops of three or more inputs, one of which another op also reads (at the top level,
    or `function/node`): whether its buffer is reused, and so the order of the sum, is a race
    (a ViT's LayerNorm gradient, verify found its original differing from itself)."""
    graph_def = getattr(message, "graph_def", message)
    if not hasattr(graph_def, "node"):
        return []
    found = []
    for prefix, nodes in [("", graph_def.node)] + [(f.signature.name + "/", f.node_def)
                                                   for f in graph_def.library.function]:
        readers = Counter(i for n in nodes for i in n.input if not i.startswith("^"))
        found += sorted(prefix + n.name for n in nodes if n.op == "AddN" and
                        sum(not i.startswith("^") for i in n.input) >= 3 and
                        any(readers[i] > 1 for i in n.input if not i.startswith("^")))
    return found


def unordered_writes(message, fetches: list[str]) -> list[str]:
    """Variables two writes the fetched step runs update with nothing ordering them (two
    towers' updates of the batch norms' shared averages, a TF1 multi-tower step built outside
    the repo): which lands last changes from run to run."""
    import networkx as nx

    from ..analysis.bind import through_forwarders
    from ..analysis.split import UPDATE_PREFIXES, VARIABLE_WRITES, reachable
    from ..core.graph import Graph

    graph_def = getattr(message, "graph_def", message)
    if not hasattr(graph_def, "node"):
        return []
    graph = Graph.from_graph_def(graph_def)
    ends = [f.split(":")[0].lstrip("^") for f in fetches]
    writes: dict[str, list[str]] = {}
    for name in reachable(graph.nx, [e for e in ends if graph.nx.has_node(e)], upstream=True):
        op = graph.op(name)
        inputs = graph.data_inputs(name)
        if inputs and (op in VARIABLE_WRITES or op.startswith(UPDATE_PREFIXES)):
            writes.setdefault(through_forwarders(graph, inputs[0]).node, []).append(name)
    return sorted(var for var, names in writes.items() if any(
        not nx.has_path(graph.nx, a, b) and not nx.has_path(graph.nx, b, a)
        for i, a in enumerate(names) for b in names[i + 1:]))


def running_sums_apart(original, rewritten, fetches: list[str]) -> list[str]:
    """The sums Grappler runs as running sums (`passes.running_sums`) in one of two runnable
    messages' steps fetching `fetches` and not in the other's."""
    from ..analysis import grappler
    from ..core.graph import Graph
    from ..passes.running_sums import running_sums

    found = []
    for message in (original, rewritten):
        graph_def = getattr(message, "graph_def", message)
        if not hasattr(graph_def, "node"):
            return []
        run = grappler.as_run(Graph.from_graph_def(graph_def), fetches,
                              message if hasattr(message, "meta_info_def") else None)
        if run is None:
            return []
        found.append(set(running_sums(run)))
    return sorted(found[0] ^ found[1])


def _draws(node) -> bool:
    """A stateful random op: seeded by attributes, or a `tf.random.Generator`'s."""
    return ops.takes_seed(node.op) or (
        node.op.startswith("Stateful") and node.op != "StatefulPartitionedCall")


def arithmetic_off_config():
    """TensorFlow's default configuration with only the arithmetic optimizer turned off."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.arithmetic_optimization = (
        rewriter_config_pb2.RewriterConfig.OFF)
    return config


def grappler_off_config():
    """TensorFlow's default configuration with Grappler's meta optimizer off."""
    from tensorflow.core.protobuf import config_pb2

    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    return config


def diagnose(original, rewritten, feeds: dict, own: dict, fetches: list[str], agree,
             isolated: bool = True) -> str:
    """The cause of a mismatch (see the module docstring), or "" when none was found.
    `original` and `rewritten` are runnable messages (`Model.runnable()`), `feeds` and `own`
    their inputs (`verify.own_variables`: a dieted TF2 step's weights are stored in 16 bits);
    `agree(first, second)` says whether two step measurements are bitwise equal (verify's
    comparison)."""
    racing = racing_draws(original)
    if racing:
        cause = (f"{RACING_CAUSE} ({len(racing)} such ops, e.g. '{racing[0]}'; run verify "
                 "again, or compare within --rtol/--atol)")
        log.warning("verify: %s", cause)
        return cause
    run = measure.run_step_isolated if isolated else measure.run_step
    first = run(original, feeds, fetches, 0)
    sums = racing_sums(original)
    if not all(agree(first, run(original, feeds, fetches, 0)) for _ in range(ORIGINAL_RUNS - 1)):
        writes = [] if sums else unordered_writes(original, fetches)
        cause = ORIGINAL_CAUSE + (f"; a likely reason: {SUM_ORDER_CAUSE} ({len(sums)} such "
                                  f"ops, e.g. '{sums[0]}')" if sums else
                                  f"; a likely reason: {WRITES_ORDER_CAUSE} ({len(writes)} such "
                                  f"variables, e.g. '{writes[0]}')" if writes else "")
        log.warning("verify: %s", cause)
        return cause
    if sums:  # its runs agreed by chance, or not yet: Grappler cannot be told from the race
        cause = (f"{SUM_ORDER_CAUSE} ({len(sums)} such ops in the original, e.g. '{sums[0]}'), "
                 f"so the original need not repeat itself bitwise although its {ORIGINAL_RUNS} "
                 "runs here agreed: run verify again, or compare within --rtol/--atol")
        log.warning("verify: %s", cause)
        return cause
    if agree(first, run(rewritten, own, fetches, 0)):
        log.warning("verify: %s", UNSTABLE_CAUSE)
        return UNSTABLE_CAUSE
    apart = running_sums_apart(original, rewritten, fetches)
    if apart:
        cause = f"{RUNNING_SUM_CAUSE} ({len(apart)} such sums, e.g. '{apart[0]}')"
        log.warning("verify: the outputs differ through %s", cause)
        return cause
    for cause, config in ((ARITHMETIC_CAUSE, arithmetic_off_config()),
                          (GRAPPLER_CAUSE, grappler_off_config())):
        first = run(original, feeds, fetches, 0, config)
        second = run(rewritten, own, fetches, 0, config)
        if agree(first, second):
            log.warning("verify: the outputs differ only through %s", cause)
            return cause
    return ""
