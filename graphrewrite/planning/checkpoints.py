"""Which forward tensors to keep (checkpoints) and which nodes may be recomputed at all.

Policies are small named functions, as JAX's remat policies are:

- `memory`: bottleneck tensors of the forward pass (every path from the main inputs to the loss
  runs through them), balanced by the bytes the backward pass reads between them. Bottlenecks
  are dominators, found in near-linear time (Cooper, Harvey and Kennedy, via networkx), not by
  the seed's quadratic search; small side inputs (labels, token ids reused as targets, masks)
  cannot hide them (see `bottlenecks`). The policy offers sets spread evenly by bytes or by
  position, tapered towards the loss, or by a greedy walk under a byte budget that counts what
  is held (checkpoints below, gradients above), at log-spaced counts and budgets; the recompute
  pass keeps the one whose rewritten graph models the lowest peak, fine-tunes its count or
  budget, then tries dropping the checkpoints live at that peak. `two_level` gives the
  candidates whose early checkpoints are recomputed ahead rather than held.
- `speed`: outputs of the expensive ops (MatMul, BatchMatMul, Conv*, Einsum), by op type.
- `collection`: what `--checkpoints` selects, else a MetaGraphDef collection named `checkpoints`.
- `manual`: Grappler's `_recompute_hint` attribute marks the nodes to recompute; the rest is kept.

Never recomputed (they act as checkpoints, and the report says why): inputs, constants and
anything computed only from constants (TensorFlow's constant folding would turn copies into new
constants), variable reads, stateful and random ops (a recomputed dropout mask is a silent wrong
answer), nodes inside v1 while-loop frames, function calls (While, If, PartitionedCall).
"""

from __future__ import annotations

import bisect
import functools
import itertools

import networkx as nx

from ..analysis.memory import ALIAS_OPS
from ..analysis.schedule import needed_nodes
from ..analysis.split import reachable
from ..core import dtypes
from ..core.errors import GraphRewriteError
from ..core.ops import PLACEHOLDER_OPS
from ..core.selectors import select
from ..core.tensor_ref import TensorRef
from .context import CALL_OPS, Context

__all__ = ["EXPENSIVE_OPS", "LARGE_FRACTION", "speed_policy", "collection_policy", "manual_policy",
           "memory_policy", "TWO_LEVEL_GRID", "TWO_LEVEL_STEP", "two_level", "FINE_COUNTS",
           "POLICIES", "bottlenecks", "why_no_candidates", "CHAIN_GAP", "budgeted"]

EXPENSIVE_OPS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv3D",
    "DepthwiseConv2dNative", "Einsum", "_FusedMatMul", "_FusedConv2D",
})
# An activation is "large" when it holds at least this fraction of the largest one: entries and
# bottlenecks must be large, so small side inputs and scalars are neither.
LARGE_FRACTION = 1 / 64


# --------------------------------------------------------------------------- policies

def speed_policy(ctx: Context) -> list[set[str]]:
    """Keep the outputs of expensive ops; recompute the cheap rest."""
    graph = ctx.graph
    return [{n for n in ctx.analysis.split.forward if graph.op(n) in EXPENSIVE_OPS}]


def collection_policy(ctx: Context, selectors: str | None, meta_graph=None) -> list[set[str]]:
    """Keep what the selectors (or the MetaGraphDef's `checkpoints` collection) name."""
    if selectors:
        return [set(select(ctx.graph, selectors))]
    if meta_graph is None or "checkpoints" not in meta_graph.collection_def:
        raise GraphRewriteError("mode 'collection' needs ${checkpoints} (selectors), or a "
                                "MetaGraphDef with a 'checkpoints' collection")
    collection = meta_graph.collection_def["checkpoints"]
    names = list(collection.node_list.value) or [
        v.decode() for v in collection.bytes_list.value]
    return [set(select(ctx.graph, ",".join(names)))]


def manual_policy(ctx: Context) -> list[set[str]]:
    """Recompute what carries `_recompute_hint`; keep every other forward node."""
    graph = ctx.graph
    hinted = {n for n in graph.nodes() if "_recompute_hint" in graph.node_def(n).attr}
    return [set(ctx.analysis.split.forward) - hinted]


