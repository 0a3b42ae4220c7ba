"""Pipeline text: the grammar of TensorFlow's Graph Transform Tool, and the command line's options
written into it.

Passes are separated by whitespace, each with optional options, `name(key=value, key2="quoted,
value")`. Every character is read or the text is refused with an error naming what could not be
read. The command line's options (`--checkpoints`, `--swap`, `--budget`, ...) become options in
that text before anything runs (`compose`), so the report's pipeline is exactly what ran, and
replaying it with `--passes` rewrites the same way.
"""

from __future__ import annotations

import re

from ..core.errors import GraphRewriteError
from ..passes import PASSES
from ..planning.budget import parse_budget
from .modes import MODES

__all__ = ["OPTION_TARGETS", "LOSSY_LEVERS", "parse_pipeline", "format_pipeline", "pass_options",
           "compose"]

_NAME = re.compile(r"[A-Za-z_]\w*")
_SPACE = re.compile(r"\s*")
_BARE = re.compile(r'[^\s,()"]+')               # an unquoted value
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')    # a quoted one: \" and \\ escape
_PLAIN = re.compile(r'[^\s,()"\\=]+')           # values written back without quotes

# The passes that change the numbers, in pipeline order: the chunked loss matches the final
# projection's weight as read before diet reads it through a dequantization.
LOSSY_LEVERS = ("chunk_loss", "diet")

# `compose`'s options -> (the pass each becomes an option of, the option's name there)
OPTION_TARGETS = {
    "checkpoints": ("recompute", "checkpoints"),
    "tensors": ("swap", "tensors"),
    "form": ("swap", "form"),
    "bandwidth": ("swap", "bandwidth"),
    "profile": ("swap", "profile"),
    "pin_keep": ("recompute", "pin_keep"),
    "pin_recompute": ("recompute", "pin_recompute"),
    "pin_never": ("recompute", "pin_never"),
    "planner": ("recompute", "planner"),
}


def parse_pipeline(text: str) -> list[tuple[str, dict[str, str]]]:
    """`'recompute(policy=speed) swap'` -> [('recompute', {'policy': 'speed'}), ('swap', {})];
    the empty text is the empty pipeline. Anything unreadable is a GraphRewriteError."""
    steps: list[tuple[str, dict[str, str]]] = []
    pos = _SPACE.match(text).end()
    if pos == len(text) and text:
        raise GraphRewriteError(f"pipeline {text!r} names no pass")
    while pos < len(text):
        match = _NAME.match(text, pos)
        if not match:
            _unreadable(text, pos, "expected a pass name")
        start, name, pos = pos, match.group(), match.end()
        if name not in PASSES:
            raise GraphRewriteError(f"unknown pass '{name}' (passes: {', '.join(PASSES)})")
        options: dict[str, str] = {}
        if text.startswith("(", pos):
            pos = _options(text, pos + 1, start, options)
        after = _SPACE.match(text, pos).end()
        if after == pos and pos < len(text):
            _unreadable(text, pos, "passes are separated by spaces")
        steps.append((name, options))
        pos = after
    return steps


def _options(text: str, pos: int, start: int, into: dict[str, str]) -> int:
    """Reads `key=value, ...)` from `pos` into `into`; returns where the `)` ends."""
    pos = _SPACE.match(text, pos).end()
    if text.startswith(")", pos):
        return pos + 1
    while True:
        key = _NAME.match(text, pos)
        if not key:
            _unreadable(text, pos, "expected an option name" if pos < len(text) else
                        "no closing ')'", start)
        pos = _SPACE.match(text, key.end()).end()
        if not text.startswith("=", pos):
            _unreadable(text, pos, f"expected '=' after '{key.group()}'", start)
        pos = _SPACE.match(text, pos + 1).end()
        quoted = _QUOTED.match(text, pos)
        value = _BARE.match(text, pos)
        if quoted:
            into_value, pos = re.sub(r"\\(.)", r"\1", quoted.group(1)), quoted.end()
        elif value:
            into_value, pos = value.group(), value.end()
        else:
            _unreadable(text, pos, "no closing quote" if text.startswith('"', pos) else
                        f"expected a value for '{key.group()}'", start)
        if key.group() in into:
            raise GraphRewriteError(f"pipeline {text!r}: option '{key.group()}' given twice")
        into[key.group()] = into_value
        pos = _SPACE.match(text, pos).end()
        if text.startswith(")", pos):
            return pos + 1
        if not text.startswith(",", pos):
            _unreadable(text, pos, "expected ',' or ')'" if pos < len(text) else
                        "no closing ')'", start)
        pos = _SPACE.match(text, pos + 1).end()


