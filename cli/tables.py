"""What the commands print for people: the optimize, verify and inspect tables, and progress on
stderr."""

from __future__ import annotations

import sys
import time

import click

__all__ = ["format_verify", "format_bytes", "EXPECTED_SKIPS", "format_optimize", "format_summary",
           "NAMED_ROWS", "Stages", "Progress"]


def format_verify(facts: dict) -> str:
    """`verify`'s side-by-side table for people."""
    if "loss_curves" in facts:
        return _format_curves(facts)
    verdict = "MATCH" if facts["match"] else "WITHIN SPREAD" if facts.get("within_spread") \
        else "MISMATCH"
    diff = facts["max_abs_diff"]
    tolerance = "bitwise" if diff == 0 and facts["match"] else f"max |diff| {diff:.3g}"
    compared = f"{facts['outputs_compared']} outputs x {facts['steps']} steps"
    if facts["variables_compared"]:
        compared += f", {facts['variables_compared']} variables"
    lines = [f"outputs       {verdict}: {compared} compared ({tolerance})"]
    if facts["mismatched"]:
        lines.append(f"mismatched    {_shorten(facts['mismatched'])}")
    if facts.get("original_spread") is not None:
        lines.append(f"note          the original differs from itself by up to "
                     f"{facts['original_spread']:.3g} from run to run, so no rewrite can match "
                     "it bitwise; "
                     + ("each difference is within twice the original's own for that output" if
                        facts["within_spread"] else "some differences are over twice the "
                        "original's own for that output: the rewrite changed them"))
    if facts.get("incomparable"):
        lines.append(f"not compared  {len(facts['incomparable'])} that one graph lacks or holds "
                     f"in another shape or type ({_shorten(facts['incomparable'], 3)})")
    lines += [f"{'':13} {'original':>12} {'rewritten':>12} {'ratio':>7}", *_measured(facts)]
    if facts.get("dieted") and not facts["match"]:
        lines.append(f"note          {facts['dieted']} variables are stored in 16 bits (diet: "
                     "lossy), so the outputs cannot match bitwise: compare training instead "
                     "(--steps 50 --batches 4 --rtol 0.02)")
    if facts.get("swapped") and "GPU" not in facts["device"]:
        lines.append(f"note          {facts['swapped']} tensors swapped to the host: on a CPU "
                     "host and device are one memory, so swapping lowers no peak measured "
                     "here (what falls comes from the mode's other passes; on a GPU the swap "
                     "lowers the device's peak)")
    return "\n".join(lines)


def _measured(facts: dict) -> list[str]:
    """Both graphs' peaks (with their range over processes), step times and device."""
    peak, step = facts["peak_bytes"], facts["step_seconds"]
    lines = [f"{'peak memory':13} {format_bytes(peak['original'] or 0):>12} "
             f"{format_bytes(peak['rewritten'] or 0):>12} "
             f"{_ratio(peak['original'], peak['rewritten']):>7}"]
    spread = facts.get("peak_bytes_runs") or {}
    if len(spread.get("original", ())) > 1:
        ranges = [_range(spread[k]) for k in ("original", "rewritten")]
        lines.append(f"{'peak range':13} {ranges[0]:>12} {ranges[1]:>12}    MiB, the median of "
                     f"{len(spread['original'])} processes each")
    if step["original"] and step["rewritten"]:
        lines.append(f"{'step time':13} {step['original'] * 1000:>10.1f}ms "
                     f"{step['rewritten'] * 1000:>10.1f}ms "
                     f"{_ratio(step['original'], step['rewritten']):>7}")
    return lines + [f"device        {_device(facts)}"]


def _ratio(a, b) -> str:
    return f"{b / a:.2f}x" if a and b else "-"