def memory_policy(ctx: Context, near: set[str] | None = None) -> list[set[str]]:
    """Candidate checkpoint sets drawn from the bottlenecks in four ways: `count` of them
    splitting the bytes the backward pass reads evenly, or tapered, or their positions evenly
    (counts log-spaced, sqrt(N) among them), and the greedy walk under a byte `budget`.
    With `near`, one of those sets: its spread again at the parameters between its neighbours,
    to fine-tune it."""
    if ctx._spreads is None:
        ctx._spreads = _spreads(ctx)
    if near is None:
        found = [spread(p) for spread, params in ctx._spreads for p in params]
    else:
        found = []
        for spread, params in ctx._spreads:
            i = next((i for i, p in enumerate(params) if set(spread(p)) == near), None)
            if i is not None:
                low, high = params[max(i - 1, 0)], params[min(i + 1, len(params) - 1)]
                found = [spread(p) for p in _between(low, high)]
                break
    unique = []
    for chosen in map(set, found):
        if chosen and chosen not in unique and chosen != near:
            unique.append(chosen)
    return unique


def _spreads(ctx: Context) -> list[tuple]:
    """(spread, its coarse parameters) for the memory policy; each spread maps a count or a
    budget to bottlenecks."""
    chain, needed, sizes, fetched = _chain(ctx)
    spreads = []
    if chain:
        budgets = [needed[-1] * j / 24 for j in range(1, 13)]
        spreads = [(functools.partial(_even, chain, needed), _counts(len(chain))),
                   (functools.partial(_even, chain, list(range(1, len(chain) + 1))),
                    _counts(len(chain))),
                   (functools.partial(_even, chain, needed, tapered=True), _counts(len(chain))),
                   (functools.partial(budgeted, chain, needed, sizes, fetched), budgets)]
    gap = _frontiers(ctx, chain, needed)
    if gap is not None:
        line, weights, frontier = gap
        spreads += [(functools.partial(_even_frontiers, line, weights, frontier),
                     _counts(len(line))),
                    (functools.partial(_even_frontiers, line, weights, frontier, tapered=True),
                     _counts(len(line)))]
    return spreads


def _counts(length: int) -> list[int]:
    """Log-spaced counts from 1 to `length` (about 1.4 apart)."""
    counts, k = [], 1.0
    while round(k) <= length:
        if round(k) not in counts:
            counts.append(round(k))
        k *= 1.4
    return counts


def _chain(ctx: Context) -> tuple[list[str], list[int], list[int], list[int]]:
    """The bottlenecks with, for each, the bytes needed before it, its size and the fetched
    gradients after it; computed once per context."""
    if ctx._chain is None:
        chain = _find_bottlenecks(ctx)
        ctx._chain = (chain, _bytes_needed_before(ctx, chain),
                      [ctx.analysis.shapes.nbytes(TensorRef(n)) or 0 for n in chain],
                      _fetched_gradients_after(ctx, chain))
    return ctx._chain


# Two-level candidates: (split, budget) as fractions of the bytes the backward pass reads.
TWO_LEVEL_GRID = [(split, j / 48) for split in (0.25, 0.45) for j in range(7, 16)]
TWO_LEVEL_STEP = (0.05, 1 / 96)  # the finer steps around the best of the grid


def two_level(ctx: Context, split: float, budget: float) -> tuple[set[str], frozenset[str]]:
    """Checkpoints for two-level recomputation: the bottleneck chain cut where `split` of the
    bytes the backward pass reads lie below; below the cut the checkpoints are recomputed ahead
    (not held while back-propagation works through the layers above), above it they are held;
    each part spread by `budgeted` under one `budget`, counting from the cut, which is held.
    Returns (checkpoints, those recomputed ahead)."""
    chain, needed, sizes, fetched = _chain(ctx)
    if not chain:
        return set(), frozenset()
    total = needed[-1]
    cut = min(range(len(chain)), key=lambda i: (abs(needed[i] - total * split), i))
    below = budgeted(chain[:cut], needed[:cut], sizes[:cut], fetched[:cut], total * budget)
    above = budgeted(chain[cut:], [n - needed[cut] for n in needed[cut:]], sizes[cut:],
                      fetched[cut:], total * budget)
    return {*below, chain[cut], *above}, frozenset(below)


# Fine-tuning tries at most this many counts between two neighbours: on long chains (a 37k-node
# residual MLP keeps about 400 checkpoints) every count between them would be 300 plans.
FINE_COUNTS = 16


def _between(low, high) -> list:
    """Parameters strictly between two neighbours: every count, or FINE_COUNTS of them spaced
    evenly where there are more; or seven budgets."""
    if isinstance(low, int):
        if high - low - 1 <= FINE_COUNTS:
            return list(range(low + 1, high))
        return sorted({round(low + (high - low) * j / (FINE_COUNTS + 1))
                       for j in range(1, FINE_COUNTS + 1)})
    return [low + (high - low) * j / 8 for j in range(1, 8)]


