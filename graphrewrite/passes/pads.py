"""Fan-out pads: keep Grappler's view of how many readers each tensor has.

Grappler rewrites a node differently when its number of data readers changes (many rules only
fire on a tensor with exactly one reader: constant push-down, MinimizeBroadcasts, AddOpsRewrite,
fusions), which would make a rewritten graph compute bitwise different values. So every live
tensor left with fewer readers than its original had gets an IdentityN "pad" reading it the
missing number of times, marked `_grappler_do_not_remove`: Grappler keeps it (and so sees the
original counts) through all its iterations, and the session then prunes it with everything else
no fetch needs, so it never runs. Where a copy and its original both lack a reader of one
output, a Pack of the two stands for both readers instead: its shape function tells Grappler
the two have one shape (see `_same_shape_pad`).

Control edges matter too: Grappler's grouping rewrites (AddOpsRewrite, MinimizeBroadcasts) do not
absorb a node that drives a control dependency, so a trigger hung on an Add or a Mul would change
how the backward arithmetic is grouped. And with oneDNN (TensorFlow's default on x86 CPUs), the
layout pass after Grappler merges a `BiasAddGrad` with the `Conv2DBackpropFilter` reading the same
gradient (`MergeConv2DBackpropFilterWithBiasAddGrad`, no cycle check): a trigger hung on the
`BiasAddGrad` whose copies that `Conv2DBackpropFilter` reads makes the merged node wait for
itself, so it and everything after it never run: a MobileNetV3 step built outside the repo
updated 74 of its 499 variables, silently. `can_gate` says which nodes may drive a trigger.
The merge needs the two nodes' control inputs to be the same after Grappler; in a
`tf.gradients` graph the `BiasAddGrad` reaches its `Conv2DBackpropFilter` through the gradient's
`tuple`, which Grappler turns into a control edge between them: no merge. A rewrite adding
another path between them (a trigger waiting on the input's gradient, before the copy the
weights' gradient reads) makes that edge redundant, Grappler drops it, and the two merge into a
node waiting on itself. `keep_apart` keeps them apart: the `Conv2DBackpropFilter` reads the
gradient through an Identity Grappler leaves in place, so the layout pass finds no pair (a
control edge from a kept NoOp did not do: Grappler dropped the edge).
"""

from __future__ import annotations

from collections import Counter
from itertools import chain

import networkx as nx
from tensorflow.core.framework import attr_value_pb2

from ..analysis.split import in_cond_branch, reachable
from ..core.graph import Graph
from ..core.names import PAD_PREFIX
from ..core.tensor_ref import TensorRef

__all__ = ["GROUPED_OPS", "MERGED_OPS", "KEEP_APART_PREFIX", "can_gate", "pad_readers",
           "bias_gradients", "keep_apart"]

# Element-wise ops Grappler regroups across chains; a new control output on one stops that.
GROUPED_OPS = frozenset({"Add", "AddV2", "AddN", "Mul", "Sub", "RealDiv", "Div", "Neg"})
# Ops oneDNN's layout pass merges into a node that may read what a trigger gates.
MERGED_OPS = frozenset({"BiasAddGrad"})


def can_gate(original: Graph, name: str) -> bool:
    """Whether a control edge out of `name` leaves what Grappler, oneDNN's layout pass and a
    reader of the graph see unchanged, and always fires: not a grouped or merged op, not a sink
    of the original (an output stays an output), and not inside a v1 cond branch (dead when
    the branch is not taken, and so is whatever waits on it: a stochastic-depth ResNet's
    swap-ins never ran)."""
    return original.op(name) not in GROUPED_OPS | MERGED_OPS \
        and original.nx.out_degree(name) > 0 and not in_cond_branch(original, name)


KEEP_APART_PREFIX = "graphrewrite/keep_apart/"


def keep_apart(graph: Graph) -> int:
    """Make each `Conv2DBackpropFilter` that a path leads to from a `BiasAddGrad` reading the
    same gradient (seen through Identities) read that gradient through an Identity Grappler
    keeps: oneDNN's layout pass then never merges the two, whose merge would wait for itself.
    Returns the Identities added."""
    kept = 0
    for kernel in [n for n in graph.nodes() if graph.op(n) == "Conv2DBackpropFilter"]:
        name = KEEP_APART_PREFIX + kernel
        if name in graph or len(graph.data_inputs(kernel)) < 3:
            continue
        read = graph.data_inputs(kernel)[2]
        if any(nx.has_path(graph.nx, bias, kernel)
               for bias in bias_gradients(graph, _through_identities(graph, read))):
            attrs = {"T": graph.node_def(kernel).attr["T"],
                     "_grappler_do_not_remove": attr_value_pb2.AttrValue(b=True)}
            graph.add_node(name, "Identity", [read], attrs, device=graph.node_def(kernel).device)
            graph.replace_uses(read, TensorRef(name), [kernel])
            kept += 1
    return kept


