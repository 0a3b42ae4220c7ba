"""Checkpoints beyond the bottleneck chain: a U-Net's long skips leave almost no tensor on every
path from the input to the loss, so the memory policy also offers frontiers (all activations a
later forward node still reads, at a point of the forward order), each a cut of every path."""

import sys
from pathlib import Path

import networkx as nx

from graphrewrite.analysis import step as analysis
from graphrewrite.core import io
from graphrewrite.planning.checkpoints import bottlenecks, memory_policy
from graphrewrite.planning.context import Context

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fixtures"))
import recipes  # noqa: E402


def test_a_unet_gets_checkpoint_sets_off_its_chain_that_cut_every_path():
    model = io.load(recipes.ensure("kl_unet_rmsprop_bn")["path"])
    ctx = Context.build(model.graph, analysis.analyse(model))
    chain = set(bottlenecks(ctx))
    candidates = memory_policy(ctx)
    off_chain = [c for c in candidates if not c <= chain]
    assert off_chain
    graph = ctx.graph
    forward = nx.DiGraph((r.node, n) for n in ctx.analysis.split.forward
                         for r in graph.data_inputs(n) if r.node in ctx.analysis.split.forward)
    loss = ctx.analysis.split.differentiated[0]
    for chosen in off_chain:
        cut = forward.copy()
        cut.remove_nodes_from(chosen)
        assert "x" in cut and not nx.has_path(cut, "x", loss), sorted(chosen)