POLICIES = {"memory": memory_policy, "speed": speed_policy, "collection": collection_policy,
            "manual": manual_policy}


def bottlenecks(ctx: Context) -> list[str]:
    """Large forward tensors every path from the main inputs to the loss runs through, in order
    (`_find_bottlenecks`), found once per context: the policies, `search.add_free` and
    the exact planner all walk the same chain."""
    return list(_chain(ctx)[0])


def _find_bottlenecks(ctx: Context) -> list[str]:
    """Large forward tensors every path from the main inputs to the loss runs through, in order.

    The graph holds the forward nodes that are neither constant-valued nor parameters. A virtual
    source feeds the entries only: large floating-point inputs, and nodes with a large
    floating-point output computed from inputs, constants and parameters alone (an embedding
    lookup of token ids, through a `Const` or a variable); not labels or ids themselves, and not
    the loss, which reads labels and logits. A small side input (labels, token ids reused as
    targets, a mask) is therefore never reached from the source, and its shortcut to the loss
    cannot hide the bottlenecks. A virtual sink drains every node without forward consumers. The
    bottlenecks are the sink's dominators, kept when their output is large.
    """
    graph, shapes = ctx.graph, ctx.analysis.shapes
    nodes, sizes, large = _activations(ctx)
    fixed = ctx.constant | ctx.parameters
    forward = nx.DiGraph()
    forward.add_nodes_from(nodes)
    members = set(nodes)
    for name in nodes:
        forward.add_edges_from((r.node, name) for r in graph.data_inputs(name)
                               if r.node in members)
    source, sink = "graphrewrite:source", "graphrewrite:sink"
    fed = _fed_values(graph, shapes, nodes, fixed)
    entries = []
    for name in large:
        computed = [r.node for r in graph.data_inputs(name) if r.node not in fixed]
        floating = _is_floating(shapes[TensorRef(name)])
        if floating and (graph.op(name) in PLACEHOLDER_OPS or (computed and all(
                n in fed or graph.op(n) in PLACEHOLDER_OPS for n in computed))):
            entries.append(name)
    forward.add_edges_from((source, name) for name in _main_entries(forward, entries))
    if source not in forward:
        return []
    for name in reachable(forward, [source]) - {source}:
        if forward.out_degree(name) == 0:
            forward.add_edge(name, sink)
    dominators = nx.immediate_dominators(forward, source)
    chain, node = [], dominators.get(sink)
    while node is not None and node != source:
        if node in large:
            chain.append(node)
        node = dominators[node]
    position = {n: i for i, n in enumerate(nodes)}
    chain.sort(key=position.get)
    return [n for n, after in zip(chain, chain[1:] + [None]) if not _feeds_only(ctx, n, after)]


def why_no_candidates(ctx: Context) -> str:
    """Why the bottleneck chain is empty, naming what the user can give or change."""
    graph, split = ctx.graph, ctx.analysis.split
    if not split.differentiated:
        return ("no loss found (the gradient seeds differentiate no value outside the "
                "backward pass): name it with --outputs")
    fixed = ctx.constant | ctx.parameters
    computed = [n for n in split.forward if n not in fixed and graph.op(n) not in PLACEHOLDER_OPS]
    hidden = sorted(n for n in computed if n in ctx.in_loop_frame or graph.op(n) in CALL_OPS
                    or graph.op(n) in ctx.functions)
    if computed and len(hidden) == len(computed):
        return (f"the forward pass runs inside while loops or function calls ({hidden[0]}, ...), "
                "which are never copied")
    return (f"no large tensor lies on every path from the inputs to the loss "
            f"({', '.join(split.differentiated)}); choose checkpoints with --mode collection "
            "--checkpoints, or try --mode swap")


def _activations(ctx: Context) -> tuple[list[str], dict[str, int], set[str]]:
    """The forward nodes the loss is computed from that are no parameters or constants, in
    order, with their largest output's bytes, and the large ones among them; found once per
    context (the bottlenecks and the frontiers both walk them)."""
    if ctx._activations is None:
        ctx._activations = _find_activations(ctx)
    return ctx._activations


