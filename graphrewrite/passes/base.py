"""What every pass shares: its options (converted from pipeline text in one place) and its result.

A pass is `run(graph, analysis, options, model) -> PassResult`. Its options are a frozen dataclass
deriving from `PassOptions`; `PassOptions.from_text` turns the pipeline's `key=value` strings into
the typed fields (by the dataclass's type hints), so no pass parses text itself. Each pass returns
its own `PassResult` subclass with typed fields; its `section` is what the optimize report shows
of it (every field, under stable keys), so the report iterates the results and names no pass. Two
runs of one pass in a pipeline are combined with `then`, so the second adds to the first instead
of replacing it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass

from ..core.errors import GraphRewriteError
from ..core.graph import Graph

__all__ = ["TRUE", "FALSE", "EXAMPLES", "COMMON_FIELDS", "PassOptions", "PassResult", "counted",
           "merged"]

TRUE, FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
EXAMPLES = 3  # names shown of each reason something was left alone
# Fields every result has; the others are the pass's own, and its report section.
COMMON_FIELDS = ("graph", "modified", "shapes", "note", "memory")


@dataclass(frozen=True)
class PassOptions:
    """Base of every pass's options."""

    def takes_budget(self) -> bool:
        """Whether the pass searches, and so can stop at a memory budget (`--budget`)."""
        return False

    @classmethod
    def from_text(cls, pass_name: str, raw: dict[str, str]):
        """The options from pipeline text: each value converted to its field's type, or a
        GraphRewriteError naming the pass and the option."""
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in raw if key not in names]
        if unknown:
            raise GraphRewriteError(f"pass '{pass_name}' has no option '{unknown[0]}' "
                                    f"(options: {', '.join(names) or 'none'})")
        return cls(**{key: _convert(pass_name, key, hints[key], value)
                      for key, value in raw.items()})


def _convert(pass_name: str, key: str, hint, text: str):
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[X]
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    expects = None
    if hint is bool:
        if text.lower() in TRUE + FALSE:
            return text.lower() in TRUE
        expects = "true or false"
    elif hint is int:
        try:
            return int(text)
        except ValueError:
            expects = "an integer"
    elif hint is float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return value
        expects = "a number"
    else:
        return text
    raise GraphRewriteError(f"pass '{pass_name}': option '{key}' expects {expects}, not '{text}'")


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) graph, whether it changed, and what it did not do."""

    graph: Graph | None = None
    modified: bool = False
    shapes: object = None  # the new graph's Shapes, when the pass knows them (saves inference)
    note: str = ""         # why the pass did less than it could (or nothing), for the report
    memory: object = None  # the new graph's simulated step (no device named), when the pass made it

    def section(self) -> dict:
        """This pass's part of the optimize report: its own fields, as plain data."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in COMMON_FIELDS}

    def then(self, later: PassResult) -> PassResult:
        """This result followed by `later`, of the same pass run again: lists extend, counts
        add up, notes join; the graph is the later one's."""
        combined = {}
        for f in dataclasses.fields(self):
            first, second = getattr(self, f.name), getattr(later, f.name)
            if f.name in ("graph", "shapes", "memory"):
                combined[f.name] = second
            elif isinstance(first, bool):
                combined[f.name] = first or second
            elif isinstance(first, str):  # notes join; a repeated value stays one
                combined[f.name] = first if first == second else " ".join(
                    filter(None, (first, second)))
            elif isinstance(first, dict):
                combined[f.name] = {k: first.get(k, []) + second.get(k, [])
                                    for k in {**first, **second}}
            else:  # lists extend, numbers add up
                combined[f.name] = first + second
        return type(self)(**combined)


    # before their backward passes


def counted(by_reason: dict[str, list[str]]) -> dict[str, dict]:
    """{reason: names} as the report shows it: {reason: {count, examples}}."""
    return {reason: {"count": len(names), "examples": names[:EXAMPLES]}
            for reason, names in by_reason.items()}


def merged(sections) -> dict:
    """The report sections of several passes as one: a key two passes share adds up (counts,
    lists, {reason: {count, examples}}), as `then` combines two runs of one pass."""
    found: dict = {}
    for section in sections:
        for key, value in section.items():
            if key not in found:
                found[key] = value
            elif isinstance(value, dict):
                found[key] = {reason: {"count": found[key].get(reason, {}).get("count", 0)
                                       + value.get(reason, {}).get("count", 0),
                                       "examples": (found[key].get(reason, {}).get("examples", [])
                                                    + value.get(reason, {}).get("examples", [])
                                                    )[:EXAMPLES]}
                              for reason in {**found[key], **value}}
            elif isinstance(value, bool):
                found[key] = found[key] or value
            else:
                found[key] = found[key] + value
    return found
