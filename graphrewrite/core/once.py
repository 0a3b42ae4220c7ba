"""Warnings said once over repeated work: a planner that runs the same analyses and passes
many times (every lever set of a budget, every batch probed) would repeat each warning as
often (a Keras Adamax step's diet warning, 12 times)."""

from __future__ import annotations

import contextlib
import logging

__all__ = ["each_warning_once"]


@contextlib.contextmanager
def each_warning_once(package: str = "graphrewrite"):
    """Within the block, a record logged again by the same logger of `package` with the same
    text is dropped."""
    said = set()

    def first(record: logging.LogRecord) -> bool:
        key = (record.name, record.getMessage())
        fresh = key not in said
        said.add(key)
        return fresh

    loggers = [logging.getLogger(package)] + [
        logger for name, logger in logging.Logger.manager.loggerDict.items()
        if name.startswith(package + ".") and isinstance(logger, logging.Logger)]
    for logger in loggers:
        logger.addFilter(first)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(first)
