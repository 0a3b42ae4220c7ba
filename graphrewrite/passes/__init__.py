"""Rewrite passes, one per module (or package). Each is `run(graph, analysis, options, model) ->
its PassResult`, and registered here by name with the frozen dataclass of its options and the
type of its result (see `base`); the report shows every registered pass's result section."""

from __future__ import annotations

from typing import NamedTuple

from . import (accumulate, apply_early, chunk_loss, defer, diet, inline, loop_recompute,
               micro_batches, reads_first, recompute, relax_assign, rerun, serialize, swap,
               tails_first, ungate)

__all__ = ["Pass", "PASSES"]


class Pass(NamedTuple):
    options: type   # a PassOptions dataclass
    run: object     # run(graph, analysis, options, model) -> result
    result: type    # the PassResult subclass run returns


PASSES = {
    "recompute": Pass(recompute.RecomputeOptions, recompute.run, recompute.RecomputeResult),
    "swap": Pass(swap.SwapOptions, swap.run, swap.SwapResult),
    "accumulate": Pass(accumulate.AccumulateOptions, accumulate.run,
                       accumulate.AccumulateResult),
    "relax_assign": Pass(relax_assign.RelaxAssignOptions, relax_assign.run,
                         relax_assign.RelaxAssignResult),
    "defer": Pass(defer.DeferOptions, defer.run, defer.DeferResult),
    "inline": Pass(inline.InlineOptions, inline.run, inline.InlineResult),
    "loop_recompute": Pass(loop_recompute.LoopRecomputeOptions, loop_recompute.run,
                           loop_recompute.LoopRecomputeResult),
    "rerun": Pass(rerun.RerunOptions, rerun.run, rerun.RerunResult),
    "diet": Pass(diet.DietOptions, diet.run, diet.DietResult),
    "chunk_loss": Pass(chunk_loss.ChunkLossOptions, chunk_loss.run, chunk_loss.ChunkLossResult),
    "micro_batches": Pass(micro_batches.MicroBatchesOptions, micro_batches.run,
                          micro_batches.MicroBatchesResult),
    "serialize": Pass(serialize.SerializeOptions, serialize.run, serialize.SerializeResult),
    "tails_first": Pass(tails_first.TailsFirstOptions, tails_first.run,
                        tails_first.TailsFirstResult),
    "apply_early": Pass(apply_early.ApplyEarlyOptions, apply_early.run,
                        apply_early.ApplyEarlyResult),
    "reads_first": Pass(reads_first.ReadsFirstOptions, reads_first.run,
                        reads_first.ReadsFirstResult),
    "ungate": Pass(ungate.UngateOptions, ungate.run, ungate.UngateResult),
}
