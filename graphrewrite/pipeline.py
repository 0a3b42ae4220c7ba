"""Modes: named rewrite pipelines, and `optimize`, which runs one on a loaded model.

A pipeline is a string in the grammar of TensorFlow's Graph Transform Tool: passes separated by
spaces, each with optional `(key=value, ...)` options, e.g. `recompute(policy=speed)`. A mode is a
named pipeline; the report records the exact pipeline that ran. Analyses are recomputed between
passes, so each pass sees the graph as the previous one left it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass, field

from . import analysis as analysis_mod
from .budget import parse_budget
from .errors import GraphError, GraphRewriteError
from .graph import Graph
from .io import Model
from .passes import PASSES

log = logging.getLogger(__name__)

MODES: dict[str, str] = {
    "none": "",
    "memory": "recompute(policy=memory)",
    "speed": "recompute(policy=speed)",
    "collection": "recompute(policy=collection)",
    "manual": "recompute(policy=manual) swap(policy=manual)",
    "swap": "swap",
}
MODE_HELP = {
    "none": "load, check and save; nothing rewritten",
    "memory": "keep ~sqrt(N) bottleneck activations, recompute the rest (most memory saved)",
    "speed": "keep outputs of MatMul/Conv/Einsum, recompute cheap ops (least slowdown)",
    "collection": "keep what --checkpoints selects (or the 'checkpoints' collection)",
    "manual": "recompute what _recompute_hint marks, swap what _swap_to_host marks (or --swap)",
    "swap": "move long-lived activations to host memory and back (--swap-form, --budget)",
}

# (pass, policy option) of the passes that search for a rewrite and so can stop at a budget
SEARCHING_PASSES = {("recompute", None), ("recompute", "memory"), ("swap", None), ("swap", "auto")}


@dataclass
class OptimizeResult:
    graph: Graph
    mode: str
    pipeline: str
    nodes_before: int
    nodes_after: int
    peak_before: int
    peak_after: int
    seconds: float
    stats: dict = field(default_factory=dict)


def parse_pipeline(text: str) -> list[tuple[str, dict]]:
    """`'recompute(policy=speed) other'` -> [('recompute', {'policy': 'speed'}), ('other', {})]."""
    steps = []
    for match in re.finditer(r"\s*([A-Za-z_]\w*)(?:\(([^)]*)\))?", text):
        name, args = match.group(1), match.group(2) or ""
        if name not in PASSES:
            raise GraphRewriteError(f"unknown pass '{name}' (passes: {', '.join(PASSES)})")
        options = {}
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise GraphRewriteError(f"pass option '{item}' must be key=value")
            options[key.strip()] = value.strip()
        steps.append((name, options))
    return steps


def budgeted_steps(pipeline: str, budget: str | None, mode: str) -> tuple[list, list[int]]:
    """The pipeline's steps and the indices of those a budget goes to. A malformed budget, or
    one no step takes, is an error, before any work is done."""
    steps = parse_pipeline(pipeline)
    searching = [i for i, (name, raw) in enumerate(steps) if (name, raw.get("policy")) in
                 SEARCHING_PASSES]
    if budget and not searching:
        raise GraphRewriteError(f"--budget needs mode memory or swap (or --swap-checkpoints), "
                                f"not '{mode}'")
    parse_budget(budget, 0)
    return steps, searching


def optimize(model: Model, mode: str, input_shapes: dict | None = None,
             backward_scope: str | None = None, fetches: list[str] | None = None,
             checkpoints: str | None = None, swap_options: dict | None = None,
             swap_checkpoints: bool = False, passes: str | None = None,
             budget: str | None = None) -> OptimizeResult:
    """Run the pipeline of `mode` on a copy of the model's graph and check the result.

    `swap_checkpoints` adds a swap pass after recomputation, which then moves the checkpoints
    (what the recomputed copies and the gradients read) to host memory. `passes` replaces the
    mode's pipeline (`'recompute(policy=memory) accumulate'`). `budget` (bytes, or a share of
    the original's modelled peak) goes to the passes that search: recompute with policy memory
    and swap."""
    if mode not in MODES:
        raise GraphRewriteError(f"unknown mode '{mode}' (modes: {', '.join(MODES)})")
    start = time.perf_counter()
    pipeline = passes or MODES[mode]
    if swap_checkpoints:
        if not pipeline.startswith("recompute") or "swap" in pipeline:
            raise GraphRewriteError(f"--swap-checkpoints needs a recompute mode "
                                    f"(memory, speed, collection), not '{mode}'")
        pipeline += " swap"
    if (swap_options or {}).get("tensors") and "swap" not in pipeline:
        raise GraphRewriteError(f"--swap needs mode swap or manual (or --swap-checkpoints), "
                                f"not '{mode}'")
    steps, searching = budgeted_steps(pipeline, budget, mode)
    graph = model.graph.copy()
    found = analysis_mod.analyse(model, graph, input_shapes, backward_scope, fetches)
    peak_before = found.memory.peak()
    if budget:  # a share means a share of the original's peak, for every pass alike
        in_bytes = str(parse_budget(budget, peak_before))
        for i in searching:
            steps[i] = (steps[i][0], {**steps[i][1], "budget": in_bytes})
    stats: dict = {}
    ran = []
    for name, raw in steps:
        options_type, run = PASSES[name]
        if name == "recompute" and checkpoints:
            raw = {**raw, "checkpoints": checkpoints}
        if name == "swap" and swap_options:
            raw = {**raw, **{k: v for k, v in swap_options.items() if v is not None}}
        options = _options(options_type, name, raw)
        result = run(graph, found, options, model)
        ran.append(name)
        problems = result.graph.check()
        if problems:
            raise GraphError(f"pass '{name}' (after: {', '.join(ran[:-1]) or 'nothing'}) "
                             f"produced an invalid graph: {problems[0]}")
        for key, value in result.stats.items():  # counts add up over the passes
            both_counts = type(value) is int and type(stats.get(key)) is int
            stats[key] = stats[key] + value if both_counts else value
        if result.modified:
            graph = result.graph
            found = analysis_mod.analyse(model, graph, input_shapes, backward_scope,
                                         found.fetches, shapes=result.shapes)
    return OptimizeResult(graph, mode, pipeline, len(model.graph), len(graph), peak_before,
                          found.memory.peak(), time.perf_counter() - start, stats)


def _options(options_type, name: str, raw: dict):
    fields = {f.name: f for f in dataclasses.fields(options_type)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise GraphRewriteError(f"pass '{name}' has no option '{unknown[0]}' "
                                f"(options: {', '.join(fields)})")
    return options_type(**raw)
