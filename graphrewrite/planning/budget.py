"""Memory budgets: what `--budget` accepts, in bytes or as a share of the original peak."""

from __future__ import annotations

import re

from ..core.errors import GraphRewriteError

__all__ = ["UNITS", "parse_budget"]

UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_budget(text: str | None, peak: int) -> int:
    """`6GiB`, `512MB`, `1048576` or `60%` (of `peak`) -> bytes; None -> 0 (as low as it goes).
    Zero or less is refused: no budget is written by leaving it out.

    >>> parse_budget("60%", 1000), parse_budget("2KiB", 0)
    (600, 2048)
    """
    if text is None:
        return 0
    match = re.fullmatch(r"\s*([-+]?[0-9.]+)\s*(%|[KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    try:
        value = float(match.group(1)) if match else None
    except ValueError:
        value = None
    if value is None:
        raise GraphRewriteError(f"budget '{text}': expected bytes like 6GiB or a share like 60%")
    unit = (match.group(2) or "B").upper()
    if value <= 0 or (unit != "%" and value * UNITS[unit] < 1):
        raise GraphRewriteError(f"budget '{text}': a budget must be positive")
    if unit == "%":
        if value > 100:  # above the original's peak: nothing to reach, the budget would be moot
            raise GraphRewriteError(f"budget '{text}': a share of the original's peak is at "
                                    "most 100%")
        return int(peak * value / 100)
    return int(value * UNITS[unit])