def _find_activations(ctx: Context) -> tuple[list[str], dict[str, int], set[str]]:
    graph, shapes, split = ctx.graph, ctx.analysis.shapes, ctx.analysis.split
    # Only what the loss depends on: side branches (batch-norm moving-average updates,
    # metrics) end elsewhere and must not count as ways around a bottleneck. The loss is what
    # the seeds differentiate, needed or not: a train op alone never reads a scalar loss's
    # value (its gradient seed takes only its static shape).
    needed = needed_nodes(graph, ctx.analysis.fetches)
    losses = list(split.differentiated) + [
        n for n in split.losses if n in needed and n not in split.differentiated] + [
        n for n in ctx.analysis.fetches if n in split.forward]
    # By data edges: an inlined forward's returned value waits on batch norm's moving-average
    # writes by control edges; those writes are side branches all the same.
    towards_loss = graph.data_ancestors(losses) if losses else None
    fixed = ctx.constant | ctx.parameters  # the same every step: never an activation
    nodes = [n for n in ctx.order() if n in split.forward and n not in fixed
             and (towards_loss is None or n in towards_loss)]
    sizes = {n: max((shapes.nbytes(r) or 0 for r in shapes.outputs(n)), default=0)
             for n in nodes}
    threshold = max(sizes.values(), default=0) * LARGE_FRACTION
    return nodes, sizes, {n for n in nodes if sizes[n] > 0 and sizes[n] >= threshold}


# The bottleneck chain leaves a gap when one segment between bottlenecks produces more than this
# share of what the backward pass reads (a U-Net's skips: almost nothing lies on every path;
# 0.56 on the recipe matrix's 3-level U-Nets, 0.14-0.52 on the fixtures and a ResNet-50 step).
# Below it the chain's spreads serve: offered at 0.25, frontiers won on two small fixtures
# with plans the estimate planner priced 15% off their simulation.
CHAIN_GAP = 0.55


def _frontiers(ctx: Context, chain: list[str], needed: list[int]) -> tuple | None:
    """Where the bottleneck chain leaves a gap: every large activation in order (the line),
    the backward-read bytes produced up to each, and a function giving the frontier at one
    of them: the large activations produced by then that a later forward node still reads.
    Any frontier cuts every path from the inputs to the loss, as a bottleneck does alone
    (Checkmate's and PyTorch's min-cut partitioner's general cuts, found along the forward
    order instead of by a solver). None when the chain has no gap."""
    nodes, _, large = _activations(ctx)
    line = [n for n in nodes if n in large]
    if not line:
        return None
    weights = _bytes_needed_before(ctx, line)
    total = weights[-1] or 1
    marks = [0] + list(needed) + [total]
    if chain and max(b - a for a, b in zip(marks, marks[1:])) <= total * CHAIN_GAP:
        return None
    position = {n: i for i, n in enumerate(nodes)}
    readers = ctx.readers()
    last_read = {n: max((position[r] for r in readers.get(n, ()) if r in position),
                        default=position[n]) for n in line}

    def frontier(at: str) -> set[str]:
        here = position[at]
        return {at} | {n for n in line if position[n] <= here < last_read[n]}

    return line, weights, frontier


def _even_frontiers(line: list[str], weights: list[int], frontier, count: int,
                    tapered: bool = False) -> list[str]:
    """The frontiers at `count` positions of the line splitting its weights evenly (or
    tapered), as one checkpoint set."""
    chosen: dict[str, None] = {}
    for at in _even(line, weights, count, tapered):
        chosen.update(dict.fromkeys(sorted(frontier(at))))
    return list(chosen)


def _main_entries(forward: nx.DiGraph, entries: list[str]) -> list[str]:
    """The entries whose forward reach no other entry's strictly contains, in their order. A
    regression target as large as the activations, read only by the loss, reaches a part of
    what the input reaches: as a source it would make the loss its own bottleneck and hide the
    model's. Inputs that meet (token and segment embeddings summed) reach the same nodes and
    both stay."""
    reach = {name: frozenset(nx.descendants(forward, name)) for name in entries}
    return [name for name in entries
            if not any(reach[other] > reach[name] for other in entries if other != name)]


def _fed_values(graph, shapes, nodes: list[str], fixed) -> set[str]:
    """Inputs, and values that are not floating point computed from them and the parameters
    alone (a 16-bit embedding row gathered by token ids, before the diet pass's dequantizing
    Cast): what an entry of the forward pass may be computed from."""
    fed: set[str] = set()
    for name in nodes:
        computed = [r.node for r in graph.data_inputs(name) if r.node not in fixed]
        if computed and all(n in fed or graph.op(n) in PLACEHOLDER_OPS for n in computed) \
                and not _is_floating(shapes[TensorRef(name)]):
            fed.add(name)
    return fed


