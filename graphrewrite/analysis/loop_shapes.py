"""Shapes inside v1 while loops that TensorFlow's shape inference leaves unknown, refined by
inferring again with each loop variable at its initial shape.

A v2 loop lowered by Grappler keeps the forward pass for its gradient in TensorLists whose
`element_shape` is unknown (-1): the gradient loop's pops, and everything computed from them,
get their shapes from what the forward loop pushed (measured on a lowered while_v2 RNN: its
weight gradient's terms were otherwise of unknown size, and counted as nothing)."""

from __future__ import annotations

import copy
import logging

from tensorflow.core.framework import types_pb2

from .loops import ENTER, MERGE, NEXT, PASS_THROUGH

# Writers: op -> the input that holds the element it adds (a scatter's or a list made from a
# tensor: the elements are that tensor's rows).
_WRITTEN = {"StackPushV2": 1, "TensorArrayWriteV3": 2, "TensorListPushBack": 1,
            "TensorListSetItem": 2, "TensorArrayScatterV3": 2, "TensorListFromTensor": 0}
_ROWS = ("TensorArrayScatterV3", "TensorListFromTensor")
# Readers of one element, inferred again with it at the shape written.
_READ = ("StackPopV2", "TensorArrayReadV3", "TensorListGetItem", "TensorListPopBack")

__all__ = ["merge_into", "refine_shapes", "reinfer"]

log = logging.getLogger(__name__)


def refine_shapes(graph_def, inferred: dict, infer) -> None:
    """Fill in the shapes inside v1 loops that inference left unknown (`inferred`: node ->
    [(dtype, shape)] per output, updated in place), by inferring once more
    with each loop variable at its initial shape (`Enter` constant, the `NextIteration` input of
    each `Merge` cut) and each popped or read element at the shape pushed or written. Kept
    where every refined loop variable's next iteration has the shape it started with; `infer`
    is `shapes.tensorflow_shapes`."""
    nodes = {n.name: n for n in graph_def.node}
    if not any(n.op in NEXT for n in nodes.values()):
        return
    varying: set[str] = set()
    known: dict[str, tuple[int, tuple]] = {}
    for _ in range(4):
        refined = infer(_cut_loops(graph_def, nodes, varying, known))
        more = _varying_merges(nodes, refined) - varying
        if more:
            varying |= more
            continue
        learned = _element_shapes(nodes, refined)
        if all(known.get(k) == v for k, v in learned.items()):
            break
        known.update(learned)
    else:
        log.info("the shapes inside the graph's loops did not settle; left as inferred")
        return
    merge_into(inferred, refined)


def _cut_loops(graph_def, nodes, varying: set[str], elements: dict):
    trial = copy.deepcopy(graph_def)
    popped = []  # a list's pop: its element from a placeholder, its list passed on
    for node in trial.node:
        if node.op in ENTER:
            node.attr["is_constant"].b = True
        elif node.op in MERGE and node.name not in varying:
            data = [i for i in node.input if not i.startswith("^")]
            kept = [i if i.startswith("^") or nodes[_name(i)].op not in NEXT else data[0]
                    for i in node.input]
            del node.input[:]
            node.input.extend(kept)
        elif node.name in elements and node.op == "TensorListPopBack":
            dtype, _ = elements[node.name]
            node.input[1] = node.name + "/_element"
            node.op = "IdentityN"
            node.ClearField("attr")
            node.attr["T"].list.type.extend([types_pb2.DT_VARIANT, dtype])
            popped.append(node.name)
        elif node.name in elements:  # a pop or read: a placeholder of the element's shape
            kept = [i for i in node.input if i.startswith("^")]
            del node.input[:]
            node.input.extend(kept)
            _placeholder(node, *elements[node.name])
    for name in popped:
        _placeholder(trial.node.add(name=name + "/_element"), *elements[name])
    return trial


