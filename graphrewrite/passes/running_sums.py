"""Sums Grappler runs as running sums in the original step, made running sums in the rewrite.

Grappler's memory optimizer (`SchedulingPass`) turns an AddN of three or more terms into a
running sum (a `TemporaryVariable`, an `AssignAdd` per term, `DestroyTemporaryVariable` for
the result) when the step's estimated peak exceeds 80% of the device's memory and a term is
live at that peak. The running sum adds the terms in the order they arrive, which rounds
otherwise than the AddN kernel's left-to-right sum. A rewrite moves the estimated peak, so
Grappler can make the running sum in the original and not in the rewrite: a 12-layer MLP
with batch norm and Adagrad built outside the repo (a CPU's device memory is 256 MiB to
Grappler) differed by 2e-4 after two steps in mode swap, through one batch norm's input
gradient. So each AddN the original step as run sums that way, and the rewrite as run does
not, is written as the same running sum: Grappler leaves it as it is, and both steps add the
same terms the same way.
"""

from __future__ import annotations

from tensorflow.core.framework import attr_value_pb2

from ..core.graph import Graph
from ..core.tensor_ref import CONTROL, TensorRef

__all__ = ["SUM_OPS", "running_sums", "missing", "make_running"]

SUM_OPS = ("AddN", "AccumulateNV2")  # what Grappler's SchedulingPass makes running sums of
RESULT_OP = "DestroyTemporaryVariable"
VARIABLE, ZEROS, START, TERM = "/tmp_var", "/tmp_var_zeros", "/tmp_var_initializer", \
    "/tmp_var_accum_"  # Grappler's names for the parts


def running_sums(as_run: Graph) -> dict[str, tuple[set[str], str, object]]:
    """The sums `as_run` (a step as Grappler returned it) adds as running sums: name -> (the
    nodes its terms come from, the node its zeros wait for, its variable's shape attribute)."""
    sums = {}
    for name in as_run.nodes():
        variable = name + VARIABLE
        if as_run.op(name) != RESULT_OP or variable not in as_run:
            continue
        terms = {as_run.data_inputs(c)[1].node for c in as_run.control_inputs(name)
                 if c.startswith(name + TERM)}
        waits = as_run.control_inputs(variable)
        sums[name] = terms, waits[-1] if waits else "", as_run.node_def(variable).attr["shape"]
    return sums


def missing(original: Graph, rewritten: Graph, graph: Graph) -> dict:
    """The running sums of `original`'s step as run (`running_sums`) that `rewritten`'s lacks,
    which `graph` (the rewrite as written) still has as the same sum of the same terms."""
    made = running_sums(rewritten)
    return {name: found for name, found in running_sums(original).items()
            if name not in made and name in graph and graph.op(name) in SUM_OPS
            and {_source(graph, ref) for ref in graph.data_inputs(name)} == found[0]}


def make_running(graph: Graph, sums: dict) -> list[str]:
    """Write each of `sums` (`missing`) in `graph` as Grappler writes it; returns their names."""
    for name, (_, waits_for, shape) in sorted(sums.items()):
        node = graph.node_def(name)
        dtype = attr_value_pb2.AttrValue(type=node.attr["T"].type)
        terms, device = graph.data_inputs(name), node.device
        first = next((ref for ref in terms if _source(graph, ref) == waits_for), terms[0])
        variable = graph.add_node(name + VARIABLE, "TemporaryVariable",
                                  [TensorRef(first.node, CONTROL)],
                                  {"dtype": dtype, "shape": shape, "var_name":
                                   attr_value_pb2.AttrValue(s=(name + VARIABLE).encode())},
                                  device)
        zeros = graph.add_node(name + ZEROS, "ZerosLike", [first], {"T": dtype}, device)
        start = graph.add_node(name + START, "Assign", [TensorRef(variable), TensorRef(zeros)],
                               {"T": dtype, "use_locking": attr_value_pb2.AttrValue(b=False),
                                "validate_shape": attr_value_pb2.AttrValue(b=False)}, device)
        added = [graph.add_node(f"{name}{TERM}{i}", "AssignAdd", [TensorRef(start), term],
                                {"T": dtype, "use_locking": attr_value_pb2.AttrValue(b=True)},
                                device) for i, term in enumerate(terms)]
        waits = [TensorRef(c, CONTROL) for c in (*added, *graph.control_inputs(name))]
        attrs = {"T": dtype, "var_name": attr_value_pb2.AttrValue(s=(name + VARIABLE).encode())}
        if "_output_shapes" in node.attr:
            attrs["_output_shapes"] = node.attr["_output_shapes"]
        graph.redefine(name, RESULT_OP, [TensorRef(start), *waits], attrs)
    return sorted(sums)


def _source(graph: Graph, ref: TensorRef) -> str:
    """The node `ref`'s value comes from, through Identities (Grappler removes them)."""
    while graph.op(ref.node) == "Identity" and graph.data_inputs(ref.node):
        ref = graph.data_inputs(ref.node)[0]
    return ref.node