def _unreadable(text: str, pos: int, why: str, start: int | None = None):
    """Raise the error naming the text that could not be read (from `start`, else `pos`)."""
    shown = text[pos if pos < len(text) or start is None else start:]
    raise GraphRewriteError(f"pipeline {text!r}: cannot read {shown!r} ({why}; the grammar: "
                            'pass(key=value, key2="quoted, value") pass2 ...)')


def format_pipeline(steps: list[tuple[str, dict[str, str]]]) -> str:
    """The text `parse_pipeline` reads back as `steps`."""
    def value(text: str) -> str:
        if _PLAIN.fullmatch(text):
            return text
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return " ".join(name + (f"({', '.join(f'{k}={value(v)}' for k, v in options.items())})"
                            if options else "") for name, options in steps)


def pass_options(name: str, raw: dict[str, str]):
    """The typed options of pass `name` from its text options."""
    return PASSES[name].options.from_text(name, raw)


def compose(mode: str, passes: str | None = None, checkpoints: str | None = None,
            swap_options: dict | None = None, swap_checkpoints: bool = False,
            budget: str | None = None, planner: str | None = None,
            pins: dict | None = None, lossy: bool | tuple[str, ...] = False) -> str:
    """The pipeline that `mode` (or the text `passes`, which replaces it) and the command line's
    options describe, with each option written into the passes it is for.

    `swap_checkpoints` adds a swap pass after recomputation, which then moves the checkpoints
    to host memory. `swap_options` holds the swap pass's `tensors`, `form` and `bandwidth`.
    `budget` (bytes, or a share of the original's modelled peak, resolved when the pipeline
    runs) goes to the passes that search, `planner` to recompute, `pins` ({keep, recompute,
    never}: selectors) to recompute as its `pin_` options. `lossy` adds levers that change the
    numbers, after the calls are inlined: True, `chunk_loss` (rounding only); or passes of
    LOSSY_LEVERS to add, with options (`diet(min_size=65536)`). Every option is checked here,
    before any work is done."""
    if mode not in MODES:
        raise GraphRewriteError(f"unknown mode '{mode}' (modes: {', '.join(MODES)})")
    if passes is not None and not passes.strip():
        raise GraphRewriteError(f"${{passes}} {passes!r} names no pass (use ${{mode}} none to "
                                "rewrite nothing)")
    steps = parse_pipeline(MODES[mode] if passes is None else passes)
    names = [name for name, _ in steps]
    if lossy:
        if passes is not None:
            raise GraphRewriteError("${lossy} adds passes to a mode's; with ${passes}, name "
                                    "them there (chunk_loss)")
        if not steps or names == ["diet"]:
            raise GraphRewriteError(f"${{lossy}} needs mode memory, speed, collection or "
                                    f"swap, not '{mode}'")
        at = names.index("inline") + 1 if "inline" in names else 0
        levers = parse_pipeline(" ".join(("chunk_loss",) if lossy is True else lossy))
        other = next((name for name, _ in levers if name not in LOSSY_LEVERS), None)
        if other:
            raise GraphRewriteError(f"${{lossy}}: '{other}' is not a lossy lever "
                                    f"({', '.join(LOSSY_LEVERS)})")
        levers.sort(key=lambda step: LOSSY_LEVERS.index(step[0]))
        steps[at:at] = levers
        names[at:at] = [name for name, _ in levers]
    if swap_checkpoints:
        if "recompute" not in names or "swap" in names:
            raise GraphRewriteError(f"${{swap_checkpoints}} needs a recompute mode "
                                    f"(memory, speed, collection), not '{mode}'")
        steps.append(("swap", {}))
    given = {"checkpoints": checkpoints, "planner": planner, **(swap_options or {}),
             **{f"pin_{kind}": text for kind, text in (pins or {}).items()}}
    for key, value in given.items():
        target, option = OPTION_TARGETS[key]
        if value is None or value == "":
            continue
        raws = [raw for name, raw in steps if name == target]
        if not raws:
            having = [m for m, text in MODES.items() if target in text]
            raise GraphRewriteError(f"${{{key}}} needs a {target} pass: mode "
                                    f"{', '.join(having[:-1])} or {having[-1]}"
                                    f"{' (or ${swap_checkpoints})' if target == 'swap' else ''}, "
                                    f"not '{mode}'")
        for raw in raws:
            raw[option] = str(value)
    if budget is not None:
        parse_budget(budget, 0)  # malformed or not positive: refused before the search below
        raws = [raw for name, raw in steps if pass_options(name, raw).takes_budget()]
        if not raws:
            raise GraphRewriteError(f"${{budget}} needs mode memory or swap (or "
                                    f"${{swap_checkpoints}}), not '{mode}'")
        for raw in raws:
            raw["budget"] = budget
    for name, raw in steps:
        pass_options(name, raw)
    return format_pipeline(steps)