def reinfer(graph_def, inferred: dict, stand_ins: dict, infer) -> None:
    """Infer again with each node of `stand_ins` (name -> (dtype, shape)) a placeholder of that
    shape (its control inputs kept), and fill in what `inferred` left unknown from it."""
    trial = copy.deepcopy(graph_def)
    for node in trial.node:
        if node.name in stand_ins:
            kept = [i for i in node.input if i.startswith("^")]
            del node.input[:]
            node.input.extend(kept)
            _placeholder(node, *stand_ins[node.name])
    merge_into(inferred, infer(trial))


def _placeholder(node, dtype: int, shape: tuple) -> None:
    node.op = "Placeholder"
    node.ClearField("attr")
    node.attr["dtype"].type = dtype
    for dim in shape:
        node.attr["shape"].shape.dim.add(size=dim)


def _element_shapes(nodes, inferred) -> dict[str, tuple[int, tuple]]:
    """Pops and reads (`_READ`) -> the (dtype, shape) their container's writers
    add, where all writers agree and the shape is known."""
    written: dict[str, set] = {}
    for node in nodes.values():
        if node.op in _WRITTEN:
            data = [i for i in node.input if not i.startswith("^")]
            source = node.name if node.op == "TensorListFromTensor" \
                else _source_name(nodes, data[0])  # the list it adds to
            shape = _shape_of(inferred, data[_WRITTEN[node.op]])
            if shape is None or shape[1] is None or None in shape[1]:
                written.setdefault(source, set()).add(None)
                continue
            if node.op in _ROWS:
                shape = (shape[0], shape[1][1:])
            written.setdefault(source, set()).add(shape)
    found = {}
    for node in nodes.values():
        if node.op in _READ:
            data = [i for i in node.input if not i.startswith("^")]
            options = written.get(_source_name(nodes, data[0]), set())
            if len(options) == 1 and None not in options:
                found[node.name] = next(iter(options))
    return found


def _source_name(nodes, text: str) -> str:
    """The container `text` (a handle or list) belongs to: the loop variable nearest the op that
    made it (its Merge), else that op. Grappler merges equal EmptyTensorLists, so two lists of
    different elements can share their maker but not the variable each loop carries."""
    name, seen, merge = _name(text), set(), None
    while nodes[name].op in PASS_THROUGH and name not in seen:
        seen.add(name)
        if nodes[name].op in MERGE:
            merge = name
        data = [i for i in nodes[name].input if not i.startswith("^")]
        if not data:
            break
        name = _name(data[0])
    return merge or name


def _varying_merges(nodes, inferred) -> set[str]:
    """Merges whose next iteration's shape differs from their first one's (known dims)."""
    found = set()
    for node in nodes.values():
        if node.op not in MERGE:
            continue
        data = [i for i in node.input if not i.startswith("^")]
        start = _shape_of(inferred, data[0]) if data else None
        for text in data[1:]:
            if nodes[_name(text)].op not in NEXT:
                continue
            update = nodes[_name(text)].input[0] if nodes[_name(text)].input else None
            after = _shape_of(inferred, update) if update else None
            if start is not None and after is not None and not _compatible(start[1], after[1]):
                found.add(node.name)
    return found


def _shape_of(inferred, text: str):
    name, _, port = text.partition(":")
    outputs = inferred.get(name)
    port = int(port) if port.isdigit() else 0
    if not outputs or port >= len(outputs):
        return None
    return outputs[port]


def _compatible(a, b) -> bool:
    if a is None or b is None:
        return True
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def merge_into(inferred, refined) -> None:
    """Dimensions `inferred` left unknown, from `refined` where the two agree."""
    for name, outputs in inferred.items():
        better = refined.get(name, [])
        for port, (dtype, shape) in enumerate(outputs):
            if port >= len(better) or better[port][1] is None:
                continue
            new = better[port][1]
            if shape is None:
                outputs[port] = (dtype, new)
            elif None in shape and _compatible(shape, new):
                outputs[port] = (dtype, tuple(b if a is None else a for a, b in zip(shape, new)))


def _name(text: str) -> str:
    return text.lstrip("^").split(":")[0]
