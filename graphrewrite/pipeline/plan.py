"""Plans: the decisions a rewrite's searches took, as plain data a user can review and edit.

`optimize --plan-out FILE` writes the plan of the rewrite it made: the pipeline that ran, and for
each searching pass what it chose (recompute: the checkpoints kept, those recomputed ahead, and,
as a derived list to review, the nodes recomputed; swap: the tensors moved to the host).
`optimize --plan FILE` runs that pipeline with each search replaced by its decision (recompute
with policy collection, swap with policy manual), so the same input gives the same bytes without
searching. An edited plan is refused with one line, nothing written: before anything runs, a plan
made for another graph or naming unknown nodes (a name an earlier pass of its pipeline may
make, a node of an inlined call or diet's dequantized read, is checked when the plan runs);
after the passes ran, a node that cannot be recomputed (a stateful or random op, a variable
read, ...) listed as recomputed, or a recomputed list that does not follow from the checkpoints
(edit the checkpoints; the list is derived).
"""

from __future__ import annotations

import json

from ..analysis.inline import CALL_OPS
from ..core.errors import GraphRewriteError
from ..core.graph import Graph
from ..core.names import made_here
from ..core.tensor_ref import TensorRef
from ..planning.context import Context
from . import grammar

__all__ = ["FORMAT", "LISTS", "plan_of", "dumps", "load", "pipeline_of", "check_followed"]

FORMAT = 1
LISTS = {"recompute": ("checkpoints", "recomputed_ahead", "recomputed"), "swap": ("tensors",)}


def plan_of(result, graph: Graph) -> dict:
    """The plan of `result` (an OptimizeResult) rewriting `graph`."""
    from ..passes.recompute import RecomputeResult
    from ..passes.swap import SwapResult

    names = [name for name, _ in grammar.parse_pipeline(result.pipeline)]
    repeated = sorted({n for n in names if n in LISTS and names.count(n) > 1})
    if repeated:
        raise GraphRewriteError(f"${{plan_out}}: the pipeline runs {repeated[0]} twice; a plan "
                                "holds one decision per pass")
    plan: dict = {"graphrewrite_plan": FORMAT, "nodes": len(graph), "pipeline": result.pipeline}
    if "recompute" in names:
        chosen = result.of(RecomputeResult)
        plan["recompute"] = {"checkpoints": sorted(chosen.checkpoints),
                             "recomputed_ahead": sorted(chosen.recomputed_ahead),
                             "recomputed": sorted(chosen.recomputed)}
        if chosen.reuse_ahead:
            plan["recompute"]["reuse_ahead"] = True
    if "swap" in names:
        plan["swap"] = {"tensors": sorted(result.of(SwapResult).swapped)}
    return plan


def dumps(plan: dict) -> bytes:
    return (json.dumps(plan, indent=1, sort_keys=True) + "\n").encode()


def load(path, graph: Graph) -> dict:
    """The plan in file `path`, checked for shape and for naming nodes of `graph`."""
    try:
        with open(path, encoding="utf-8") as handle:
            plan = json.load(handle)
    except OSError as err:
        raise GraphRewriteError(f"${{plan}} {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GraphRewriteError(f"${{plan}} {path}: not a JSON plan ({err})") from None
    where = f"${{plan}} {path}"
    if not isinstance(plan, dict) or plan.get("graphrewrite_plan") != FORMAT:
        raise GraphRewriteError(f"{where}: not a graphrewrite plan (format {FORMAT})")
    if not isinstance(plan.get("pipeline"), str):
        raise GraphRewriteError(f"{where}: 'pipeline' must be the pipeline text")
    if plan.get("nodes") != len(graph):
        raise GraphRewriteError(f"{where}: made for a graph of {plan.get('nodes')} nodes; this "
                                f"one has {len(graph)}")
    names = [name for name, _ in grammar.parse_pipeline(plan["pipeline"])]
    for pass_name, keys in LISTS.items():
        if pass_name not in names:
            continue
        decision = plan.get(pass_name)
        if not isinstance(decision, dict):
            raise GraphRewriteError(f"{where}: the pipeline runs {pass_name}, so the plan needs "
                                    f"its decision '{pass_name}'")
        for key in keys:
            values = decision.get(key, [])
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise GraphRewriteError(f"{where}: '{pass_name}.{key}' must be a list of names")
            for value in values:
                node = TensorRef.parse(value).node if pass_name == "swap" else value
                if node not in graph and not (names.index(pass_name) and
                                              _made_before(graph, node)):
                    raise GraphRewriteError(f"{where}: '{pass_name}.{key}' names '{value}', "
                                            "which is not in the graph")
    return plan


def _made_before(graph: Graph, node: str) -> bool:
    """Whether a pass before the decision's may make `node`: graphrewrite names what it adds
    so (diet's dequantized reads), and the inline pass names a called function's nodes after
    the call (`call/node`). Such a name is checked when the plan runs, by the selectors."""
    head = node
    while "/" in head:
        head = head.rsplit("/", 1)[0]
        if head in graph and graph.op(head) in CALL_OPS:
            return True
    return made_here(node)


def pipeline_of(plan: dict) -> str:
    """The plan's pipeline with each search replaced by its decision."""
    steps = []
    for name, raw in grammar.parse_pipeline(plan["pipeline"]):
        if name == "recompute":
            decision = plan["recompute"]
            if not decision.get("checkpoints"):
                continue  # the search found nothing worth doing
            # never-copied pins bind the replay too (the rewrite refused to copy a product
            # whose copy Grappler would fuse otherwise, and planned again without it)
            raw = {"policy": "collection", "checkpoints": ",".join(decision["checkpoints"]),
                   **{k: v for k, v in raw.items() if k == "pin_never"}}
            if decision.get("recomputed_ahead"):
                raw["ahead"] = ",".join(decision["recomputed_ahead"])
                if decision.get("reuse_ahead") is True:
                    raw["reuse"] = "true"
        elif name == "swap":
            if not plan["swap"].get("tensors"):
                continue
            raw = {**{k: v for k, v in raw.items() if k in ("form", "bandwidth")},
                   "policy": "manual", "tensors": ",".join(plan["swap"]["tensors"])}
        steps.append((name, raw))
    return grammar.format_pipeline(steps)


def check_followed(plan: dict, result, graph: Graph) -> None:
    """Refuse a plan whose recomputed list its checkpoints do not give (`result` rewrote
    `graph` as the plan says): a node listed that must never be copied (a stateful or random
    op: the pass copies none) by its reason, else the list as derived. Checked after the
    passes ran, on what the recompute pass saw: a pass before it may have replaced a node
    under the same name (diet's dequantized read for a variable read)."""
    from ..passes.recompute import RecomputeResult

    listed = plan.get("recompute", {}).get("recomputed")
    if listed is None:
        return
    done = set(result.of(RecomputeResult).recomputed)
    extra, missing = sorted(set(listed) - done), sorted(done - set(listed))
    if extra:
        context = Context.build(graph, result.analyses[0])
        for name in extra:
            reason = context.blocker(name) if name in graph else None
            if reason:
                raise GraphRewriteError(f"${{plan}}: '{name}' ({graph.op(name)}) is listed as "
                                        f"recomputed but cannot be: {reason}")
    if extra or missing:
        example = (f"'{extra[0]}' is listed but not" if extra
                   else f"'{missing[0]}' is not listed but")
        raise GraphRewriteError(f"${{plan}}: 'recompute.recomputed' does not follow from the "
                                f"checkpoints ({example} recomputed); it is derived: edit the "
                                "checkpoints and delete the list")
