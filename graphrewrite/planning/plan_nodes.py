"""What a recompute plan means: which forward nodes keeping a set of checkpoints recomputes, and
the connected segments they form (one trigger each). The planners price plans by these sets
(`search.estimate`, `exact`); the recompute pass copies them (`passes.recompute.rewrite`).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from ..core.tensor_ref import TensorRef
from .context import Context

__all__ = ["recomputed_nodes", "flow_starts", "recomputable_test", "removed", "Unchecked",
           "unchecked", "ahead_members", "segments", "worth_nodes", "worth_recomputing",
           "with_ancestors", "SIDE_OUTPUT_RATIO", "TINY_BYTES"]


def recomputed_nodes(ctx: Context, checkpoints: set[str], blocked: dict[str, set[str]]):
    """What keeping `checkpoints` recomputes: the outputs the gradient flow reads that are worth
    it and may be copied, with their ancestors up to the checkpoints and what may not be copied
    (recorded in `blocked` by reason), and the parameters the copies read that may be copied
    with them (`Context.copyable_parameters`; never a boundary: the flow reads a parameter
    where it is). Returns those nodes and the test `recomputable`."""
    recomputable = recomputable_test(ctx, checkpoints, blocked)
    return with_ancestors(ctx, flow_starts(ctx, recomputable), recomputable), recomputable


def flow_starts(ctx: Context, recomputable) -> list[str]:
    """The nodes whose outputs the gradient flow reads, worth recomputing and recomputable:
    where `recomputed_nodes` starts its walk."""
    copyable = ctx.copyable_parameters()
    reads = ctx.flow_reads()
    worth = worth_nodes(ctx, reads)
    return [n for n in reads if n in worth and n not in copyable and recomputable(n)]


def recomputable_test(ctx: Context, checkpoints: set[str], blocked: dict[str, set[str]]):
    """The test whether a node may be recomputed with `checkpoints` kept; it records the
    reason of each node that may not in `blocked`."""
    reasons = ctx.forward_blockers()
    copyable = ctx.copyable_parameters()

    def recomputable(name: str) -> bool:
        if name in checkpoints or name not in reasons:
            return False
        if name in copyable:
            return True
        reason = reasons[name]
        if reason:
            blocked.setdefault(reason, set()).add(name)
        return reason is None

    return recomputable


def removed(ctx: Context, checkpoints: set[str]) -> set[str]:
    """The nodes of `unchecked`'s set that keeping `checkpoints` does not recompute: the
    checkpoints themselves and the nodes they cut off (not read by the gradient flow
    themselves, and read only by checkpoints and other such nodes), found by walking up from
    the checkpoints. `unchecked(ctx).everything` less these is `recomputed_nodes`'s set
    without walking the graph for every plan (a node is recomputed when the flow reads it or a
    recomputed node reads it): the planners price hundreds of plans."""
    everything, boundary, readers, _ = unchecked(ctx)
    sources = ctx.sources()
    cut: set[str] = set()
    stack = [s for c in checkpoints if c in everything for s in sources[c]]
    while stack:
        name = stack.pop()
        if (name in cut or name not in everything or name in boundary
                or name in checkpoints):
            continue
        if all(r in checkpoints or r in cut for r in readers[name]):
            cut.add(name)
            stack.extend(sources[name])
    return (everything & checkpoints) | cut


# The last Context `unchecked` answered for (weakly held) and its answer.
_unchecked_memo: list = [None, None]


class Unchecked(NamedTuple):
    everything: frozenset  # what `recomputed_nodes` recomputes without checkpoints
    boundary: frozenset    # the nodes of it the gradient flow reads (its starts)
    readers: dict          # each node's readers within it
    flops: int             # its FLOPs, summed once


def unchecked(ctx: Context) -> Unchecked:
    """What `recomputed_nodes` recomputes without checkpoints, and what the planners ask of
    it for every plan, found once per context."""
    held, found = _unchecked_memo
    if held is None or held() is not ctx:
        recomputable = recomputable_test(ctx, set(), {})
        boundary = frozenset(flow_starts(ctx, recomputable))
        everything = with_ancestors(ctx, boundary, recomputable)
        readers = {n: tuple(r for r in ctx.readers().get(n, ()) if r in everything)
                   for n in everything}
        found = Unchecked(frozenset(everything), boundary, readers, ctx.flops(everything))
        _unchecked_memo[:] = [weakref.ref(ctx), found]
    return found


def ahead_members(ctx: Context, ahead, recomputable) -> set[str]:
    """The checkpoints recomputed ahead with what lies between them and the kept ones below."""
    return with_ancestors(ctx, ahead, lambda n: n in ahead or recomputable(n))


def segments(ctx: Context, recomputed: set[str]) -> list[set[str]]:
    """The connected groups of recomputed nodes (one trigger each), by their data edges."""
    sources, readers = ctx.sources(), ctx.readers()
    segments, seen = [], set()
    for start in recomputed:
        if start not in seen:
            segment, stack = {start}, [start]
            while stack:
                name = stack.pop()
                for other in (*sources[name], *readers[name]):
                    if other in recomputed and other not in segment:
                        segment.add(other)
                        stack.append(other)
            seen |= segment
            segments.append(segment)
    return segments


# The last Context `worth_nodes` answered for (weakly held) and its answer.
_worth_memo: list = [None, frozenset()]


def worth_nodes(ctx: Context, reads: dict[str, list[TensorRef]]) -> frozenset:
    """The nodes of `reads` `worth_recomputing` holds for; it depends on the context alone,
    so it is found once, not for every candidate the recompute pass's `apply` tries."""
    held, nodes = _worth_memo
    if held is None or held() is not ctx:
        nodes = frozenset(n for n, refs in reads.items() if worth_recomputing(ctx, n, refs))
        _worth_memo[:] = [weakref.ref(ctx), nodes]
    return nodes


def worth_recomputing(ctx: Context, name: str, reads: list[TensorRef]) -> bool:
    """Whether the gradient flow reads an output of `name` that is worth recomputing. Outputs
    under 1/SIDE_OUTPUT_RATIO of the node's largest (a batch norm's batch statistics beside its
    normalized output) are not: holding them costs next to nothing, while recomputing them
    costs the large output too, if only for a moment. Nor are outputs of at most TINY_BYTES
    (a TF2 step's scalar loss, which the returned value reads after every update: copying it
    ran the whole loss again, a chunked loss's sixteen projections with it). A node copied
    anyway (its large output feeds other copies) gives the flow all its outputs from the
    copy."""
    shapes = ctx.analysis.shapes
    largest = max((shapes.nbytes(r) or 0 for r in shapes.outputs(name)), default=0)

    def worth(size: int | None) -> bool:
        if size is None:  # unknown: worth it unless a known output is larger
            return largest == 0
        return size > TINY_BYTES and size * SIDE_OUTPUT_RATIO >= largest

    return any(worth(shapes.nbytes(r)) for r in reads)


def with_ancestors(ctx: Context, starts, include) -> set[str]:
    """`starts` and their data ancestors for which `include` holds, through those only."""
    sources = ctx.sources()
    found, stack = set(), list(starts)
    while stack:
        name = stack.pop()
        if name not in found:
            found.add(name)
            stack.extend(s for s in sources[name] if s not in found and include(s))
    return found


SIDE_OUTPUT_RATIO = 16  # outputs this many times smaller than their node's largest are held
TINY_BYTES = 64  # outputs of at most this many bytes (a scalar, a few numbers) are held