def bias_gradients(graph: Graph, gradient: TensorRef) -> list[str]:
    """The `BiasAddGrad`s reading `gradient`: those oneDNN merges with a `Conv2DBackpropFilter`
    reading it too."""
    return [user for user, slot in graph.consumers(gradient)
            if slot == 0 and graph.op(user) == "BiasAddGrad"]


def _through_identities(graph: Graph, ref: TensorRef) -> TensorRef:
    while graph.op(ref.node) == "Identity":
        ref = graph.data_inputs(ref.node)[0]
    return ref


def pad_readers(graph: Graph, original: Graph, analysis, original_of: dict[str, str]) -> int:
    """Give each live tensor of `graph` as many data readers as its original had in `original`
    (`original_of` maps new nodes to the node they stand for); returns the pads added. Where a
    copy and its original both lack a reader of the same output, one pad reads both and tells
    Grappler they have one shape (`_same_shape_pad`)."""
    fetch_nodes = [f.split(":")[0] for f in analysis.fetches]
    _, before = _live_readers(original, fetch_nodes)
    live, after = _live_readers(graph, fetch_nodes)
    shapes, lacking = analysis.shapes, {}
    for name in [n for n in graph.nodes() if n in live]:
        source = original_of.get(name, name)
        if source not in original:
            continue  # a node with no original (a trigger)
        outputs = shapes.outputs(source)
        if name == source:  # an original: its own outputs, no TensorRef made for each
            missing = [ref for ref in outputs for _ in range(before[ref] - after[ref])]
        else:
            missing = [TensorRef(name, ref.port) for ref in outputs
                       for _ in range(before[ref] - after[TensorRef(name, ref.port)])]
        dtypes = [shapes[TensorRef(source, r.port)].dtype for r in missing]
        if missing and all(0 < t < 100 for t in dtypes):  # else a ref or unknown dtype
            lacking[name] = missing
    pads = sum(_same_shape_pad(graph, shapes, lacking, copy, source)
               for copy, source in original_of.items())
    for name, missing in lacking.items():
        if not missing:
            continue
        dtypes = [shapes[TensorRef(original_of.get(name, name), r.port)].dtype for r in missing]
        types = attr_value_pb2.AttrValue.ListValue(type=dtypes)
        attrs = {"T": attr_value_pb2.AttrValue(list=types),
                 "_grappler_do_not_remove": attr_value_pb2.AttrValue(b=True)}
        graph.add_node(graph.unique_name(PAD_PREFIX + name), "IdentityN", missing, attrs,
                       device=graph.node_def(name).device)
        pads += 1
    return pads


def _same_shape_pad(graph: Graph, shapes, lacking: dict, copy: str, source: str) -> int:
    """A never-run Pack of the original's and the copy's output, standing for one missing
    reader of each. Grappler's shape inference skips the shapes of tensors fed to the session
    (graph inputs), so what is computed from one can get symbolic dimensions of its own: a copy
    chain starting at a fed input (a first layer's) got shapes Grappler could not tell equal to
    its original's, and MinimizeBroadcasts then refused to group the chain's Mul nodes as it did
    in the original (the Gelu gradient of the first layer, issue 14).
    Pack's shape function merges its inputs' shapes, and Grappler applies such merges to the
    whole graph. Returns 1 if a pad was added."""
    ports = [r.port for r in lacking.get(source, [])]
    match = next((r for r in lacking.get(copy, []) if r.port in ports), None)
    if match is None:
        return 0
    lacking[copy].remove(match)
    lacking[source].remove(TensorRef(source, match.port))
    attrs = {"T": attr_value_pb2.AttrValue(type=shapes[TensorRef(source, match.port)].dtype),
             "N": attr_value_pb2.AttrValue(i=2), "axis": attr_value_pb2.AttrValue(i=0),
             "_grappler_do_not_remove": attr_value_pb2.AttrValue(b=True)}
    graph.add_node(graph.unique_name(f"{PAD_PREFIX}{copy}/same_shape"), "Pack",
                   [TensorRef(source, match.port), match], attrs,
                   device=graph.node_def(copy).device)
    return 1


def _live_readers(graph: Graph, fetch_nodes: list[str]) -> tuple[set[str], Counter]:
    """Nodes a fetch needs, and how many data inputs of those nodes read each tensor."""
    live = reachable(graph.nx, fetch_nodes, upstream=True)
    # Counted in C over the graph's cached input lists (most of them cached by a simulation).
    return live, Counter(chain.from_iterable(graph.data_inputs_of([v for v in live
                                                                    if v in graph]).values()))
