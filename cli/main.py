"""`graphrewrite`: rewrite TensorFlow training graphs offline so they need less accelerator memory.

Exit codes: 0 success, 1 a check failed (e.g. outputs differ), 2 bad input or usage, 3 a bug in
graphrewrite (a pass failed or left a broken graph, or any other internal error), 130
interrupted (Ctrl-C).

Only click and the standard library load at start: TensorFlow (and numpy) are imported inside the
commands that need them, so `--help` and `--version` are quick.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow is imported: quiet C++ logs

import click  # noqa: E402

from graphrewrite.core import lifetime  # noqa: E402
from graphrewrite.planning.devices import PROFILES  # noqa: E402  (no TensorFlow import)

from graphrewrite.cli.options import (FLAGS, analysis_options, device_option,  # noqa: E402
                                      memory_option, mode_option, parse_feeds, parse_pins,
                                      plot_option, setup_logging, tag_option)
from graphrewrite.cli.tables import (Progress, Stages, format_optimize,  # noqa: E402
                                     format_summary, format_verify)

__all__ = ["EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_BAD_INPUT", "EXIT_PASS_FAILED", "EXIT_INTERRUPTED",
           "main", "optimize", "verify", "batch", "diff_command", "dump", "inspect", "entry",
           "to_json"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_PASS_FAILED = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report a SIGINT


class _Group(click.Group):
    """Turns library errors into one line on stderr and exit code 2, or 3 for a pass that failed
    (a traceback with --debug)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as err:  # one line, as every refusal; --help shows the usage
            click.echo(f"graphrewrite: error: {err.format_message()}", err=True)
            ctx.exit(EXIT_BAD_INPUT)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:  # outputs are written atomically: nothing partial is left
            click.echo("graphrewrite: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except Exception as err:  # noqa: BLE001  (every failure becomes one line)
            from graphrewrite.core.errors import GraphRewriteError, PassError

            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            text = err.render(FLAGS) if isinstance(err, GraphRewriteError) else str(err)
            first_line = (text.strip().splitlines() or [""])[0]
            bug = isinstance(err, PassError) or not isinstance(err, GraphRewriteError)
            if not isinstance(err, GraphRewriteError):  # not an input it refused: its own bug
                first_line = (f"internal error (a bug in graphrewrite): {type(err).__name__}: "
                              f"{first_line}")
            message = first_line + (" (--debug shows where)" if bug else "")
            click.echo(f"graphrewrite: error: {message}", err=True)
            ctx.exit(EXIT_PASS_FAILED if bug else EXIT_BAD_INPUT)


def to_json(data, **options) -> str:
    """`data` as strict JSON: a number that is not finite (a loss that went NaN) is null, as
    JSON has no NaN (Python's own `NaN` token breaks other readers)."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: finite(v) for key, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v) for v in value]
        return value
    return json.dumps(finite(data), allow_nan=False, **options)


def _stages(ctx) -> Stages:
    """The stage lines `-q` silences and `-v` writes into logs too."""
    root = ctx.find_root().params
    return Stages(not root.get("quiet"), logged=root.get("verbose"))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show a traceback when something fails.")
@click.option("-v", "--verbose", is_flag=True, help="Log what the library does.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr, no warnings.")
@click.version_option(package_name="graphrewrite")
@click.pass_context
def main(ctx, debug, verbose, quiet):
    """Rewrite TensorFlow training graphs offline so a training step needs less memory.

    \b
    Typical use:
      graphrewrite inspect model.pb            what is in the graph
      graphrewrite optimize model.pb -o model_opt.pb --mode none
      graphrewrite dump model.pb > model.txt   canonical text, for diffs and golden files

    Exit codes: 0 ok, 1 a check failed, 2 bad input or usage, 3 a bug in graphrewrite (a pass
    failed or left a broken graph, or an internal error: please report it with the --debug
    traceback), 130 interrupted.
    """
    from graphrewrite.execution.measure import measurement_environment

    measurement_environment()  # `verify` measures memory; TensorFlow reads these flags at import
    ctx.ensure_object(dict)["debug"] = debug
    setup_logging(verbose, quiet)


@main.command()
@click.argument("model_path", metavar="IN", type=click.Path())
@click.option("-o", "--output", "output", required=True, type=click.Path(),
              help="Where to write the rewritten model; its extension may pick the format "
                   "(.pb binary, .pbtxt text, .meta MetaGraphDef), else the input's is kept; "
                   "a SavedModel is written as a directory (named OUT, whatever it ends in) "
                   "unless OUT ends in .meta. "
                   "Missing directories are created; a symlink is written through (the file "
                   "it points to is replaced, the link stays); IN itself is refused without "
                   "--in-place.")
@click.option("--in-place", is_flag=True,
              help="Allow OUT to be IN (the same file, also through a link): overwrite it.")
@mode_option
@click.option("--checkpoints", metavar="SELECTORS",
              help="Tensors to keep (mode collection): names, regex:PAT, scope:PREFIX, op:TYPE, "
                   "comma-separated.")
@click.option("--swap", "swap_tensors", metavar="SELECTORS",
              help="Tensors to swap to host memory (modes swap and manual), selected like "
                   "--checkpoints; their backward readers get them back.")
@click.option("--swap-checkpoints", is_flag=True,
              help="Modes memory, speed, collection: also swap the kept checkpoints to host "
                   "memory instead of holding them on the device.")
@click.option("--swap-form", type=click.Choice(["portable", "grappler"]), default=None,
              help="Identity copies pinned to the CPU (portable, the default; runs anywhere) or "
                   "Grappler's _CopyFromGpuToHost/_CopyFromHostToGpu pair (GPU kernels only).")
@click.option("--budget", metavar="BYTES|PCT",
              help="Modes memory and swap: the device peak to reach, as the step is modelled "
                   "to run (after Grappler; as written with --no-as-run), in bytes (6GiB) or "
                   "as a share of the original's (60%). Memory: the least recomputation "
                   "within it, however slow (default: the lowest peak for at most a little "
                   "more compute). Swap: the fewest tensors moved (default: as low as it "
                   "goes). With --lossy, also the lossy levers where needed.")
@click.option("--bandwidth", type=click.FloatRange(min=0, min_open=True), metavar="BYTES_PER_S",
              help="Swapping: host transfer bandwidth for timing swap-ins [default: the device "
                   "profile's pinned host link].")
@click.option("--device-profile", "device_profile", metavar="NAME",
              type=click.Choice(list(PROFILES)),
              default=None,
              help="Swapping, and a --budget's levers: time the step and its transfers on "
                   "this device (h200 measured; h100, a100, v100 from their makers' "
                   "specifications; cpu: nothing to swap to; default: the V100-class figures "
                   "used before profiles). With --budget, a device with a host memory makes "
                   "swap one of the levers.")
@click.option("--planner", type=click.Choice(["estimate", "search", "exact"]), default=None,
              help="Mode memory: how checkpoint choices are priced. estimate (the default): "
                   "each on the original's schedule, then the best few rewritten and simulated "
                   "(seconds on 10k nodes); search: every choice rewritten and simulated "
                   "(minutes on 10k nodes; the reference the estimate is measured against); "
                   "exact: the optimal single-level choice under the estimate, by a MILP "
                   "(graphs up to 1,000 nodes; needs pip install 'graphrewrite[exact]').")
@click.option("--passes", metavar="PIPELINE",
              help="Run these passes instead of MODE's, in order, separated by spaces, with "
                   "options: e.g. 'recompute(policy=memory) accumulate relax_assign', "
                   "'recompute(policy=collection, checkpoints=\"op:Conv2D,scope:stem\")' "
                   "(quote a value holding a comma, space or parenthesis). Passes: recompute, "
                   "swap, defer, accumulate, ungate, relax_assign, diet, chunk_loss (lossy). The "
                   "report's pipeline replays a run.")
@click.option("--lossy", is_flag=True,
              help="Also use the levers that change the numbers: the loss's final projection "
                   "and softmax cross entropy computed a block of rows at a time (chunk_loss: "
                   "the logits and their gradient never exist whole; the weight's gradient is "
                   "summed in another order). With --budget, where recomputation alone cannot "
                   "reach it, also 16-bit variables (diet), the optimizer state made leaner "
                   "only as far as the budget needs: of the least lossy combinations that "
                   "reach it, the fastest on --device-profile. Check with verify --steps N "
                   "--rtol R.")
@click.option("--report", "report_path", type=click.Path(),
              help="Also write the report as JSON to this file.")
@click.option("--explain", metavar="NODE", multiple=True,
              help="Say why this node's output was kept, recomputed or swapped (repeatable).")
@plot_option("the original's and the rewritten step's modelled memory on one chart")
@click.option("--plan-out", "plan_out", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write the rewrite's plan as JSON: the pipeline and what each search "
                   "chose (checkpoints, those recomputed ahead, the recomputed nodes as a "
                   "derived list, swapped tensors), to review, edit and replay with --plan.")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Rewrite as the plan FILE says, without searching (same input, same plan: "
                   "same bytes). A plan naming unknown nodes, listing as recomputed what "
                   "cannot be (a stateful or random op), or made for another graph is refused. "
                   "Not with --mode, --passes, --checkpoints, --swap, --swap-checkpoints, "
                   "--budget or --lossy.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@memory_option
@click.option("--pin", "pins", multiple=True, metavar="KIND=SELECTORS", callback=parse_pins,
              help="Mode memory: keep=SEL holds those nodes as checkpoints in every plan, "
                   "recompute=SEL never holds them (the report says what they cost); any "
                   "recompute mode: never=SEL never copies them (selectors as --checkpoints). "
                   "Repeatable.")
@click.option("--tradeoff", "tradeoff_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Also write the trade-off curve: mode memory's modelled peak against its "
                   "extra step time at budgets from the original's peak to the lowest found "
                   "(and the exact planner's, on small graphs), each point with its plan "
                   "(--plan replays it). With --lossy, also every lever --budget --lossy may "
                   "take, as run, down to the lowest any reaches. FILE.json, or .png/.svg (the "
                   "plot extra).")
@click.option("--no-as-run", "no_as_run", is_flag=True,
              help="Skip the report's model of both steps as TensorFlow runs them (after "
                   "Grappler's rewrites): about a third of the time on large graphs. The "
                   "rewrite is the same; the report keeps the modelled peaks of the graphs as "
                   "written. Not with --plot.")
@analysis_options
@device_option
@tag_option
@click.pass_context
def optimize(ctx, model_path, output, in_place, mode, checkpoints, swap_tensors,
             swap_checkpoints, swap_form, budget, bandwidth, device_profile, planner, passes,
             report_path, explain, plot_path, plan_out, plan_path, as_json, device_memory,
             pins, tradeoff_path, no_as_run, lossy, input_shapes, outputs, backward_scope,
             device, tag):
    """Rewrite model IN with MODE and write it to OUT in the same format.

    IN is a GraphDef (.pb, .pbtxt), a MetaGraphDef (.meta, .meta.txt) or a SavedModel directory;
    the format is read from the content. OUT is written atomically, and only after the rewritten
    graph passed its structural checks: on any failure nothing is written. Check the result
    with `graphrewrite verify IN OUT`.
    """
    from graphrewrite.analysis.step import AnalysisOptions
    from graphrewrite.core import io
    from graphrewrite.pipeline import grammar, plan
    from graphrewrite.pipeline import run as pipeline
    from graphrewrite.reporting import report

    if plan_path:
        given = [flag for flag, value in (("--passes", passes), ("--checkpoints", checkpoints),
                                          ("--swap", swap_tensors), ("--budget", budget),
                                          ("--planner", planner), ("--lossy", lossy),
                                          ("--swap-checkpoints", swap_checkpoints)) if value]
        if ctx.get_parameter_source("mode") != click.core.ParameterSource.DEFAULT:
            given.insert(0, "--mode")
        if given:
            raise click.UsageError(f"--plan decides the rewrite; {given[0]} cannot be given "
                                   "with it")
    if no_as_run and plot_path:
        raise click.UsageError("--plot draws the steps as run; it cannot be given with "
                               "--no-as-run")
    if tradeoff_path and Path(tradeoff_path).suffix.lower() != ".json":
        from graphrewrite.reporting import plot

        if Path(tradeoff_path).suffix.lower() not in plot.FORMATS:
            raise click.BadParameter(f"the extension picks the format: .json or one of "
                                     f"{', '.join(plot.FORMATS)}", param_hint="--tradeoff")
        plot.check(tradeoff_path)  # matplotlib, before any work
    if not in_place:
        io.refuse_overwriting(model_path, output)
    from graphrewrite.pipeline.modes import MODES

    # The profile times swap passes, the trade-off curve's extra compute, a budget's levers.
    swaps = swap_checkpoints or "swap" in (passes if passes is not None else MODES[mode])
    levered = budget and passes is None
    composing = dict(checkpoints=checkpoints, planner=planner, swap_checkpoints=swap_checkpoints,
                     swap_options={"form": swap_form, "bandwidth": bandwidth,
                                   "profile": device_profile if swaps or not (
                                       tradeoff_path or levered) else None,
                                   "tensors": swap_tensors}, pins=pins)
    text = grammar.compose(mode, passes, budget=budget, lossy=lossy, **composing)
    stages = _stages(ctx)
    analysis = AnalysisOptions(input_shapes, outputs, backward_scope, device)
    stages("loading")
    model = io.load(model_path, tag=tag)
    # TensorFlow's objects live as long as the process; the rewrite allocates and drops many
    # small ones, and every automatic collection would walk TensorFlow's heap again.
    gc.freeze()
    chosen = plan.load(plan_path, model.graph) if plan_path else None
    # The rewrite's analyses and graphs live until it ends: automatic collections would walk
    # them over and over (a fifth of the time on a 37k-node graph). Paused for it; the planner
    # frees the graphs it drops itself (`recompute.evaluate`). Left paused if it was (`entry`).
    collecting = gc.isenabled()
    gc.disable()
    try:
        if levered:  # the budget of the step as run, every lever allowed
            from graphrewrite.pipeline import levers

            result = levers.fit(model, mode, analysis, budget, device_profile,
                                as_run=not no_as_run, progress=stages, lossy=lossy,
                                **composing)
        else:
            result = pipeline.optimize(model, mode, analysis, composed=text, plan=chosen,
                                       as_run=not no_as_run, progress=stages,
                                       automatic=passes is None)
    finally:
        if collecting:
            gc.enable()
    for name in explain:
        if name.split(":")[0] not in model.graph:
            raise click.BadParameter(f"'{name}' is not a node of {model_path}",
                                     param_hint="--explain")
    made = plan.dumps(plan.plan_of(result, model.graph)) if plan_out else None
    # the report is made and formatted before anything is written: a failure in it leaves no
    # output behind (exit 3 with a file written would read as half a success)
    fmt = io.output_format(model, output)
    facts = report.optimize_report(model_path, output, fmt, result)
    if device_memory:
        from graphrewrite.planning import fit

        stages("finding the largest batch that fits, before and after")
        facts["largest_batch"] = {
            when: fit.largest_batch(model, device_memory, graph, analysis,
                                    as_run=not no_as_run).to_json()
            for when, graph in (("before", model.graph), ("after", result.graph))}
    printed = [to_json(facts, indent=2) if as_json else format_optimize(facts)]
    printed += [report.explain(result, model.graph, name.split(":")[0]) for name in explain]
    stages("saving")
    io.save(model, result.graph, output, fmt, in_place=in_place, serialized=result.serialized)
    if made:
        io.write_atomic(Path(plan_out), made)
    if tradeoff_path:
        _write_tradeoff(Path(tradeoff_path), model, model_path, stages, device_profile,
                        analysis, lossy, as_run=not no_as_run)
    if report_path:
        io.write_atomic(Path(report_path), (to_json(facts, indent=2) + "\n").encode())
    for text in printed:
        click.echo(text)
    if plot_path:
        from graphrewrite.analysis import split
        from graphrewrite.reporting import plot

        flow = plot.gradient_flow(model.graph, split.split(model.graph, backward_scope))
        curves = [curve for label, found in zip(("original", "rewritten"), result.run_reports)
                  if found is not None for curve in plot.modelled(found, label, flow)]
        plot.draw(plot_path, curves, f"{model_path}: one step, modelled ({mode})")
    lifetime.hold((model, result))  # freed by the exit, not one object at a time here


def _write_tradeoff(path: Path, model, model_path, stages, profile, analysis, lossy,
                    as_run) -> None:
    from graphrewrite.core import io
    from graphrewrite.pipeline import tradeoff

    stages("the trade-off curve (mode memory at several budgets)")
    found = tradeoff.curve(model, profile=profile or "default", progress=stages,
                           analysis=analysis, lossy=lossy, device_profile=profile,
                           as_run=as_run)
    if path.suffix.lower() == ".json":
        io.write_atomic(path, (to_json(found, indent=1) + "\n").encode())
    else:
        from graphrewrite.reporting import plot

        plot.tradeoff(path, found, f"{model_path}: modelled peak against extra step time")


@main.command()
@click.argument("original_path", metavar="ORIGINAL", type=click.Path())
@click.argument("rewritten_path", metavar="REWRITTEN", type=click.Path())
@click.option("--rtol", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Relative tolerance (0: bitwise).")
@click.option("--atol", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Absolute tolerance (0: bitwise).")
@click.option("--feed", "feeds", multiple=True, metavar="NAME=FILE.npy", callback=parse_feeds,
              help="Feed this array instead of a random one (repeatable).")
@click.option("--runs", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed steps per model.")
@click.option("--steps", default=0, show_default=True, metavar="N", type=click.IntRange(min=0),
              help="For lossy rewrites (mode diet, --lossy): run N training steps of both, step "
                   "k on the same seeded batch, and compare the final losses within --rtol; the "
                   "report shows both loss curves. 0: the bitwise two-step check.")
@click.option("--batches", default=0, show_default=True, metavar="K",
              type=click.IntRange(min=0),
              help="With --steps: a fixed data set of K seeded batches, cycled over the N "
                   "steps (the same for both graphs), so the loss can fall (a model memorises "
                   "it); the mean losses of the last pass over the set are compared, and the "
                   "rewritten graph's loss must fall where the original's does. "
                   "0: a fresh random batch each step (random labels: a sanity check, not a "
                   "learning curve).")
@click.option("--data", "data_path", type=click.Path(dir_okay=False), metavar="FILE.npz",
              help="With --steps: train both on this data set instead of seeded batches: one "
                   "array per input placeholder (np.savez(FILE, x=images, y=labels)), examples "
                   "along the first axis, cut into the graph's batches and cycled (as "
                   "--batches, which then takes the first K). Inputs it does not name are "
                   "seeded.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--int-high", default=10, show_default=True, type=click.IntRange(min=1),
              help="Integer inputs are drawn from [0, INT_HIGH) (class ids, token ids).")
@click.option("--repeat", default=1, show_default=True, metavar="N", type=click.IntRange(min=1),
              help="Measure each graph's peak in N fresh processes, in turns, and report their "
                   "median and range: where the allocator's regions fall depends on the "
                   "executor's threads, so one graph's peak can move by a third from process "
                   "to process.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (keys in the README).")
@plot_option("both graphs' measured allocator bytes in use over a traced step")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Write each graph's traced step to DIR: original.trace.json and "
                   "rewritten.trace.json (Chrome trace with memory counters: Perfetto, "
                   "chrome://tracing) and the TensorBoard runs original/ and rewritten/ "
                   "(tensorboard --logdir DIR: the graphs with per-node memory and time).")
@analysis_options
@tag_option
@click.pass_context
def verify(ctx, original_path, rewritten_path, rtol, atol, feeds, runs, steps, batches, data_path,
           seed, int_high, repeat, as_json, plot_path, trace_dir, input_shapes, outputs,
           backward_scope, tag):
    """Run ORIGINAL and REWRITTEN on the same seeded inputs and compare every output.

    Each runs two steps: the outputs of both steps and every variable after them (weights,
    optimizer slots, batch-norm statistics, step counters) are compared, bitwise unless
    --rtol/--atol relax it. A MetaGraphDef's variables start from its initialisers, a
    SavedModel's from its own variables/; a TF2 step's resource placeholders are bound to fresh
    variables holding the same seeded values for both (export it with add_shapes=True). Only
    the placeholders the fetched outputs need are fed. Both are also measured: peak memory of
    one step (TensorFlow's allocator; variables included) and the median step time, side by
    side. A GPU is used when TensorFlow sees one. On a CPU the steps run with oneDNN off
    (the step the memory model models); TensorFlow's own default on x86 is on, and
    TF_ENABLE_ONEDNN_OPTS=1 graphrewrite verify ... checks the rewrite as that runs. Exit 0
    when everything matches, 1 when anything differs. An original that differs from itself run
    to run cannot be matched bitwise: it is run again, and a rewrite whose every difference is
    within twice the original's own is WITHIN SPREAD (exit 0).
    """
    from graphrewrite.core import io
    from graphrewrite.execution import verify as verify_mod

    stages = _stages(ctx)
    stages("loading")
    original = io.load(original_path, tag=tag)
    rewritten = io.load(rewritten_path, tag=tag)
    options = verify_mod.VerifyOptions(
        fetches=outputs, input_shapes=input_shapes, feeds=verify_mod.load_feeds(feeds),
        rtol=rtol, atol=atol, runs=runs, seed=seed, int_high=int_high, steps=steps,
        batches=batches, data=verify_mod.load_data(data_path) if data_path else None,
        repeat=repeat)
    result = verify_mod.verify(original, rewritten, options, progress=stages)
    facts = result.to_json()
    if as_json:
        click.echo(to_json(facts, indent=2))
    else:
        click.echo(format_verify(facts))
    if plot_path:
        from graphrewrite.reporting import plot

        plot.draw(plot_path, [plot.measured(result.original.timeline, "original (measured)"),
                              plot.measured(result.rewritten.timeline, "rewritten (measured)")],
                  f"{original_path} vs {rewritten_path}: one traced step on "
                  f"{result.original.device}")
    if trace_dir:
        from graphrewrite.execution import trace

        for label, model, measured in (("original", original, result.original),
                                       ("rewritten", rewritten, result.rewritten)):
            trace.write(trace_dir, label, measured.run_metadata, model.graph.to_graph_def())
    if not (result.match or result.within_spread):
        click.get_current_context().exit(EXIT_CHECK_FAILED)


@main.command()
@click.argument("paths", metavar="PATH...", nargs=-1, required=True, type=click.Path())
@click.option("--out-dir", required=True, type=click.Path(file_okay=False),
              help="Where rewritten models go, under their path relative to the PATH given.")
@mode_option
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1),
              help="Models rewritten at once (a local process pool).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False),
              help="Write one JSON line per model here (JSON Lines).")
@click.option("--verify", "with_verify", is_flag=True,
              help="Also run each original and rewritten model and compare outputs; a model "
                   "that differs (or cannot be run) fails and its output is removed.")
@click.option("--force", is_flag=True, help="Redo models whose output is already up to date.")
@click.option("--budget", metavar="BYTES|PCT",
              help="Modes memory and swap: the modelled peak each model should reach, as in "
                   "optimize (a share like 50% is of each model's own peak).")
@click.option("--executor", type=click.Choice(["local", "dask"]), default="local",
              show_default=True, help="Run jobs in a local process pool or on a Dask cluster.")
@click.option("--scheduler", metavar="ADDRESS",
              help="Dask scheduler address (tcp://host:8786), with --executor dask.")
def batch(paths, out_dir, mode, jobs, report_path, with_verify, force, budget, executor,
          scheduler):
    """Rewrite every model found under PATH... into --out-dir, one report line each.

    Models are .pb, .pbtxt, .meta files and SavedModel directories. A failing or corrupt model
    is reported and never stops the others; re-running skips models whose output is newer than
    their input (--force redoes them). Exit 0 when every model is ok or skipped, 1 when any
    failed.
    """
    from graphrewrite import batch as batch_mod

    if executor == "dask" and not scheduler:
        raise click.BadParameter("--executor dask needs --scheduler ADDRESS",
                                 param_hint="--scheduler")
    if budget is not None:  # a usage error now, not one failed line per model
        from graphrewrite.pipeline import grammar

        grammar.compose(mode, budget=budget)
    planned = batch_mod.plan(paths, out_dir, mode, with_verify, force, budget)
    if not planned:
        raise click.BadParameter("no models (.pb, .pbtxt, .meta, SavedModel) under the paths",
                                 param_hint="PATH")
    progress = Progress(len(planned))
    results = batch_mod.run(planned, jobs, scheduler if executor == "dask" else None,
                            progress.update)
    progress.close()
    lines = [to_json(line, sort_keys=True) for line in results]
    if report_path:
        from graphrewrite.core import io

        io.write_atomic(Path(report_path), ("\n".join(lines) + "\n").encode())
    counts = {s: sum(1 for r in results if r["status"] == s) for s in ("ok", "skipped", "failed")}
    for line in results:
        if line["status"] == "failed":
            click.echo(f"failed  {line['path']}: {line['error']}", err=True)
    click.echo(f"{len(results)} models: {counts['ok']} ok, {counts['skipped']} skipped, "
               f"{counts['failed']} failed")
    if counts["failed"]:
        click.get_current_context().exit(EXIT_CHECK_FAILED)


@main.command(name="diff")
@click.argument("a_path", metavar="A", type=click.Path())
@click.argument("b_path", metavar="B", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="One JSON object: identical, added, "
                                                      "removed, changed, rewired, functions.")
@tag_option
def diff_command(a_path, b_path, as_json, tag):
    """Semantic diff of graphs A and B, independent of node and attribute order.

    Lines start with + (node added), - (removed), ~ (op, device or an attribute changed) or
    > (inputs rewired); tensor payloads compare by content hash. Exit 0 when identical, 1 when
    different, 2 on bad input: usable as a CI check on rewritten fixtures.
    """
    from graphrewrite.core import io
    from graphrewrite.reporting import diff

    result = diff.diff(io.load(a_path, tag=tag).graph, io.load(b_path, tag=tag).graph)
    click.echo(to_json(result.to_json(), indent=2) if as_json else diff.format_diff(result))
    if not result.identical:
        click.get_current_context().exit(EXIT_CHECK_FAILED)


@main.command()
@click.argument("model_path", metavar="IN", type=click.Path())
@tag_option
def dump(model_path, tag):
    """Print the canonical text of model IN: one line per node, stable order.

    The same graph dumps identically whatever the order of its nodes in the file, so two dumps
    can be compared with diff. Tensor payloads print as dtype, shape and a short hash.
    """
    from graphrewrite.core import io, text

    model = io.load(model_path, tag=tag)
    click.echo(text.dump(model.graph, model.meta_graph), nl=False)


@main.command()
@click.argument("model_path", metavar="IN", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="One JSON object (keys in the README).")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=0),
              help="How many tensors live at the peak to list.")
@plot_option("the step's modelled memory over its schedule, the peak and its largest "
             "tensors labelled")
@memory_option
@analysis_options
@device_option
@tag_option
def inspect(model_path, as_json, top, plot_path, device_memory, input_shapes, outputs,
            backward_scope, device, tag):
    """Summarize model IN: nodes, ops, inputs, outputs, control flow, variables, and the modelled
    memory of one training step (peak, what is live at the peak), FLOPs, forward/backward split.
    """
    from graphrewrite.analysis import step as analysis
    from graphrewrite.core import io
    from graphrewrite.reporting import summary

    model = io.load(model_path, tag=tag)
    found, graph, inlined = analysis.analyse_inlined(model, analysis.AnalysisOptions(
        input_shapes, outputs, backward_scope, device))
    facts = summary.summarize(model, found.fetches)
    facts["inlined_calls"] = inlined
    as_run = analysis.as_run(model, graph, found)
    facts.update(summary.memory_facts(found, top, as_run))
    from graphrewrite.analysis import state

    facts.update(state.parameter_facts(graph, found.shapes, found.split))
    if device_memory:
        from graphrewrite.planning import fit

        facts["largest_batch"] = fit.largest_batch(
            model, device_memory, analysis=dataclasses.replace(found.options,
                                                               fetches=found.fetches)).to_json()
    if plot_path:
        from graphrewrite.reporting import plot

        plot.draw(plot_path, plot.modelled(as_run or found.memory, "modelled",
                                           plot.gradient_flow(graph, found.split)),
                  f"{model_path}: one step, modelled")
    if as_json:
        click.echo(to_json(facts, indent=2))
    else:
        click.echo(format_summary(facts))


def entry() -> None:
    """The `graphrewrite` command: `main`, then the process ends without freeing what the
    command built. A rewrite holds millions of small objects (two graphs of a 99k-node model and
    their analyses); freeing them one at a time at exit took seconds, after every output had
    been written (atomically) and flushed. For the same reason Python's cyclic collector never
    runs: what the command builds lives until the end, and each collection walked it again,
    above all the first one after the rewrite, which paused it (`optimize`): on a 99k-node
    model 700k objects, and a tenth of the command's time in collections all told."""
    gc.disable()
    lifetime.hold_until_exit()
    try:
        main()  # standalone: always ends in SystemExit with the command's code
        code = EXIT_OK
    except SystemExit as done:
        code = done.code
    if isinstance(code, str):  # what `sys.exit(message)` would print
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code or 0)


if __name__ == "__main__":
    entry()
