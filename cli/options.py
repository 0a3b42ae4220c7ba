"""Options several commands share (analysis, device, tags, plots, modes) and logging to stderr.
Only click and the standard library at import: TensorFlow loads inside the callbacks that need
it."""

from __future__ import annotations

import logging
import sys

import click

from graphrewrite.core import errors
from graphrewrite.core.once import SaidOnce

# The library's parameters, as its error messages name them (`${input_shapes}`: see
# graphrewrite.core.errors), and the flags that set them here.
FLAGS = {
    "input_shapes": "--input-shape", "fetches": "--outputs", "backward_scope": "--backward-scope",
    "device": "--device", "tag": "--tag", "in_place": "--in-place", "plot": "--plot",
    "mode": "--mode", "passes": "--passes", "checkpoints": "--checkpoints", "tensors": "--swap",
    "form": "--swap-form", "bandwidth": "--bandwidth", "profile": "--device-profile",
    "device_profile": "--device-profile", "swap_checkpoints": "--swap-checkpoints",
    "budget": "--budget", "planner": "--planner", "plan": "--plan", "plan_out": "--plan-out",
    "executor": "--executor", "force": "--force", "data": "--data", "steps": "--steps",
    "int_high": "--int-high", "feeds": "--feed", "batches": "--batches",
    "device_memory": "--device-memory", "pin_keep": "--pin keep",
    "pin_recompute": "--pin recompute", "pin_never": "--pin never", "lossy": "--lossy",
    "rtol": "--rtol",
}

__all__ = ["FLAGS", "parse_pins", "memory_option", "setup_logging", "plot_option", "tag_option",
           "analysis_options", "device_option", "mode_option", "parse_feeds"]


class _StderrFormatter(logging.Formatter):
    def format(self, record):
        text = errors.render(record.getMessage(), FLAGS)  # `${fetches}` as `--outputs`
        return f"graphrewrite: {record.levelname.lower()}: {text}"


def setup_logging(verbose: bool, quiet: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_StderrFormatter())
    # A warning already printed is not printed again: a command analyses the original, its
    # rewrite and both steps as run, and each said the same (an input of unknown batch: "226
    # tensors have an unknown size", four times in one optimize).
    handler.addFilter(SaidOnce(logging.WARNING))
    logger = logging.getLogger("graphrewrite")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.ERROR if quiet else logging.INFO if verbose else logging.WARNING)


def _check_plot(ctx, param, value):
    """Refuse a --plot that cannot be drawn before the command runs (and writes anything)."""
    if value is not None:
        from graphrewrite.reporting import plot

        plot.check(value)
    return value


def plot_option(what: str):
    """`--plot FILE`, drawing `what`; the format and the extra it needs are the same for all."""
    return click.option("--plot", "plot_path", type=click.Path(), metavar="FILE",
                        callback=_check_plot,
                        help=f"Draw {what} (.png, .svg or .pdf; needs pip install "
                             "'graphrewrite[plot]').")


tag_option = click.option("--tag", metavar="TAGS",
                          help="SavedModel only: the MetaGraph's tag set, comma-separated "
                               "(default: the only one, else 'serve').")


def _parse_input_shapes(ctx, param, values):
    from graphrewrite.analysis.shapes import parse_input_shape

    try:
        return dict(parse_input_shape(v) for v in values)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None


def _parse_memory(ctx, param, value):
    """`16GiB`, `80GB`, bytes: a device's memory (a share of a peak means nothing here)."""
    if value is None:
        return None
    from graphrewrite.core.errors import GraphRewriteError
    from graphrewrite.planning.budget import parse_budget

    try:
        if value.strip().endswith("%"):
            raise GraphRewriteError("give the device's memory in bytes (16GiB, 80GB)")
        return parse_budget(value, 0)
    except GraphRewriteError as err:
        raise click.BadParameter(str(err).replace("budget", "size")) from None


def parse_pins(ctx, param, values) -> dict[str, str]:
    """`--pin keep=op:Conv2D --pin never=scope:embed` -> {kind: selectors} (one kind given
    twice: both selector lists)."""
    pins: dict[str, list[str]] = {}
    for text in values:
        kind, sep, selectors = text.partition("=")
        if not sep or kind not in ("keep", "recompute", "never") or not selectors.strip():
            raise click.BadParameter(f"expected keep=, recompute= or never= followed by "
                                     f"selectors, not '{text}'")
        pins.setdefault(kind, []).append(selectors)
    return {kind: ",".join(lists) for kind, lists in pins.items()}


def memory_option(command):
    """`--device-memory SIZE`: the largest batch that fits (`planning.fit`)."""
    return click.option(
        "--device-memory", "device_memory", metavar="SIZE", callback=_parse_memory,
        help="A device's memory (16GiB, 80GB): report the largest batch whose modelled step "
             "fits it, for a graph whose inputs have an unknown batch dimension.")(command)


def _parse_names(ctx, param, value):
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def analysis_options(command):
    """Options every command that models memory shares."""
    for option in reversed([
        click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:D0,D1,..",
                     callback=_parse_input_shapes,
                     help="Fix a placeholder's unknown dimensions (repeatable), e.g. "
                          "--input-shape images:8,224,224,3."),
        click.option("--outputs", callback=_parse_names, metavar="NAMES",
                     help="Comma-separated nodes one step fetches (default: a MetaGraphDef's "
                          "train_op and losses collections, else every sink)."),
        click.option("--backward-scope", metavar="PREFIX",
                     help="Treat nodes under this name prefix as the start of the backward pass "
                          "(default: found from gradient ops and the gradient seed)."),
    ]):
        command = option(command)
    return command


def device_option(command):
    """--device: the kind of device whose kernel scratch and allocator the model assumes."""
    return click.option(
        "--device", type=click.Choice(["cpu", "gpu"]), default=None,
        help="Model the step on this kind of device: its kernels' scratch (gpu: cuDNN "
             "workspace, an unmeasured estimate) and its allocator (default: gpu when a node "
             "is placed on a GPU, else cpu).")(command)


def _mode_help() -> str:
    from graphrewrite.pipeline.modes import MODE_HELP

    return "Rewrite to run. " + "; ".join(f"{k}: {v}" for k, v in MODE_HELP.items()) + "."


def _check_mode(ctx, param, value):
    from graphrewrite.pipeline.modes import MODES

    if value not in MODES:
        raise click.BadParameter(f"unknown mode '{value}'; modes: {', '.join(MODES)}")
    return value


mode_option = click.option("--mode", default="memory", show_default=True, metavar="MODE",
                           callback=_check_mode, help=_mode_help())


def parse_feeds(ctx, param, values):
    feeds = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise click.BadParameter(f"expected NAME=FILE.npy, not '{value}'")
        feeds[name] = path
    return feeds