def _range(peaks: list) -> str:
    """The least and most of measured peaks, in MiB: '11.0-15.6'."""
    known = [p for p in peaks if p is not None]
    return f"{min(known) / 2**20:.1f}-{max(known) / 2**20:.1f}" if known else "-"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _format_curves(facts: dict) -> str:
    """`verify --steps`: both loss curves and the verdict on the final losses."""
    curves, compared = facts["loss_curves"], facts["compared"]
    verdict = "MATCH" if facts["match"] else "MISMATCH"
    change = (compared["rewritten"] - compared["original"]) / compared["original"] \
        if compared["original"] else float("inf")
    tolerance = f"rtol {facts['rtol']:g}" + (f", atol {compared['atol']:g}"
                                             if compared["atol"] else "")
    lines = [f"loss          {verdict}: {compared['what']} {compared['original']:.4g} -> "
             f"{compared['rewritten']:.4g} ({change:+.1%}; {tolerance}) after {facts['steps']} "
             f"steps of {facts['loss']}",
             f"{'step':>13} {'original':>12} {'rewritten':>12}"]
    shown = sorted({0, len(curves["original"]) - 1,
                    *range(0, len(curves["original"]), max(1, len(curves["original"]) // 8))})
    lines += [f"{k + 1:>13} {curves['original'][k]:>12.5g} {curves['rewritten'][k]:>12.5g}"
              for k in shown]
    trend = facts.get("trend") or {}
    if trend:
        window = trend["original"]["window"]
        data = (f"{facts['batches']} fixed batches, mean of {window} steps"
                if facts.get("batches") else "fresh batches, one step")
        for key in ("start", "end"):
            lines.append(f"{key:>13} {trend['original'][key]:>12.5g} "
                         f"{trend['rewritten'][key]:>12.5g}   ({data})")
        lines.append(f"{'fell':>13} {_yes(trend['original']['fell']):>12} "
                     f"{_yes(trend['rewritten']['fell']):>12}")
    return "\n".join(lines + _measured(facts))


def _device(facts: dict) -> str:
    """The device the steps ran on, and whether oneDNN rewrote them (TensorFlow's default on
    x86 CPUs; off unless TF_ENABLE_ONEDNN_OPTS=1, to measure the step the memory model
    models)."""
    if "CPU" not in facts["device"] or "onednn" not in facts:
        return facts["device"]
    return facts["device"] + (", oneDNN on" if facts["onednn"] else
                              ", oneDNN off (TF_ENABLE_ONEDNN_OPTS=1 runs the steps as "
                              "TensorFlow does by default on x86)")


def format_bytes(count: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


# In the JSON report; too obvious for the table.
EXPECTED_SKIPS = ("constant", "graph input", "smaller than 1 KiB")


def format_optimize(facts: dict) -> str:
    """The `optimize` report for people."""
    rows = [
        ("wrote", f"{facts['output']} ({facts['format']}) in {facts['seconds']:.1f} s"),
        ("mode", f"{facts['mode']}: {facts['pipeline'] or '(no passes)'}"),
        *_peak_rows(facts),
        ("nodes", f"{facts['nodes_before']} -> {facts['nodes_after']} "
                  f"(+{facts['nodes_added']})"),
    ]
    floor = facts["lossless_floor"]
    if floor and floor["at"]:
        rows.append(("lossless floor", _floor_text(floor)))
    if facts["budget_bytes"] is not None:
        rows.append(("budget", f"{format_bytes(facts['budget_bytes'])}: "
                               + ("met" if facts["budget_met"] else "not met (see the note)")))
    if facts["levers"]:
        from graphrewrite.pipeline import levers  # (TensorFlow is loaded by now)

        rows.append(("levers", "; ".join(
            f"{levers.label(row)}{' (chosen)' if row['chosen'] else ''}"
            f": {format_bytes(row['peak_bytes'])}, step {row['step_time']}x modelled"
            for row in facts["levers"])))
    if facts["recomputed"]:
        rows.append(("recomputed", f"{len(facts['recomputed'])} copies behind "
                                   f"{facts['triggers']} triggers"))
    if facts["fanout_pads"]:
        rows.append(("fanout pads", f"{facts['fanout_pads']} (never run: they keep Grappler's "
                                    "rewrites as on the original)"))
    if facts["recomputed"]:
        rows.append(("checkpoints", f"{len(facts['checkpoints'])} kept"
                     + (f" ({_shorten(facts['checkpoints'], 4)})" if facts["checkpoints"] else "")))
        if facts["recomputed_ahead"]:
            rows.append(("ahead", f"{len(facts['recomputed_ahead'])} of them computed again when "
                                  "back-propagation nears them, not held "
                                  f"({_shorten(facts['recomputed_ahead'], 3)})"))
        rows.append(("extra compute", f"{facts['extra_flops'] / 1e9:.3f} GFLOP per step"))
    if facts["swapped"]:
        rows.append(("swapped", f"{len(facts['swapped'])} tensors to host "
                                f"({_shorten(facts['swapped'], 3)}); "
                                f"{format_bytes(facts['bytes_moved'])} moved per step, "
                                f"{facts['transfer_seconds'] * 1000:.1f} ms of transfers on "
                                f"{facts['device_profile']}, "
                                f"{facts['exposed_seconds'] * 1000:.1f} ms of them exposed"))
    if facts.get("recomputed_loops"):
        rows.append(("in loops", f"{len(facts['recomputed_loops'])} recurrent loops push "
                                 f"{facts['loop_lists_freed']} fewer values an iteration, "
                                 "computed again in their gradient loops ("
                                 f"{facts['loop_nodes_copied']} nodes copied; "
                                 f"{_shorten(facts['recomputed_loops'], 3)})"))
    if facts.get("serial_gradient_loops"):
        rows.append(("in loops", f"{len(facts['serial_gradient_loops'])} gradient loops run one "
                                 "iteration at a time, adding the weight gradients they sum as "
                                 f"they come ({_shorten(facts['serial_gradient_loops'], 3)})"))
    for key, what in NAMED_ROWS:
        if facts[key]:
            rows.append((key, f"{len(facts[key])} {what} ({_shorten(facts[key], 3)})"))
    if facts["dieted"] or facts["constants"]:
        rows.append(("diet", _diet_row(facts)))
    rows += _by_reason("kept float32", facts["kept_float"], "variables: ")
    if facts["chunked"]:
        rows.append(("chunked loss", f"{len(facts['chunked'])} cross entropies in "
                                     f"{facts['chunks']} blocks of rows (lossy: their weight "
                                     "gradients summed in another order)"))
    rows += _by_reason("not chunked", facts["not_chunked"], "cross entropies: ")
    if facts["relaxed_assigns"]:
        rows.append(("relaxed", f"{len(facts['relaxed_assigns'])} Assigns may ignore allocator "
                                "constraints"))
    if facts["serialized"]:
        rows.append(("serialized", f"{len(facts['serialized'])} convolution gradients wait for "
                                   "the one before (one scratch at a time)"))
    if facts["ungated_segments"]:
        rows.append(("ungated", f"{facts['ungated_segments']} segments had no safe trigger "
                                f"(their copies may run early): {_shorten(facts['ungated'], 3)}"))
    rows += _by_reason("not rewritten", {reason: info for reason, info in facts["skipped"].items()
                                         if reason not in EXPECTED_SKIPS})
    if facts.get("largest_batch"):
        before, after = facts["largest_batch"]["before"], facts["largest_batch"]["after"]
        rows.append(("largest batch", f"{before['batch']} -> {after['batch']} within "
                                      f"{format_bytes(after['device_memory'])} "
                                      f"({_fit_model(after)})"))
    if facts["note"]:
        rows.append(("note", facts["note"]))
    return "\n".join(f"{key:<15} {value}" for key, value in rows)


def _by_reason(key: str, found: dict, what: str = "") -> list[tuple[str, str]]:
    """A row per reason of a report's {reason: {count, examples}}."""
    return [(key, f"{info['count']} {what}{reason} (e.g. {', '.join(info['examples'])})")
            for reason, info in found.items()]


def _fit_row(fit: dict) -> str:
    """The largest batch within a device's memory (`planning.fit`), and the next one up."""
    if not fit["batch"]:
        return (f"none: one example already needs {format_bytes(fit['peak_bytes'])} of "
                f"{format_bytes(fit['device_memory'])}")
    following = (f"; {fit['batch'] + 1} needs {format_bytes(fit['next_peak_bytes'])}"
                 if fit["next_peak_bytes"] else "; no larger batch tried")
    return (f"{fit['batch']} in {format_bytes(fit['device_memory'])} "
            f"({format_bytes(fit['peak_bytes'])} {_fit_model(fit)}{following})")


def _fit_model(fit: dict) -> str:
    """How a largest batch's steps were modelled: as run or as written, whose allocator."""
    return (f"modelled {fit['model'].replace('_', ' ')}, on a "
            f"{'GPU' if fit['device'] == 'gpu' else 'CPU'}'s allocator")


def _diet_row(facts: dict) -> str:
    """What the diet pass did: which values are 16-bit now, the slots it changed, the bytes."""
    done = [f"{len(facts[key])} {what} now 16-bit" for key, what in
            (("dieted", "variables"), ("read_only", "variables the step only reads"),
             ("constants", "constants")) if facts.get(key)]
    if facts["slots_removed"] or facts["slots_added"]:
        done.append(f"optimizer slots -{len(facts['slots_removed'])} "
                    f"+{len(facts['slots_added'])}")
    done.append(f"{format_bytes(facts['bytes_saved'])} of persistent memory saved")
    if facts["forward_reads"]:
        done.append(f"forward reads {facts['forward_reads']}")
    return "; ".join(done)


def _floor_text(floor: dict) -> str:
    """`lossless_floor` for people: what no lossless rewrite goes below, and why."""
    return (f"{format_bytes(floor['bytes'])}: the variables and constants "
            f"({format_bytes(floor['state_bytes'])}) and the fed inputs beside "
            f"{floor['at']}'s operands and scratch; no lossless rewrite (recomputation, swapping, running sums) "
            "goes below it")


def _peak_rows(facts: dict) -> list[tuple[str, str]]:
    """The headline peaks, those `verify` should measure (as run, after Grappler, when both
    steps were modelled so: the allocator's, kernel scratch included), then the peaks as
    written that the passes plan on (the most bytes of tensors live at once: what
    recomputation and swapping can change)."""
    def peaks(before: int, after: int, how: str) -> str:
        ratio = f"{after / before:.2f}x, " if before else ""
        return f"{format_bytes(before)} -> {format_bytes(after)} ({ratio}{how})"

    predicted, written = facts["peak_bytes_predicted"], facts["peak_bytes"]
    if predicted["model"] != "as_run":
        return [("modelled peak", peaks(written["before"], written["after"],
                                        "live tensors as written"))]
    on = " on a GPU" if predicted.get("device") == "gpu" else ""  # a swap's, on any machine
    return [("modelled peak", peaks(predicted["before"], predicted["after"],
                                    f"as run{on}, after Grappler")),
            ("as written", peaks(written["before"], written["after"],
                                 "live tensors, the step the passes plan on"
                                 if not (facts.get("rerun") or facts.get("recomputed_loops"))
                                 else "live tensors, a call or loop as one node: what loops "
                                 "keep is priced as run"))]


def format_summary(facts: dict) -> str:
    """The `inspect` table for people."""
    flow = facts["control_flow"]
    loops = facts["ops"].get("Enter", 0) + facts["ops"].get("RefEnter", 0)
    flow_text = ", ".join(filter(None, [
        f"v1 {'loop frames' if loops else 'conds'} ({flow['v1_loop_nodes']} nodes)"
        if flow["v1_loop_nodes"] else "",
        "functional " + "/".join(flow["functional"]) if flow["functional"] else ""])) or "none"
    rows = [
        ("file", f"{facts['file']} ({facts['format']})"),
        ("nodes", str(facts["nodes"])),
        ("functions", str(facts["functions"])),
        ("inputs", ", ".join(f"{i['name']} {i['dtype']}{i['shape']}" for i in facts["inputs"])
         or "none"),
        ("outputs", _shorten(facts["outputs"])),
        ("control flow", flow_text),
        *([("inlined", f"{len(facts['inlined_calls'])} calls holding the step's passes, "
                       "analysed spliced in as optimize does "
                       f"({_shorten(facts['inlined_calls'], 3)})")]
          if facts.get("inlined_calls") else []),
        ("variables", f"{len(facts['variables'])}" + (
            f" ({_shorten(facts['variables'], 4)})" if facts["variables"] else "")),
    ]
    if "peak_bytes" in facts:
        rows += [
            ("peak memory", f"{format_bytes(facts['peak_bytes'])} (modelled "
                            f"{'after Grappler' if facts['modelled_as'] == 'run' else 'as written'}"
                            f" on a {facts['modelled_on'].upper()}"
                            f", {format_bytes(facts['peak_bytes_as_written'])} as written; "
                            f"{format_bytes(facts['live_peak_bytes'])} of live tensors; persistent "
                            f"{format_bytes(facts['persistent_bytes'])}, peak at "
                            f"{facts['peak_node']})"),
            ("lossless floor", _floor_text(facts["lossless_floor"])),
            *([("loop pile-up", f"up to {format_bytes(facts['peak_bytes_bound'])} when a "
                                "loop's iterations run ahead of the gradients it sums "
                                "(parallel_iterations; a race between the executor's threads)")]
              if facts.get("peak_bytes_bound", 0) > facts["peak_bytes"] else []),
            ("host peak", format_bytes(facts["host_peak_bytes"])
             + (" (the fed inputs: the session holds them on a CPU)"
                if facts["host_peak_bytes"] and facts["modelled_on"] == "cpu" else "")
             + (f"; {format_bytes(facts['bytes_moved'])} moved between host and device per "
                f"step ({facts['transfer_seconds'] * 1000:.1f} ms at 16 GB/s)"
                if facts["bytes_moved"] else "")),
            ("forward", f"{facts['forward_nodes']} nodes; backward {facts['backward_nodes']} "
                        f"nodes; gradient seed {', '.join(facts['gradient_seeds']) or 'none'}"),
            ("FLOPs", f"{facts['flops'] / 1e9:.3f} GFLOP per step"),
        ]
        if facts.get("bytes_per_parameter"):
            rows.append(("parameters", f"{facts['trainable_parameters']} trainable, "
                                       f"{facts['bytes_per_parameter']:.2f} bytes each with "
                                       "optimizer state" + (
                                           f" ({facts['bytes_per_parameter_2d']:.2f} for "
                                           "matrices)" if facts["bytes_per_parameter_2d"]
                                           else "")))
        unknown = facts["unknown_shapes"]
        if unknown["count"]:
            rows.append(("unknown sizes", f"{unknown['count']} tensors count 0 bytes (e.g. "
                                          f"{', '.join(unknown['examples'][:3])}); "
                                          f"{unknown['hint']}"))
        by_data = facts["sized_by_data"]
        if by_data["count"]:
            rows.append(("sized by data", f"{by_data['count']} tensors count 0 bytes: only "
                                          "their values decide their size (e.g. "
                                          f"{', '.join(by_data['examples'][:3])})"))
        estimated = facts["estimated_sizes"]
        if estimated["count"]:
            rows.append(("estimated", f"{estimated['count']} Where ops splitting one tensor by "
                                      "its values sized at an even share, and what they feed "
                                      f"(e.g. {', '.join(estimated['examples'][:3])}): the "
                                      "data decides"))
    if facts.get("largest_batch"):
        rows.append(("largest batch", _fit_row(facts["largest_batch"])))
    if facts["train_op"]:
        rows.append(("train_op", ", ".join(facts["train_op"])))
    if facts["signatures"]:
        rows.append(("signatures", ", ".join(facts["signatures"])))
    lines = [f"{key:<13} {value}" for key, value in rows]
    if facts.get("live_at_peak"):
        lines.append("live at peak:")
        lines.extend(f"  {format_bytes(t['bytes']):>11}  {t['tensor']}" for t in facts["live_at_peak"])
    lines.append("ops:")
    ranked = sorted(facts["ops"].items(), key=lambda kv: (-kv[1], kv[0]))
    width = max((len(op) for op in facts["ops"]), default=0)
    lines.extend(f"  {op:<{width}} {count:>6}" for op, count in ranked)
    return "\n".join(lines)


# Report keys listing nodes, as table rows: the key, then what each listed node is.
NAMED_ROWS = (
    ("accumulated", "sums (AddN) now adding each term as it arrives"),
    ("reads_first", "reads of variables now before their updates (nothing ordered them)"),
    ("serial_loops", "loops of micro-batches or steps now one iteration at a time"),
    ("ungated", "gates the updates waited behind for every gradient, taken out"),
    ("rerun", "recurrent layers' forward passes run again before their backward passes"),
    ("tails_first", "head gradients the other heads' first heavy gradients now wait for"),
    ("micro_batches", "micro-batches (gradient seeds) now run after the previous one"),
    ("inlined", "function calls holding the forward or backward pass"),
    ("updates_inlined", "calls updating variables spliced in for diet (XLA-compiled ones now "
                        "run on TensorFlow's kernels)"),
    ("deferred", "values needing no gradient computed when their gradient is ready"),
    ("late_terms", "gradient terms computed when the other terms of their sum are ready"),
    ("applied_early", "parameters' updates run before the backward pass goes on"),
)


def _shorten(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


class Stages:
    """On a terminal, a line on stderr as each stage of a long `optimize` or `verify` begins,
    with the seconds so far (a 100k-node graph takes a minute to rewrite; verifying even a tiny
    one takes seconds); in logs and pipes only with `logged` (`-v`: a budget's lever sets can
    plan for twenty minutes, silent in a batch job's log)."""

    def __init__(self, enabled: bool = True, logged: bool = False):
        self.shown = enabled and (logged or sys.stderr.isatty())
        self.start = time.perf_counter()

    def __call__(self, stage: str) -> None:
        if self.shown:
            click.echo(f"{time.perf_counter() - self.start:6.1f} s  {stage}", err=True)


class Progress:
    """A bar on a terminal, one plain line per model elsewhere (CI logs)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.bar = None
        if sys.stderr.isatty():
            self.bar = click.progressbar(length=total, label="rewriting", file=sys.stderr)
            self.bar.__enter__()

    def update(self, line: dict) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            click.echo(f"[{self.done}/{self.total}] {line['status']:7} {line['path']} "
                       f"({line['seconds']}s)", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