def _feeds_only(ctx: Context, name: str, after: str | None) -> bool:
    """Whether `name` is read by nothing but the next bottleneck `after`, which is no larger
    (a residual sum read only by its ReLU): keeping `after` instead costs no more memory and
    saves recomputing it, and keeping both wastes a buffer."""
    if after is None:
        return False
    readers = {v for v, slot in ctx.graph.consumers(name) if slot >= 0}
    size = ctx.analysis.shapes.nbytes
    return readers == {after} and (size(TensorRef(after)) or 0) <= (size(TensorRef(name)) or 0)


def _is_floating(info) -> bool:
    return info is not None and dtypes.is_floating(info.dtype)


def _bytes_needed_before(ctx: Context, chain: list[str]) -> list[int]:
    """For each bottleneck: bytes of forward tensors the backward reads, produced up to it."""
    graph, shapes, flow = ctx.graph, ctx.analysis.shapes, ctx.analysis.split.gradient_flow
    position = {n: i for i, n in enumerate(ctx.order())}
    needed = []
    for name in ctx.analysis.split.forward:
        for ref in shapes.outputs(name):
            if any(v in flow for v, _ in graph.consumers(ref)):
                needed.append((position[name], shapes.nbytes(ref) or 0))
    needed.sort()
    weights, total, index = [], 0, 0
    for name in chain:
        while index < len(needed) and needed[index][0] <= position[name]:
            total += needed[index][1]
            index += 1
        weights.append(total)
    return weights


def _fetched_gradients_after(ctx: Context, chain: list[str]) -> list[int]:
    """For each bottleneck: bytes of fetched outputs of the backward pass (weight gradients of
    a frozen graph) computed from forward values after it, so still held when back-propagation
    is below it. A fetch counts at the last forward value its producer reads (through
    aliases: `outputs/grad_0` is an Identity of a MatMul reading an activation)."""
    graph, split, shapes = ctx.graph, ctx.analysis.split, ctx.analysis.shapes
    position = {n: i for i, n in enumerate(ctx.order())}
    held = []
    for fetch in ctx.analysis.fetches:
        name = fetch.split(":")[0]
        if name not in split.backward or name not in graph:
            continue
        producer = name
        while graph.op(producer) in ALIAS_OPS and len(graph.data_inputs(producer)) == 1:
            producer = graph.data_inputs(producer)[0].node
        read = [position[r.node] for r in graph.data_inputs(producer) if r.node in split.forward]
        if read:
            held.append((max(read), sum(shapes.nbytes(r) or 0 for r in shapes.outputs(name))))
    held.sort()
    ats, after = [at for at, _ in held], list(itertools.accumulate(
        (size for _, size in reversed(held)), initial=0))[::-1]  # after[i]: held[i:]'s bytes
    return [after[bisect.bisect_right(ats, position[name])] for name in chain]


def _even(chain: list[str], weights: list[int], count: int, tapered: bool = False) -> list[str]:
    """`count` bottlenecks splitting the cumulative weights into equal parts, or, `tapered`,
    into parts shrinking by one share each towards the loss (the triangle of sqrt(2N) segments
    that `budgeted` approximates when checkpoints are alike)."""
    total = weights[-1] or 1
    shares = [count + 1 - i if tapered else 1 for i in range(count + 1)]
    chosen, below, whole = {}, 0, sum(shares)
    for part in range(1, count + 1):
        below += shares[part - 1]
        chosen[chain[_nearest(weights, total * below / whole)]] = None
    return list(chosen)


def _nearest(weights: list[int], target: float) -> int:
    """The first index of the (non-decreasing) weights nearest to `target`, by bisection."""
    above = bisect.bisect_left(weights, target)
    near = [above] if above < len(weights) else []
    if above > 0:
        near.append(bisect.bisect_left(weights, weights[above - 1]))
    return min(near, key=lambda i: (abs(weights[i] - target), i))


def budgeted(chain: list[str], needed: list[int], sizes: list[int], fetched: list[int],
              budget: float) -> list[str]:
    """Walk from the input; keep a bottleneck when what the segment since the last one holds
    during its backward pass would exceed `budget`: the bytes it recomputes, the checkpoints
    below it and the fetched gradients computed above it (Chen et al.'s greedy, with what is
    held counted: segments shrink towards the loss, and towards the input when gradients of
    the weights above pile up)."""
    chosen, held, start, grads = [], 0, 0, (fetched or [0])[0]
    for name, reads, size, above in zip(chain, needed, sizes, fetched):
        if held + reads - start + grads > budget:
            chosen.append(name)
            held, start, grads = held + size, reads, above
    return chosen
