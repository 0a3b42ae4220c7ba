"""Everything the planner and `inspect` know about a model: shapes, split, memory, FLOPs.

Analyses only read the graph. `analyse` runs them in order, once.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..core import dtypes
from ..core.errors import GraphRewriteError
from ..core.graph import Graph
from ..core.io import Model
from ..core.names import PAD_PREFIX
from . import bind
from . import flops as flops_mod
from . import memory, parameters, scratch
from . import shapes as shapes_mod
from . import split as split_mod

__all__ = ["AnalysisOptions", "Analysis", "sinks", "default_fetches", "analyse", "analyse_inlined",
           "SIZED_BY_DATA", "unknown_size_hint", "start_as_run", "as_run", "as_run_step"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnalysisOptions:
    """What a user tells the analyses about a step; it travels as one from the front end (the
    CLI's --input-shape, --outputs, --backward-scope, --device) to every analysis of the step
    and of its rewrites. `input_shapes` fixes unknown input dimensions ({name: dims}),
    `fetches` names what one step runs (default: found, `default_fetches`), `backward_scope`
    the name prefix where the backward pass starts (default: found from the gradient seeds),
    `device` the kind of device the step is modelled on (default: from its placement)."""

    input_shapes: dict | None = None
    fetches: list[str] | None = None
    backward_scope: str | None = None
    device: str | None = None


@dataclass
class Analysis:
    fetches: list[str]
    shapes: shapes_mod.Shapes
    split: split_mod.Split | None  # None (and `flops` 0) when analysed for the report alone
    memory: memory.MemoryReport
    flops: int
    sized_by_data: tuple = ()  # unknown sizes no --input-shape can fix (`SIZED_BY_DATA`, strings)
    unknown_hint: str = ""  # what to do about the other unknown sizes (`unknown_size_hint`)
    options: AnalysisOptions = AnalysisOptions()  # what it was asked: its rewrites' analyses too
    # (the graph asked about, weakly held; its parameters): `parameters`'s last answer
    _parameters: tuple = field(default=(None, frozenset()), init=False, repr=False,
                               compare=False)

    def parameters(self, graph: Graph) -> frozenset:
        """`parameters.parameter_nodes` of `graph`, the graph analysed (with the split's
        constant-valued nodes), found once: the defer pass and the recompute planner's context
        both ask for it (2 s at 99k nodes). Asked of another graph, it is found again."""
        held, found = self._parameters
        if held is None or held() is not graph:
            found = parameters.parameter_nodes(graph, self.split.constant)
            self._parameters = (weakref.ref(graph), found)
        return found


def sinks(graph: Graph) -> list[str]:
    """Nodes nothing reads (not even by a control edge): the graph's natural outputs. Fan-out
    pads are hints for Grappler, not outputs."""
    return [n for n in graph.nodes()
            if graph.nx.out_degree(n) == 0 and not n.startswith(PAD_PREFIX)]


def default_fetches(model: Model, graph: Graph | None = None,
                    shapes: shapes_mod.Shapes | None = None,
                    split: split_mod.Split | None = None) -> list[str]:
    """What one training step fetches: a MetaGraphDef's `train_op` collection (or what waits
    on its ops, `_run_after`) with its `losses` and the loss (what the gradient seeds
    differentiate, from `split` or found here), a TF2 step's returned `Identity` nodes (they
    wait on its updates by control edges), else the sinks of the graph that can be fetched:
    not inside a while-loop frame, and (given `shapes`) holding a numeric tensor or nothing at
    all; of a graph with a backward pass, only those the gradient flow ends in and the loss
    (not initialisers, savers, metrics or a Keras model's unused outputs), and where some of
    them write, not the values the others compute and nothing reads (`_drops_a_value`)."""
    graph = graph or model.graph
    found = _collected(model, graph, split) or _signed(model, graph) \
        or _sinks_of_the_step(graph, split)
    if shapes is None:
        return found
    return [n for n in found if not shapes.outputs(n.split(":")[0])
            or dtypes.base(shapes[shapes.outputs(n.split(":")[0])[0]].dtype)
            not in dtypes.HANDLES]


def _signed(model: Model, graph: Graph) -> list[str]:
    """The outputs of a SavedModel's signatures (`node` or `node:port`): what a user calling
    it runs, not its saver's or initialiser's nodes. Of several signatures, the ones that
    train (a gradient op, or a call of a function holding one, among what they run), when any
    does; TensorFlow's own (`__saved_model_init_op`) aside."""
    meta = model.meta_graph
    if meta is None:
        return []
    signed = [[t.name[:-2] if t.name.endswith(":0") else t.name
               for _, t in sorted(signature.outputs.items())]
              for key, signature in sorted(meta.signature_def.items())
              if not key.startswith("__")]
    signed = [names for names in signed if all(n.split(":")[0] in graph for n in names)]
    backward = split_mod.backward_functions(graph.shell.library)

    def trains(names: list[str]) -> bool:
        runs = split_mod.reachable(graph.nx, [n.split(":")[0] for n in names], upstream=True)
        return any(split_mod.is_gradient_op(graph.op(n)) or graph.op(n) in split_mod.CALL_OPS
                   and graph.node_def(n).attr["f"].func.name in backward for n in runs)
    training = [names for names in signed if trains(names)]
    return list(dict.fromkeys(n for names in training or signed for n in names))


def _collected(model: Model, graph: Graph, split: split_mod.Split | None) -> list[str]:
    """A MetaGraphDef's `train_op` collection (what waits on it), its `losses` and the loss
    the gradient seeds differentiate; none without the collection."""
    meta = model.meta_graph
    if meta is not None and "train_op" in meta.collection_def:
        names = list(meta.collection_def["train_op"].node_list.value)
        trains = len(names)
        if "losses" in meta.collection_def:
            names += list(meta.collection_def["losses"].node_list.value)
        found = [n.split(":")[0].lstrip("^") for n in names]
        if all(n in graph for n in found):
            found = _run_after(graph, found[:trains]) + found[trains:]
            # The collected loss need not be the one minimised (an estimator adds its
            # regularisation to it): the differentiated loss is fetched too, unless it is
            # a collected one renamed.
            fetched = {_through_identities(graph, n) for n in found}
            in_loop = split_mod.loop_frame_nodes(graph)
            found += [n for n in (split or split_mod.split(graph)).differentiated
                      if _through_identities(graph, n) not in fetched and n not in in_loop]
            return list(dict.fromkeys(found))
    return []


def _sinks_of_the_step(graph: Graph, split: split_mod.Split | None) -> list[str]:
    """The sinks a step's run fetches (see `default_fetches`)."""
    in_loop = split_mod.loop_frame_nodes(graph)
    found = [n for n in sinks(graph) if n not in in_loop]
    returned = [n for n in found if graph.op(n) == "Identity" and graph.control_inputs(n)]
    if returned and bind.resource_placeholders(graph):
        # A TF2 step: it returns these, and they wait on its updates; the other sinks are
        # values the function computed and dropped (TensorFlow prunes them).
        return returned
    split = split or split_mod.split(graph)
    if split.seeds:
        found = [n for n in found if n in split.gradient_flow or n in split.differentiated]
        flow = [n for n in found if n in split.gradient_flow]
        if any(not _drops_a_value(graph, n) for n in flow):
            found = [n for n in found if n not in flow or not _drops_a_value(graph, n)]
        # the loss, also where it is no sink (Keras's TF1 train function waits on it)
        found += [n for n in split.differentiated if n not in found and n not in in_loop]
    return found


def _drops_a_value(graph: Graph, name: str) -> bool:
    """A sink that computes a value, writes nothing and waits for no write: where a step also
    writes (variable writes, updates, groups of them, reads ordered after them), a value its
    backward pass computed and nothing read (the gradient of a constant divisor, which a
    ConvNeXt's verify compared; a TF1 gradient `tuple`'s identity of an input's gradient no
    update reads, which waits for the op's other gradients: a session's `graph_def` of a deep
    MLP listed 32 of a dropout's)."""
    return split_mod.computes_a_value(graph, name) and not any(
        _waits_for_a_write(graph, n) for n in graph.control_inputs(name))


def _waits_for_a_write(graph: Graph, name: str) -> bool:
    """Whether `name` writes (or is an op not known to compute a value), or is a group that
    waits for one that does."""
    todo, seen = [name], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if graph.op(name) == "NoOp":
            todo += graph.control_inputs(name)
        elif not split_mod.computes_a_value(graph, name):
            return True
    return False


def _through_identities(graph: Graph, name: str) -> str:
    """The node whose value `name` passes on unchanged through `Identity` ops."""
    while graph.op(name) == "Identity" and graph.inputs(name):
        name = graph.inputs(name)[0].node
    return name


def _run_after(graph: Graph, collected: list[str]) -> list[str]:
    """The collected train ops, each replaced by the groups (NoOp sinks) that wait on it where
    there are any: what the user runs is the end of the step (an
    `ExponentialMovingAverage.apply` made under a control dependency on the optimizer's op, a
    `tf.group` of it with the batch-norm updates), and the collection holds only what
    `minimize` put there. Not any sink: a second optimizer built under a control dependency on
    the first (a GAN's) leaves dead gradient values waiting on it too."""
    ends = {n for n in sinks(graph) if graph.op(n) == "NoOp"}
    fetched = []
    for name in collected:
        after = sorted(split_mod.reachable(graph.nx, [name]) & ends - {name})
        fetched += after or [name]
    return list(dict.fromkeys(fetched))


def analyse(model: Model, graph: Graph | None = None, options: AnalysisOptions | None = None,
            shapes: shapes_mod.Shapes | None = None, planned: bool = True,
            report: memory.MemoryReport | None = None) -> Analysis:
    """Shapes (unless given), forward/backward split, simulated step memory and FLOPs, as
    `options` say. Without `planned`, no split and no FLOPs: what a pipeline reports of the
    graph its last pass wrote (on a 100k-node graph the split of the rewritten one took 5 s).
    `report`: the step already simulated with these fetches and no `device` (by the pass that
    wrote the graph), not simulated again."""
    graph = graph or model.graph
    options = options or AnalysisOptions()
    fetches, device = options.fetches, options.device
    missing = [f for f in fetches or [] if f.split(":")[0] not in graph]
    if missing:
        raise GraphRewriteError(f"output '{missing[0]}' is not a node of the graph")
    shapes = shapes or shapes_mod.infer(graph, options.input_shapes)
    split = split_mod.split(graph, options.backward_scope) if planned else None
    fetches = fetches or default_fetches(model, graph, shapes, split)
    fetch_nodes = list(dict.fromkeys(f.split(":")[0] for f in fetches))
    if report is None or device is not None:
        report = memory.simulate(graph, shapes, fetch_nodes, device)
    total = flops_mod.total_flops(graph, shapes, report.order) if planned else 0
    compiled = split_mod.xla_calls(graph)
    if compiled:
        log.warning("%d calls are compiled by XLA (jit_compile=True), e.g. %s: XLA plans the "
                    "memory inside them itself; the model as run counts their bodies as "
                    "TensorFlow's executor would run them (an estimate), as written only what "
                    "they return", len(compiled), compiled[0])
    blind = parameters.unknown_variables(graph, shapes)
    if blind:
        log.warning("%d captured variables have no recorded value shape and count 0 bytes "
                    "(e.g. %s); %s", len(blind), blind[0], bind.export_hint(graph, blind[0]))
    by_data = _sized_by_data(graph, shapes, report.unknown)
    if by_data:
        log.info("%d tensors have a size only the data decides (e.g. %s) and count 0 bytes",
                 len(by_data), by_data[0])
    unknown = [r for r in report.unknown if r not in by_data]
    hint = unknown_size_hint(graph, shapes) if unknown else ""
    if unknown:
        log.warning("%d tensors have an unknown size and count 0 bytes (e.g. %s); %s",
                    len(unknown), ", ".join(str(r) for r in unknown[:3]), hint)
    return Analysis(fetch_nodes, shapes, split, report, total, tuple(by_data), hint, options)


# Ops whose output size depends on the values they read, not on shapes (an embedding's sparse
# gradient: the ids it saw, once each); no --input-shape can fix those.
SIZED_BY_DATA = frozenset({"Unique", "UniqueV2", "UniqueWithCounts", "Where", "ListDiff",
                           "SetDiff1D", "NonMaxSuppressionV3", "NonMaxSuppressionV4",
                           "NonMaxSuppressionV5", "SparseFillEmptyRows", "DynamicPartition",
                           "ComputeAccidentalHits"})


def unknown_size_hint(graph: Graph, shapes: shapes_mod.Shapes) -> str:
    """What to do about sizes left unknown: fix an input's unknown dimensions, where one has
    some; where every input's shape is known, no --input-shape helps."""
    fed = [r for n in split_mod.fed_inputs(graph) for r in shapes.outputs(n)]
    if any(shapes[r] is None or shapes[r].shape is None or None in shapes[r].shape
           for r in fed):
        return "fix input dimensions with --input-shape"
    return "every input's shape is known: ops TensorFlow cannot size made them"


def _sized_by_data(graph: Graph, shapes: shapes_mod.Shapes, unknown: list) -> list:
    """The unknown-size tensors computed from a SIZED_BY_DATA op's output, however many ops
    downstream (a mixture of experts' expert products and their gradients), the strings (an
    assertion's message: its bytes are its text) and a `tf.data` iterator's handle."""
    if not unknown:
        return []
    strings = {r for r in unknown if shapes[r] is not None
               and dtypes.base(shapes[r].dtype) == dtypes.STRING}
    handles = bind.iterators(graph)
    strings |= {r for r in unknown if r.node in handles}  # its elements' bytes
    found: set[str] = set()
    for name in graph.topological_order():
        if graph.op(name) in SIZED_BY_DATA or any(r.node in found
                                                  for r in graph.data_inputs(name)):
            found.add(name)
    return [r for r in unknown if r.node in found or r in strings]


def analyse_inlined(model: Model, options: AnalysisOptions | None = None
                    ) -> tuple[Analysis, Graph, list[str]]:
    """`analyse` of the step with the calls that hold its passes spliced in (`inline`: a
    SavedModel's signature calls the step, a nested `tf.function` its forward pass), as the
    inline pass does before every rewrite: otherwise a call is one opaque node, with no
    backward pass and no FLOPs (a SavedModel's EfficientNet: 5 backward nodes, 34.7 MiB as
    written where TensorFlow measured 575). Returns the analysis, the graph it is of, and the
    calls inlined (none: the model's own graph)."""
    from . import inline

    options = options or AnalysisOptions()
    inlined = (inline.inline_gradient_calls(model.graph.to_graph_def())
               if model.graph.shell.library.function else None)
    if inlined is None:
        return analyse(model, model.graph, options), model.graph, []
    graph = Graph.from_graph_def(inlined[0])
    fetches = options.fetches or default_fetches(model)  # the original's: a call's name stays
    return analyse(model, graph, dataclasses.replace(options, fetches=fetches)), graph, inlined[1]


def start_as_run(model: Model, graph: Graph, found: Analysis) -> Future:
    """`as_run`'s Grappler call, begun in the background (`grappler.as_run_soon`)."""
    from . import grappler, inline

    graph_def = graph.to_graph_def()
    inlined = inline.inline_calls(graph_def)  # a TF2 Keras RNN's calls, as run
    if inlined is None:
        return grappler.as_run_soon(graph_def, found.fetches, model.meta_graph)
    # The runtime runs a kept call's body whole, every result made: Grappler keeps them all.
    returned = {n.name for n in graph_def.node if n.op in inline.CALL_OPS} & \
        {n.name for n in inlined.node if n.op == "IdentityN"}
    started = grappler.as_run_soon(inlined, [*found.fetches, *sorted(returned)],
                                   model.meta_graph)
    started.inlined = inlined  # its bodies' recorded shapes, which Grappler drops
    return started


def as_run(model: Model, graph: Graph, found: Analysis, started: Future | None = None
           ) -> memory.MemoryReport | None:
    """The simulated step of `graph` as TensorFlow runs it, after Grappler (see `grappler.py`);
    None when Grappler cannot process the graph. `found` is `graph`'s analysis: the tensors
    Grappler keeps (same name, op and inputs) keep their shapes (its output records none, and
    a TF2 step's variable reads cannot be inferred without them; a node it made under an old
    name, `mul_1` a scalar product where a [7,16,64] one was, would get a false shape that
    the importer refuses, and every size with it). `started`: `start_as_run`'s
    Grappler call for this graph, when it was begun earlier. The input shapes and device are
    `found`'s options."""
    step = as_run_step(model, graph, found, started)
    return None if step is None else step[2]


def as_run_step(model: Model, graph: Graph, found: Analysis, started: Future | None = None
                ) -> tuple[Graph, shapes_mod.Shapes, memory.MemoryReport] | None:
    """`as_run`, with the graph Grappler returned and its shapes beside the report."""
    from . import grappler

    started = started or start_as_run(model, graph, found)
    optimized = grappler.finish(started)
    if optimized is None:
        return None
    bodies = Graph.from_graph_def(started.inlined) if hasattr(started, "inlined") else None
    for name in optimized.nodes():  # the same node: Grappler reuses names for new ones too
        if name in graph and graph.op(name) == optimized.op(name) \
                and graph.data_inputs(name) == optimized.data_inputs(name):
            shapes_mod.record(optimized, name, found.shapes)
        elif bodies is not None and name in bodies and bodies.op(name) == optimized.op(name) \
                and bodies.data_inputs(name) == optimized.data_inputs(name) \
                and "_output_shapes" in bodies.node_def(name).attr:
            optimized.set_attr(name, "_output_shapes",
                               bodies.node_def(name).attr["_output_shapes"])
    kept = [f for f in found.fetches if f.split(":")[0] in optimized]
    device = found.options.device
    if device is None and scratch.device_kind(graph) == "gpu":  # placement Grappler may drop
        device = "gpu"
    shapes = shapes_mod.infer(optimized, found.options.input_shapes, logging.INFO)
    return optimized, shapes, memory.simulate(optimized, shapes, kept, device, executor=True)
